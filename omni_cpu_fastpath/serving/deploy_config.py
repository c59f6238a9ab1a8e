"""The CPU deploy config of Qwen3-TTS that ``omni-cpu-fastpath serve`` passes with ``--deploy-config``.

It is an overlay on vllm-omni's own qwen3_tts.yaml (``base_config`` inheritance), written from the
table of :mod:`omni_cpu_fastpath.serving.stage_settings`. vllm-omni's file is written for one GPU:
Model Runner V2 (Triton kernels), CUDA graphs, 30 % of device memory per stage. On CPU: V1 runners,
eager stages (no graphs) unless VLLM_OMNI_TALKER_COMPILE has vLLM compile the talker, a fixed KV
budget rather than 30 % of host RAM, and the cores split between the two stage workers.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .stage_settings import (
    MODEL_RUNNER,
    QWEN3_TTS_STAGES,
    StageSettings,
    code2wav_chunk_frames,
    cpu_stage_envs,
    kv_space_from_env,
    stage_compiles,
    stage_dtype,
    stage_executor,
    stage_quantization,
)

# Part of the written file: bump it when the YAML written for the same inputs changes.
CPU_DEPLOY_VERSION = 6

# The connector of vllm-omni's qwen3_tts.yaml that hands the talker's codes to code2wav in chunks.
CODEC_CONNECTOR = "connector_of_shared_memory"
# Where the code2wav stage's environment carries the chunk size written into that connector.
DEPLOY_CHUNK_FRAMES_ENV = "VLLM_OMNI_CODE2WAV_DEPLOY_CHUNK_FRAMES"


def cpu_deploy_overlay(
    base_config: str, cpus: list[int] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """The CPU overlay on vllm-omni's qwen3_tts.yaml at ``base_config``, for a server started with
    ``environ`` (default: this process's environment)."""
    main_env, spare_env = cpu_stage_envs(cpus, environ)
    chunk_frames = code2wav_chunk_frames(environ)
    if chunk_frames is not None:
        # code2wav learns what the talker will hand it (it warns where its decoder does not suit).
        spare_env = {**spare_env, DEPLOY_CHUNK_FRAMES_ENV: str(chunk_frames)}
    stages = [_stage_overlay(s, spare_env if s.spare_core else main_env, environ) for s in QWEN3_TTS_STAGES]
    overlay: dict[str, Any] = {"base_config": base_config, "model_runner": MODEL_RUNNER, "stages": stages}
    if chunk_frames is not None:
        # Deep-merged into vllm-omni's connector: its other settings stay the file's.
        overlay["connectors"] = {CODEC_CONNECTOR: {"extra": {"codec_chunk_frames": chunk_frames}}}
    return overlay


def _stage_overlay(
    settings: StageSettings, env: dict[str, str], environ: Mapping[str, str] | None
) -> dict[str, Any]:
    stage: dict[str, Any] = {
        "stage_id": settings.stage_id,
        "enforce_eager": settings.enforce_eager and not stage_compiles(settings, environ),
        "max_num_seqs": settings.max_num_seqs,
    }
    if settings.max_model_len is not None:
        stage["max_model_len"] = settings.max_model_len
    stage["async_scheduling"] = settings.async_scheduling
    dtype = stage_dtype(settings, environ)
    if dtype is not None:
        stage["dtype"] = dtype
    quantization = stage_quantization(settings, environ)
    if quantization is not None:
        # A stage-level key goes to that stage's engine args only (vllm-omni's top-level
        # ``quantization`` would apply to every stage).
        stage["quantization"] = quantization
    if not kv_space_from_env(environ):
        stage["kv_cache_memory_bytes"] = settings.kv_cache_memory_bytes
    executor = stage_executor(environ)
    if executor is not None:
        stage["distributed_executor_backend"] = executor
    server_env = os.environ if environ is None else environ
    if stage_compiles(settings, environ):
        if "VLLM_USE_AOT_COMPILE" not in server_env:
            # vLLM's AOT artifact of a model compiled on CPU fails to load at the next start
            # ("'function' object has no attribute 'finalize_loading'"), so each start compiled it
            # again; without it, Inductor's own caches serve the next start.
            env = {**env, "VLLM_USE_AOT_COMPILE": "0"}
        # vLLM compiles the talker on CPU with the stock Inductor backend, whose caches default to
        # a folder under /tmp that a reboot empties: the predictor's folder keeps them.
        from omni_cpu_fastpath.qwen3_tts.predictor import compile_cache

        env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(compile_cache.cache_dir(server_env))}
    if env:
        stage["env"] = env
    return stage


def cpu_deploy_config_path(environ: Mapping[str, str] | None = None) -> Path:
    """Write (if changed) and return the CPU deploy config of Qwen3-TTS, for a server started with
    ``environ`` (default: this process's environment).

    It lives in a cache folder, not in the package, because ``base_config`` must name the
    installed vllm-omni's own qwen3_tts.yaml, whose path depends on the install.
    """
    import vllm_omni
    import yaml

    base = Path(vllm_omni.__file__).parent / "deploy" / "qwen3_tts.yaml"
    text = (
        f"# Written by omni-cpu-fastpath (version {CPU_DEPLOY_VERSION}); regenerated as needed.\n"
        + yaml.safe_dump(cpu_deploy_overlay(str(base), environ=environ), sort_keys=False)
    )
    cache_home = (os.environ if environ is None else environ).get("XDG_CACHE_HOME")
    cache = Path(cache_home or Path.home() / ".cache") / "omni-cpu-fastpath"
    path = cache / f"qwen3_tts_cpu-{hashlib.sha256(text.encode()).hexdigest()[:12]}.yaml"
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
    return path
