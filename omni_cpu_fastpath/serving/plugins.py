"""Entry-point functions: how vllm-omni finds this package (see pyproject.toml).

- ``cpu_omni_platform`` (group ``vllm_omni.platform_plugins``): the CPU omni platform's qualname
  when no accelerator is present (VLLM_OMNI_CPU_PLATFORM=auto) or when forced (=1), else None.
- ``cpu_vllm_platform`` (group ``vllm.platform_plugins``): under the same condition, and where
  vLLM detects its CPU build, vLLM's CPU platform plus the omni-stage config adjustments
  (``omni_cpu_fastpath.serving.vllm_platform``), so that a plain ``vllm serve MODEL --omni`` runs.
- ``register_models`` (group ``vllm_omni.general_plugins``, run in the engine and in every
  worker before model load): registers ``FastQwen3TTSTalker`` under the stock architecture name
  when VLLM_OMNI_CPU_FASTPATH is on, and, on the CPU platform, a Qwen3-TTS pipeline whose default
  deploy config runs on CPU (V1 runners, eager, bounded memory, one core split per stage).

Both go through vllm-omni's public registration APIs (``OmniModelRegistry.register_model``,
``pipeline_registry.register_pipeline``); nothing here assigns attributes on vllm or vllm_omni.
Importing this module imports neither vllm nor torch.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from omni_cpu_fastpath import envs

# A child of vLLM's "vllm" logger, so our lines appear in vLLM's log format and level.
logger = logging.getLogger("vllm.omni_cpu_fastpath.serving.plugins")

PLATFORM_QUALNAME = "omni_cpu_fastpath.serving.omni_platform.CpuOmniPlatform"
VLLM_PLATFORM_QUALNAME = "omni_cpu_fastpath.serving.vllm_platform.CpuVllmPlatform"
TALKER_ARCH = "Qwen3TTSTalkerForConditionalGeneration"
FAST_TALKER = "omni_cpu_fastpath.qwen3_tts.talker:FastQwen3TTSTalker"
QWEN3_TTS_MODEL_TYPE = "qwen3_tts"

# What the registry held before we replaced it, so that switching the fast path off in a later
# call (same process) serves the stock class again.
_stock_talker_entry: Any = None


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
    """Register the fast talker and the CPU Qwen3-TTS pipeline. Idempotent."""
    envs.validate_all()
    _register_talker(bool(envs.get("VLLM_OMNI_CPU_FASTPATH")))


def _register_talker(fast: bool) -> None:
    global _stock_talker_entry
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    current = OmniModelRegistry.models.get(TALKER_ARCH)
    ours = _is_fast_entry(current)
    if fast:
        if not ours:
            _stock_talker_entry = current
            OmniModelRegistry.register_model(TALKER_ARCH, FAST_TALKER)
            logger.info("omni-cpu-fastpath: %s served by FastQwen3TTSTalker", TALKER_ARCH)
    elif ours and _stock_talker_entry is not None:
        # Put the stock entry back through the same public API (a "module:class" string).
        stock = f"{_stock_talker_entry.module_name}:{_stock_talker_entry.class_name}"
        OmniModelRegistry.register_model(TALKER_ARCH, stock)
        logger.info("omni-cpu-fastpath: %s back to the stock class (VLLM_OMNI_CPU_FASTPATH off)", TALKER_ARCH)


def _is_fast_entry(entry: Any) -> bool:
    return (
        entry is not None
        and getattr(entry, "module_name", None) == FAST_TALKER.split(":")[0]
        and getattr(entry, "class_name", None) == FAST_TALKER.split(":")[1]
    )


# --- the CPU deploy config of Qwen3-TTS ---------------------------------------------------------

# vllm-omni's qwen3_tts.yaml is written for one GPU: Model Runner V2 (Triton kernels), CUDA graphs,
# 30 % of device memory per stage. On CPU: V1 runners, eager (no graphs; compiling the talker
# with inductor takes minutes on a few cores), a fixed KV budget rather than 30 % of host RAM.
CPU_DEPLOY_VERSION = 1


def cpu_stage_envs(cpus: list[int] | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """OpenMP settings of the talker and code2wav workers, from the CPUs this process may use.

    The talker decodes one frame after another and is the latency-critical stage; code2wav runs
    once per audio chunk. With 4 or more CPUs the talker binds to all but the last one and code2wav
    binds to the last one. With fewer, the talker binds to all of them and code2wav runs one
    unbound thread (it shares a core only while a chunk decodes). A VLLM_CPU_OMP_THREADS_BIND
    set by the user wins: then nothing is set per stage.
    """
    if os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}, {}
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 4:
        talker = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:-1]))}
        code2wav = {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[-1])}
    else:
        talker = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
        code2wav = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
    return talker, code2wav


def cpu_deploy_overlay(base_config: str, cpus: list[int] | None = None) -> dict[str, Any]:
    """The CPU overlay on vllm-omni's qwen3_tts.yaml (``base_config`` inheritance)."""
    talker_env, code2wav_env = cpu_stage_envs(cpus)
    talker: dict[str, Any] = {
        "stage_id": 0,
        "enforce_eager": True,
        "max_num_seqs": 8,
        "max_model_len": 4096,
        "async_scheduling": False,
    }
    code2wav: dict[str, Any] = {
        "stage_id": 1,
        "enforce_eager": True,
        "max_num_seqs": 8,
        "async_scheduling": False,
        # CPU kernels for bf16 convolutions are not faster everywhere; fp32 is exact.
        "dtype": "float32",
    }
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        # 4096 tokens x 28 layers x 8 kv heads x 128 x 2 (k, v) x 4 B is 0.9 GiB for the 0.6B talker.
        talker["kv_cache_memory_bytes"] = 1 << 30
        code2wav["kv_cache_memory_bytes"] = 64 << 20
    if talker_env:
        talker["env"] = talker_env
    if code2wav_env:
        code2wav["env"] = code2wav_env
    return {
        "base_config": base_config,
        "model_runner": "v1",
        "stages": [talker, code2wav],
    }


def cpu_deploy_config_path() -> Path:
    """Write (if changed) and return the CPU deploy config of Qwen3-TTS.

    It lives in a cache folder, not in the package, because ``base_config`` must name the
    installed vllm-omni's own qwen3_tts.yaml, whose path depends on the install.
    """
    import vllm_omni
    import yaml

    base = Path(vllm_omni.__file__).parent / "deploy" / "qwen3_tts.yaml"
    text = (
        f"# Written by omni-cpu-fastpath (version {CPU_DEPLOY_VERSION}); regenerated as needed.\n"
        + yaml.safe_dump(cpu_deploy_overlay(str(base)), sort_keys=False)
    )
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "omni-cpu-fastpath"
    digest = _digest(text)
    path = cache / f"qwen3_tts_cpu-{digest}.yaml"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode()).hexdigest()[:12]
