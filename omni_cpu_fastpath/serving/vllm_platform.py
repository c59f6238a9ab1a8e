"""vLLM's CPU platform with the config adjustments omni stages need on CPU.

Returned by ``omni_cpu_fastpath.serving.plugins.cpu_vllm_platform`` (entry-point group
``vllm.platform_plugins``) only where vLLM would pick its own CPU platform anyway. vLLM calls
``check_and_update_config`` on every ``VllmConfig`` it builds, in every process, which is the one
place an out-of-tree package sees each stage's config before its scheduler and workers are made.
It also names :mod:`omni_cpu_fastpath.serving.generation_scheduler`'s paced scheduler for a stage
that would run vllm-omni's generation scheduler (code2wav), and sets code2wav's dtype from the
same table (VLLM_OMNI_CODE2WAV_DTYPE) before its worker loads the weights. For configs that are not vllm-omni
stages it is exactly vLLM's ``CpuPlatform``. The KV budget it
gives a stage comes from the table of ``omni_cpu_fastpath.serving.stage_settings``, which the CPU
deploy config of ``omni-cpu-fastpath serve`` reads too.

This module must not import vllm_omni: vLLM resolves its platform while vllm_omni itself may be
half imported.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.platforms.cpu import CpuPlatform

from omni_cpu_fastpath import envs

from .stage_settings import (
    IN_PROCESS_EXECUTOR,
    kv_space_from_env,
    omni_kv_bytes,
    stage_compiles,
    stage_dtype,
    stage_quantization,
    stage_settings,
)

logger = logging.getLogger(f"vllm.{__name__}")

# vllm-omni's scheduler of generation stages and our subclass of it that paces empty steps, by
# name: this module must not import vllm_omni.
STOCK_GENERATION_SCHEDULER = "vllm_omni.core.sched.omni_generation_scheduler.OmniGenerationScheduler"
PACED_GENERATION_SCHEDULER = "omni_cpu_fastpath.serving.generation_scheduler.PacedGenerationScheduler"


def is_omni_stage(model_config: Any) -> bool:
    # vllm-omni's OmniModelConfig carries the stage identity; vLLM's ModelConfig does not.
    return (
        model_config is not None
        and hasattr(model_config, "model_stage")
        and hasattr(model_config, "stage_id")
    )


def adjust_omni_stage_config(vllm_config: Any) -> list[str]:
    """Make an omni stage's config runnable by the CPU workers; returns what was changed."""
    from vllm.config import CompilationMode

    model_config = vllm_config.model_config
    changes: list[str] = []
    if getattr(model_config, "use_v2_model_runner", False):
        # Model Runner V2 needs Triton GPU kernels. The scheduler and the worker both read this
        # flag, so it is set here, before either exists.
        model_config.use_v2_model_runner = False
        changes.append("Model Runner V1 (V2 needs Triton GPU kernels)")
    compilation_config = vllm_config.compilation_config
    if not model_config.enforce_eager and compilation_config.mode == CompilationMode.VLLM_COMPILE:
        if stage_compiles(stage_settings(model_config)):
            changes.append("compiled by vLLM (VLLM_OMNI_TALKER_COMPILE)")
        else:
            # The CPU default would compile the whole model with inductor at start-up (minutes on
            # a few cores) for a per-step model that the fast path speeds up in its own way.
            model_config.enforce_eager = True
            compilation_config.mode = CompilationMode.NONE
            changes.append("eager")
    cache_config = vllm_config.cache_config
    if cache_config.kv_cache_memory_bytes is None and not kv_space_from_env():
        # The same budget the CPU deploy config writes for this stage (one table for both).
        kv_bytes = omni_kv_bytes(model_config)
        cache_config.kv_cache_memory_bytes = kv_bytes
        changes.append(f"KV cache {kv_bytes >> 20} MiB")
    quantization = stage_quantization(stage_settings(model_config))
    if quantization is not None and model_config.quantization is None and vllm_config.quant_config is None:
        # The same method the CPU deploy config names for this stage. vLLM resolved quant_config
        # before this hook runs, so it is built here (and the name registered, for later checks).
        from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import register

        model_config.quantization = quantization
        vllm_config.quant_config = register()[quantization]()
        changes.append(f"decoder linears by {quantization}")
    # The table's dtype (code2wav's: VLLM_OMNI_CODE2WAV_DTYPE, refused by name beside the fast path
    # off), set before the worker loads the weights, so they load at it: a cast after loading from
    # bf16 would keep bf16's rounding in a float32 decoder.
    dtype = stage_dtype(stage_settings(model_config))
    if dtype is not None and model_config.dtype != getattr(torch, dtype):
        changes.append(f"dtype {dtype}, not {model_config.dtype} (stage table, VLLM_OMNI_CODE2WAV_DTYPE)")
        model_config.dtype = getattr(torch, dtype)
    idle_ms = envs.get("VLLM_OMNI_CODE2WAV_IDLE_MS")
    scheduler_config = vllm_config.scheduler_config
    if idle_ms > 0 and qualname(scheduler_config.scheduler_cls) == STOCK_GENERATION_SCHEDULER:
        # Set before the engine core builds its scheduler from this config.
        scheduler_config.scheduler_cls = PACED_GENERATION_SCHEDULER
        changes.append(f"scheduler waits {idle_ms} ms after a step with nothing to run")
    return changes


def _say_where_the_model_runs(vllm_config: Any) -> None:
    # VLLM_OMNI_CPU_EXECUTOR is the CPU deploy config's: a stage config that does not name the
    # in-process executor (a plain `vllm serve --omni`) runs vLLM's worker process.
    if envs.get("VLLM_OMNI_CPU_EXECUTOR") != "uni":
        return
    backend = vllm_config.parallel_config.distributed_executor_backend
    if qualname(backend) != IN_PROCESS_EXECUTOR:
        logger.warning(
            "omni-cpu-fastpath: VLLM_OMNI_CPU_EXECUTOR=uni applies to the CPU deploy config "
            "(omni-cpu-fastpath serve); stage %s runs its model with the executor %r",
            vllm_config.model_config.stage_id,
            qualname(backend),
        )


def qualname(cls: Any) -> str | None:
    """A class's import path, as vLLM's configs name classes (a string or None is returned as is)."""
    if cls is None or isinstance(cls, str):
        return cls
    return f"{cls.__module__}.{cls.__qualname__}"


class CpuVllmPlatform(CpuPlatform):
    """``CpuPlatform`` plus :func:`adjust_omni_stage_config` for vllm-omni stage configs."""

    @classmethod
    def check_and_update_config(cls, vllm_config: Any) -> None:
        if is_omni_stage(vllm_config.model_config):
            changes = adjust_omni_stage_config(vllm_config)
            if changes:
                logger.info(
                    "omni-cpu-fastpath: stage %s (%s) on CPU: %s",
                    vllm_config.model_config.stage_id,
                    vllm_config.model_config.model_stage,
                    ", ".join(changes),
                )
        super().check_and_update_config(vllm_config)
        if is_omni_stage(vllm_config.model_config):
            _say_where_the_model_runs(vllm_config)
