"""A CPU omni platform for vllm-omni: vLLM's ``CpuPlatform`` plus the omni interfaces.

vllm-omni 0.30 ships omni platforms for CUDA, ROCm, NPU, XPU and MUSA only; on a CPU-only machine
``current_omni_platform`` is ``UnspecifiedOmniPlatform``, whose worker lookups raise. This class is
returned by ``omni_cpu_fastpath.serving.plugins.cpu_omni_platform`` (entry-point group
``vllm_omni.platform_plugins``) and names the CPU workers of ``omni_cpu_fastpath.serving.worker``.

It is only ever instantiated by vllm-omni's lazy ``current_omni_platform`` lookup; it changes no
global state itself.
"""

from __future__ import annotations

import logging
import sys

if "vllm_omni" not in sys.modules:
    # vllm-omni resolves its platform while ``import vllm_omni`` runs and then imports this
    # module by name; importing this module first would start that resolution from inside it
    # and hand vllm-omni a half-built module.
    raise ImportError(
        "omni_cpu_fastpath.serving.omni_platform is loaded by vllm-omni's platform resolution: "
        "import vllm_omni before importing it"
    )

import torch  # noqa: E402
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum  # noqa: E402

from .vllm_platform import CpuVllmPlatform  # noqa: E402

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

AR_WORKER = "omni_cpu_fastpath.serving.worker.CPUARWorker"
GENERATION_WORKER = "omni_cpu_fastpath.serving.worker.CPUGenerationWorker"


class CpuOmniPlatform(OmniPlatform, CpuVllmPlatform):
    """Omni platform for CPU-only hosts.

    ``OmniPlatform`` comes first in the bases (as in vllm-omni's CUDA platform), so every method it
    declares as ``NotImplementedError`` is defined here; everything else is vLLM's ``CpuPlatform``
    (device name/type ``cpu``, gloo, CPU attention backend, memory-node queries), with the omni
    stage config adjustments of :class:`omni_cpu_fastpath.serving.vllm_platform.CpuVllmPlatform`.
    """

    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return AR_WORKER

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return GENERATION_WORKER

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # The stock code predictor asks this before compiling itself; on CPU it runs eager
        # (compiling is the fast predictor's business, behind VLLM_OMNI_PREDICTOR_COMPILE).
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        if selected_backend is not None and selected_backend.upper() != "TORCH_SDPA":
            raise ValueError(
                f"diffusion attention backend {selected_backend!r} is not available on CPU; use TORCH_SDPA"
            )
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        # One logical "device": every stage lives in host memory; stage configs say devices: "0".
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        return int(get_memory_node_info().available_memory)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        from vllm.utils.cpu_resource_utils import get_memory_node_info

        info = get_memory_node_info()
        return int(info.available_memory), int(info.total_memory)

    @classmethod
    def supports_float64(cls) -> bool:
        return True
