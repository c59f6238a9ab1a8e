"""Entry-point functions: how vLLM and vllm-omni find this package (see pyproject.toml).

- ``cpu_omni_platform`` (group ``vllm_omni.platform_plugins``): the CPU omni platform's qualname
  when no accelerator is present (VLLM_OMNI_CPU_PLATFORM=auto) or when forced (=1), else None.
- ``cpu_vllm_platform`` (group ``vllm.platform_plugins``): under the same condition, and where
  vLLM detects its CPU build, vLLM's CPU platform plus the omni-stage config adjustments
  (``omni_cpu_fastpath.serving.vllm_platform``), so that a plain ``vllm serve MODEL --omni`` runs.
- ``register_models`` (group ``vllm_omni.general_plugins``, run in the engine and in every
  worker before model load): registers ``FastQwen3TTSTalker`` and ``FastQwen3TTSCode2Wav`` under
  the stock architecture names when VLLM_OMNI_CPU_FASTPATH is on, and puts the stock classes back
  when it is off; registers the talker's int8 decoder-linear methods with vLLM's
  ``register_quantization_config`` (``omni_cpu_fastpath.qwen3_tts.quant.talker_int8``), which
  VLLM_OMNI_TALKER_INT8 selects.

Registration goes through vllm-omni's public API (``OmniModelRegistry.register_model``); nothing
here assigns attributes on vllm or vllm_omni. The CPU deploy config that ``omni-cpu-fastpath
serve`` passes lives in ``omni_cpu_fastpath.serving.deploy_config``.
Importing this module imports neither vllm nor torch.
"""

from __future__ import annotations

import logging
from typing import Any

from omni_cpu_fastpath import envs

# A child of vLLM's "vllm" logger, so our lines appear in vLLM's log format and level.
logger = logging.getLogger(f"vllm.{__name__}")

PLATFORM_QUALNAME = "omni_cpu_fastpath.serving.omni_platform.CpuOmniPlatform"
VLLM_PLATFORM_QUALNAME = "omni_cpu_fastpath.serving.vllm_platform.CpuVllmPlatform"
TALKER_ARCH = "Qwen3TTSTalkerForConditionalGeneration"
FAST_TALKER = "omni_cpu_fastpath.qwen3_tts.talker:FastQwen3TTSTalker"
CODE2WAV_ARCH = "Qwen3TTSCode2Wav"
FAST_CODE2WAV = "omni_cpu_fastpath.qwen3_tts.code2wav:FastQwen3TTSCode2Wav"
# Each architecture we serve, by the class that serves it on the fast path.
FAST_MODELS = {TALKER_ARCH: FAST_TALKER, CODE2WAV_ARCH: FAST_CODE2WAV}

# What the registry held before we replaced it, so that switching the fast path off in a later
# call (same process) serves the stock class again.
_stock_entries: dict[str, Any] = {}


def cpu_omni_platform() -> str | None:
    """Qualname of the CPU omni platform, or None when it must stay inactive."""
    try:
        wanted = envs.get("VLLM_OMNI_CPU_PLATFORM")
    except envs.FlagError as exc:
        # vllm-omni swallows exceptions from platform plugins at debug level: say it loudly.
        logger.error("omni-cpu-fastpath: CPU omni platform not activated: %s", exc)
        raise
    if not wanted:
        logger.debug(
            "omni-cpu-fastpath: CPU omni platform off (VLLM_OMNI_CPU_PLATFORM=%s)",
            envs.raw("VLLM_OMNI_CPU_PLATFORM"),
        )
        return None
    return PLATFORM_QUALNAME


def cpu_vllm_platform() -> str | None:
    """Qualname of vLLM's CPU platform with the omni-stage adjustments, or None.

    Active only where vLLM itself detects its CPU platform and the CPU omni platform is allowed:
    it then replaces ``CpuPlatform`` by a subclass that fixes up omni stage configs (V1 runner,
    eager, bounded KV cache) in ``check_and_update_config``.
    """
    if cpu_omni_platform() is None:
        return None
    from vllm.platforms import cpu_platform_plugin

    if cpu_platform_plugin() is None:
        return None
    return VLLM_PLATFORM_QUALNAME


def register_models() -> None:
    """Serve the talker and code2wav architectures by the fast or the stock classes, as the flags say,
    and register the talker's int8 quantization methods with vLLM. Idempotent."""
    envs.validate_all()
    fast = bool(envs.get("VLLM_OMNI_CPU_FASTPATH"))
    for arch, qualname in FAST_MODELS.items():
        _register(arch, qualname, fast)
    # Before any stage config is built (vLLM checks a stage's quantization name against its
    # registry then), in every process that builds or loads one.
    from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import register

    register()


def _register(arch: str, fast_qualname: str, fast: bool) -> None:
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    current = OmniModelRegistry.models.get(arch)
    ours = _is_fast_entry(current, fast_qualname)
    fast_name = fast_qualname.split(":")[1]
    if fast:
        if not ours:
            _stock_entries[arch] = current
            OmniModelRegistry.register_model(arch, fast_qualname)
            logger.info("omni-cpu-fastpath: %s served by %s", arch, fast_name)
    elif ours and _stock_entries.get(arch) is not None:
        # Put the stock entry back through the same public API (a "module:class" string).
        stock_entry = _stock_entries[arch]
        OmniModelRegistry.register_model(arch, f"{stock_entry.module_name}:{stock_entry.class_name}")
        logger.info("omni-cpu-fastpath: %s back to the stock class (VLLM_OMNI_CPU_FASTPATH off)", arch)


def _is_fast_entry(entry: Any, fast_qualname: str) -> bool:
    module, name = fast_qualname.split(":")
    return (
        entry is not None
        and getattr(entry, "module_name", None) == module
        and getattr(entry, "class_name", None) == name
    )
