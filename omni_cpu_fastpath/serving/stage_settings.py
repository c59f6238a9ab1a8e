"""The CPU settings of each Qwen3-TTS stage, in one table that both roads to a served stage read.

Two roads build a stage's config: ``omni-cpu-fastpath serve`` passes the deploy config of
:mod:`omni_cpu_fastpath.serving.deploy_config`, and a plain ``vllm serve MODEL --omni`` gets the
stock deploy config, adjusted by the platform hook of :mod:`omni_cpu_fastpath.serving.vllm_platform`.
Both take their values from :data:`QWEN3_TTS_STAGES`, so a stage gets the same KV budget either way.

vllm-omni's Qwen3-TTS pipeline names its stages ``qwen3_tts`` (stage 0, the talker) and
``code2wav`` (stage 1); other vllm-omni models reuse such names (Qwen3-Omni has a ``code2wav``),
so a stage is looked up by its model type as well.

Importing this module imports neither vllm nor vllm_omni (the platform hook imports it while vLLM
resolves its platform).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from omni_cpu_fastpath import envs

QWEN3_TTS_MODEL_TYPE = "qwen3_tts"

# vllm-omni's qwen3_tts.yaml asks for Model Runner V2, which needs Triton GPU kernels.
MODEL_RUNNER = "v1"

# KV cache of an omni stage when neither --kv-cache-memory-bytes nor VLLM_CPU_KVCACHE_SPACE says:
# vLLM's CPU default reserves gpu_memory_utilization (0.3 in vllm-omni's stage configs) of host RAM
# per stage. Also the talker's budget: 4096 frames x 28 layers x 8 kv heads x 128 x 2 (k, v) x 4 B
# fit in it for the 0.6B talker.
DEFAULT_OMNI_KV_BYTES = 1 << 30

# VLLM_OMNI_TALKER_INT8 scheme -> the vLLM quantization method ``qwen3_tts/quant/talker_int8.py``
# registers for it (vLLM lower-cases method names).
TALKER_INT8_METHODS: dict[str, str] = {
    "w8-channel": "omni_cpu_talker_w8",
    "w8-plain": "omni_cpu_talker_w8_plain",
    "w8-group": "omni_cpu_talker_w8_group",
    "w8-group-a8": "omni_cpu_talker_w8_group_a8",
}
# The scheme VLLM_OMNI_TALKER_INT8=auto serves where it can: the one the parity rule chose (README).
AUTO_TALKER_INT8 = "w8-group"
# Schemes whose linear method serves a graph traced once for every batch size (VLLM_OMNI_TALKER_COMPILE):
# the row count is looked at inside one opaque op, not in the traced code.
COMPILED_TALKER_INT8 = ("w8-group", "w8-group-a8")
# VLLM_OMNI_TALKER_FP32_PREFILL's method (``qwen3_tts/quant/talker_fp32_prefill.py``), when int8 is off.
TALKER_FP32_PREFILL_METHOD = "omni_cpu_talker_fp32_prefill"
# VLLM_OMNI_TALKER_DECODE_GEMV's method: the same one with the prefill left in the model's dtype.
TALKER_DECODE_GEMV_METHOD = "omni_cpu_talker_decode_gemv"


@dataclass(frozen=True)
class StageSettings:
    """What one Qwen3-TTS stage runs with on CPU.

    The platform hook applies ``kv_cache_memory_bytes`` too, and makes every omni stage eager and
    V1 (as ``enforce_eager`` and :data:`MODEL_RUNNER` say); the rest is deploy-config-only, for the
    reason given at each field.
    """

    stage_id: int
    model_stage: str
    kv_cache_memory_bytes: int
    # Deploy-config-only: vLLM validates these against each other while it builds the config, and
    # the hook cannot tell a user's value from the stock one.
    max_num_seqs: int
    max_model_len: int | None = None
    # Deploy-config-only: the model's dtype is resolved while the config is built.
    dtype: str | None = None
    # Whether VLLM_OMNI_CODE2WAV_DTYPE sets this stage's dtype instead (the deploy config, and the
    # platform hook on a plain ``vllm serve --omni``, before the weights load).
    dtype_from_flag: bool = False
    enforce_eager: bool = True
    # Deploy-config-only: vllm-omni picks the stage's scheduler class before the config exists.
    async_scheduling: bool = False
    # Deploy-config-only (worker environment, set when the stage process starts): True for the
    # stage that gets the spare core of :func:`cpu_stage_envs`, False for the one that gets the rest.
    spare_core: bool = False
    # Whether VLLM_OMNI_TALKER_INT8 selects this stage's quantization method (its decoder linears).
    # Deploy config, and the platform hook when the stage's config has no quantization of its own.
    int8_linears: bool = False
    # Whether VLLM_OMNI_TALKER_COMPILE lets vLLM compile this stage's model instead of the eager
    # default. Deploy config (``enforce_eager``), and the platform hook, which otherwise makes it eager.
    vllm_compile: bool = False


QWEN3_TTS_STAGES: tuple[StageSettings, ...] = (
    # The talker decodes one frame after another: the latency-critical stage.
    StageSettings(
        stage_id=0,
        model_stage="qwen3_tts",
        kv_cache_memory_bytes=DEFAULT_OMNI_KV_BYTES,
        max_num_seqs=8,
        max_model_len=4096,
        int8_linears=True,
        vllm_compile=True,
    ),
    # code2wav runs once per audio chunk.
    StageSettings(
        stage_id=1,
        model_stage="code2wav",
        kv_cache_memory_bytes=64 << 20,
        max_num_seqs=8,
        # fp32 unless VLLM_OMNI_CODE2WAV_DTYPE asks otherwise: bf16 convolutions are fast only on
        # CPUs that multiply bf16 natively, and bf16 is not the exact decode.
        dtype="float32",
        dtype_from_flag=True,
        spare_core=True,
    ),
)


def stage_settings(model_config: Any) -> StageSettings | None:
    """The table's row for an omni stage's model config, or None for a stage it does not name."""
    if getattr(getattr(model_config, "hf_config", None), "model_type", None) != QWEN3_TTS_MODEL_TYPE:
        return None
    stage = getattr(model_config, "model_stage", None)
    return next((s for s in QWEN3_TTS_STAGES if s.model_stage == stage), None)


def omni_kv_bytes(model_config: Any) -> int:
    """The KV cache budget of an omni stage when the user set none."""
    settings = stage_settings(model_config)
    return DEFAULT_OMNI_KV_BYTES if settings is None else settings.kv_cache_memory_bytes


def _needs_fast_path(name: str, stock: str, value: str, environ: Mapping[str, str]) -> envs.FlagError:
    """The error for flag ``name`` set beside VLLM_OMNI_CPU_FASTPATH off: ``stock`` says what serves
    instead, ``value`` is the flag's setting that asks for nothing beyond it."""
    master = f"VLLM_OMNI_CPU_FASTPATH={envs.raw('VLLM_OMNI_CPU_FASTPATH', environ)!r}"
    return envs.FlagError(
        f"{name}={envs.raw(name, environ)!r} needs the fast path, but {master} turns it off ({stock}): "
        f"set {name}={value} (or unset it), or VLLM_OMNI_CPU_FASTPATH=1"
    )


def stage_quantization(
    settings: StageSettings | None, environ: Mapping[str, str] | None = None
) -> str | None:
    """The vLLM quantization method VLLM_OMNI_TALKER_INT8 selects for a stage, or None; with int8
    off, the fp32-prefill method where VLLM_OMNI_TALKER_FP32_PREFILL asks for it (its decode rows
    take the few-row kernel), else the decode-rows-only method where VLLM_OMNI_TALKER_DECODE_GEMV
    does.

    Talker int8 is part of the fast path: with VLLM_OMNI_CPU_FASTPATH off the talker stage is the
    stock one, float, and its default (``auto``) is off. A scheme set explicitly beside it is
    refused rather than served: the stock talker does not hand the int8 linears their RMSNorm gains, so
    ``w8-channel`` would silently lose its fp32 columns, and "stock" would not be stock.
    ``environ``: the environment of the server to be started (default: this process's).
    """
    if settings is None or not settings.int8_linears:
        return None
    environ = os.environ if environ is None else environ
    scheme = talker_int8_scheme(environ)
    if not envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        stock = "the stock talker serves"
        if scheme != "off":
            raise _needs_fast_path("VLLM_OMNI_TALKER_INT8", "the stock, float talker serves", "off", environ)
        if envs.get("VLLM_OMNI_TALKER_FP32_PREFILL", environ) == "on":
            raise _needs_fast_path("VLLM_OMNI_TALKER_FP32_PREFILL", stock, "auto", environ)
        if envs.get("VLLM_OMNI_TALKER_DECODE_GEMV", environ):
            raise _needs_fast_path("VLLM_OMNI_TALKER_DECODE_GEMV", stock, "0", environ)
        return None
    if scheme != "off":
        stage_compiles(settings, environ)  # refuses the schemes a compiled talker cannot serve
        return TALKER_INT8_METHODS[scheme]
    if stage_compiles(settings, environ):
        # The fp32-prefill method branches on the row count, which a graph traced once for every
        # batch size cannot keep (an explicit ``on`` beside the compile is refused there).
        return None
    if fp32_prefill(environ):
        return TALKER_FP32_PREFILL_METHOD
    return TALKER_DECODE_GEMV_METHOD if envs.get("VLLM_OMNI_TALKER_DECODE_GEMV", environ) else None


def talker_int8_scheme(environ: Mapping[str, str] | None = None) -> str:
    """The scheme VLLM_OMNI_TALKER_INT8 serves: ``auto`` resolved, any other value as set.

    ``auto`` is :data:`AUTO_TALKER_INT8` with the fast path on, the package's kernel built, checked
    and on (without it every decode step would dequantize), nothing set that asks for the bf16
    talker (``VLLM_OMNI_TALKER_FP32_PREFILL=on`` or ``VLLM_OMNI_TALKER_DECODE_GEMV=1``), and either
    of two CPUs:

    - one that multiplies bf16 natively, without AMX (whose tiles give vLLM's bf16 talker a
      prompt's prefill several times faster than the kernel's ``vdpbf16ps``), and a kernel that
      does so by AVX512-BF16 (not capped by ``VLLM_OMNI_CPU_GEMV_ISA``): only then does it serve a
      prompt's prefill too, each row summed as a decode row, so a request's audio does not depend
      on its batch neighbours;
    - one where torch emulates bf16 (AVX2), with the kernel vectorized (not capped to ``scalar``):
      the decode rows read half the bytes of the bf16 talker's, and a long prefill is dequantized
      for a float32 GEMM, as the bf16 talker's fp32 prefill widens its weights there (neither keeps
      a decode row's summation order in a long batch).

    Otherwise ``off``.
    """
    scheme = envs.get("VLLM_OMNI_TALKER_INT8", environ)
    if scheme != "auto":
        return scheme
    served = (
        envs.get("VLLM_OMNI_CPU_FASTPATH", environ)
        and envs.get("VLLM_OMNI_TALKER_FP32_PREFILL", environ) != "on"
        and not envs.get("VLLM_OMNI_TALKER_DECODE_GEMV", environ)
        and envs.get("VLLM_OMNI_CPU_GEMV", environ)
        and _auto_int8_kernel(os.environ if environ is None else environ)
    )
    return AUTO_TALKER_INT8 if served else "off"


def _auto_int8_kernel(environ: Mapping[str, str]) -> bool:
    """Whether this CPU and the kernel's instruction set serve ``auto``'s int8 talker (above)."""
    from omni_cpu_fastpath import cpu_gemv

    if cpu_has_native_bf16():
        return not cpu_has_amx() and cpu_gemv.multiplies_bf16_natively(environ)
    return cpu_gemv.vectorized(environ)


def stage_compiles(settings: StageSettings | None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether VLLM_OMNI_TALKER_COMPILE has vLLM compile this stage (``vllm``: its own compilation,
    Inductor, the model traced once for every batch size); otherwise the stage runs eager.

    Refused with a :class:`~omni_cpu_fastpath.envs.FlagError` naming both variables, rather than
    served otherwise than asked: beside ``VLLM_OMNI_CPU_FASTPATH`` off (the stock talker runs
    eager), a talker int8 scheme other than :data:`COMPILED_TALKER_INT8`,
    ``VLLM_OMNI_TALKER_FP32_PREFILL=on`` or ``VLLM_OMNI_TALKER_DECODE_GEMV=1`` (linear methods that
    pick a kernel by the row count in traced code, which one graph would fix for every batch size).
    ``auto`` is :func:`auto_compiles`, never refused.
    """
    if settings is None or not settings.vllm_compile:
        return False
    environ = os.environ if environ is None else environ
    setting = envs.get("VLLM_OMNI_TALKER_COMPILE", environ)
    if setting == "auto":
        return auto_compiles(environ)
    if setting == "off":
        return False
    asked = f"VLLM_OMNI_TALKER_COMPILE={envs.raw('VLLM_OMNI_TALKER_COMPILE', environ)!r}"
    if not envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        raise _needs_fast_path("VLLM_OMNI_TALKER_COMPILE", "the stock talker serves eager", "off", environ)
    branching = _branching_linears(environ)
    if branching:
        name = branching[0]
        raise envs.FlagError(
            f"{asked} cannot serve beside {name}={envs.raw(name, environ)!r}: its linear method "
            "picks a kernel by the number of rows, and a graph traced once for every batch size "
            f"would keep one of them; set {name}=off, or VLLM_OMNI_TALKER_COMPILE=off"
        )
    return True


def _branching_linears(environ: Mapping[str, str]) -> list[str]:
    """The flags set to a linear method that picks a kernel by the row count in traced code."""
    branching = {
        "VLLM_OMNI_TALKER_INT8": talker_int8_scheme(environ) not in ("off", *COMPILED_TALKER_INT8),
        "VLLM_OMNI_TALKER_FP32_PREFILL": envs.get("VLLM_OMNI_TALKER_FP32_PREFILL", environ) == "on",
        "VLLM_OMNI_TALKER_DECODE_GEMV": envs.get("VLLM_OMNI_TALKER_DECODE_GEMV", environ),
    }
    return [name for name, on in branching.items() if on]


def auto_compiles(environ: Mapping[str, str] | None = None) -> bool:
    """What VLLM_OMNI_TALKER_COMPILE=auto serves: compiled where the talker serves a
    :data:`COMPILED_TALKER_INT8` scheme, or, on a CPU with AMX, vLLM's own bf16 linears (the
    configurations whose compiled forward was measured faster), and nothing asks for a linear
    method that branches on the row count; eager otherwise, never refused."""
    environ = os.environ if environ is None else environ
    scheme = talker_int8_scheme(environ)
    bf16_on_amx = scheme == "off" and cpu_has_amx() and not fp32_prefill(environ)
    return bool(
        envs.get("VLLM_OMNI_CPU_FASTPATH", environ)
        and (scheme in COMPILED_TALKER_INT8 or bf16_on_amx)
        and not _branching_linears(environ)
    )


def stage_dtype(settings: StageSettings | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The dtype the deploy config writes for a stage: the table's, or VLLM_OMNI_CODE2WAV_DTYPE's."""
    if settings is None or not settings.dtype_from_flag:
        return None if settings is None else settings.dtype
    return code2wav_dtype(environ)


def code2wav_dtype(environ: Mapping[str, str] | None = None) -> str:
    """The code2wav decoder's compute dtype VLLM_OMNI_CODE2WAV_DTYPE asks for here (``auto``:
    bfloat16 where this CPU multiplies bf16 natively, else float32).

    Part of the fast path: beside VLLM_OMNI_CPU_FASTPATH off (float32, the exact decode) a value
    other than float32 is refused, naming both variables.
    """
    environ = os.environ if environ is None else environ
    setting = envs.get("VLLM_OMNI_CODE2WAV_DTYPE", environ)
    if not envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        if setting != "float32" and environ.get("VLLM_OMNI_CODE2WAV_DTYPE") is not None:
            stock = "the stock code2wav serves at the stage's dtype"
            raise _needs_fast_path("VLLM_OMNI_CODE2WAV_DTYPE", stock, "float32", environ)
        return "float32"
    if setting == "auto":
        return "bfloat16" if cpu_has_native_bf16() else "float32"
    return setting


# Frames per code2wav chunk where the streaming vocoder serves. It decodes a chunk's new frames
# only, so a short chunk costs it little more than the codec transformer's window run again; and
# the audio of a request's last frames, decoded after its last talker step, waits for fewer.
STREAMING_CHUNK_FRAMES = 10
# vllm-omni's own frames per chunk (codec_chunk_frames of its qwen3_tts.yaml), which its decoder's
# left context is sized against.
STOCK_CHUNK_FRAMES = 25


def code2wav_chunk_frames(environ: Mapping[str, str] | None = None) -> int | None:
    """Frames per code2wav chunk after a request's first that the CPU deploy config writes
    (vllm-omni's ``codec_chunk_frames``), or None to keep its deploy file's own:
    VLLM_OMNI_CODE2WAV_CHUNK_FRAMES, and with ``auto`` :data:`STREAMING_CHUNK_FRAMES` where the
    streaming vocoder serves (VLLM_OMNI_CODE2WAV_STREAMING with the fast path on).

    Part of the fast path: beside VLLM_OMNI_CPU_FASTPATH off (the stock stages at the deploy file's
    own chunks) a number is refused, naming both variables.
    """
    environ = os.environ if environ is None else environ
    setting = envs.get("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", environ)
    if not envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        if isinstance(setting, int):
            stock = "the stock stages keep the deploy file's chunks"
            raise _needs_fast_path("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", stock, "auto", environ)
        return None
    if isinstance(setting, int):
        return setting
    return STREAMING_CHUNK_FRAMES if envs.get("VLLM_OMNI_CODE2WAV_STREAMING", environ) else None


def fp32_prefill(environ: Mapping[str, str] | None = None) -> bool:
    """Whether VLLM_OMNI_TALKER_FP32_PREFILL asks for it here (``auto``: this CPU lacks native bf16)."""
    setting = envs.get("VLLM_OMNI_TALKER_FP32_PREFILL", environ)
    if setting != "auto":
        return setting == "on"
    return not cpu_has_native_bf16()


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX); elsewhere torch emulates it."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or cpu_has_amx()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, which oneDNN's bf16 GEMM (vLLM's CPU linears) runs on."""
    import torch

    return torch.cpu._is_amx_tile_supported()


def kv_space_from_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether VLLM_CPU_KVCACHE_SPACE sets the KV budget of every stage (then the table's does not)."""
    return bool((os.environ if environ is None else environ).get("VLLM_CPU_KVCACHE_SPACE"))


def cpu_stage_envs(
    cpus: list[int] | None = None, environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """OpenMP settings of the talker and code2wav workers, from the CPUs this process may use.

    With 4 or more CPUs the talker binds to all but the last one and code2wav binds to the last
    one. With fewer, the talker binds to all of them and code2wav runs one unbound thread (it
    shares a core only while a chunk decodes), and both stages are marked as sharing cores
    (``VLLM_OMNI_SHARED_CORES``: the talker steps down to one thread while code2wav decodes, see
    :mod:`~omni_cpu_fastpath.serving.core_sharing`); where that step-down is on, the talker's
    attention keeps each sequence's KV cache whole (``VLLM_CPU_ATTN_SPLIT_KV=0``, unless set). A
    VLLM_CPU_OMP_THREADS_BIND set by the user wins: then nothing is set per stage.

    Where the model runs in the stage's engine process (:func:`stage_executor`), no executor spawns
    a worker with the OpenMP binding, so the stage's environment carries it (:func:`omp_binding_env`):
    the engine process starts with it, before its OpenMP runtime reads it.
    """
    env = os.environ if environ is None else environ
    if env.get("VLLM_CPU_OMP_THREADS_BIND"):
        return {}, {}
    if cpus is None:
        cpus = sorted(os.sched_getaffinity(0))
    in_process = stage_executor(environ) is not None
    if len(cpus) >= 4:
        talker = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus[:-1]))}
        code2wav = {"VLLM_CPU_OMP_THREADS_BIND": str(cpus[-1])}
        if in_process:
            talker.update(omp_binding_env(cpus[:-1], environ))
            code2wav.update(omp_binding_env(cpus[-1:], environ))
    else:
        shared = {"VLLM_OMNI_SHARED_CORES": "1"}
        talker = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)), **shared}
        if envs.get("VLLM_OMNI_CORE_SHARING", environ) and "VLLM_CPU_ATTN_SPLIT_KV" not in env:
            # A step's thread count then follows code2wav's timing, and vLLM's CPU attention,
            # when it splits a sequence's KV cache, splits it by the thread count: unsplit, a
            # request's attention sums in the same order whatever the count.
            talker["VLLM_CPU_ATTN_SPLIT_KV"] = "0"
        code2wav = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", **shared}
        if in_process:
            talker.update(omp_binding_env(cpus, environ))
    return talker, code2wav


# Runs a stage's model in its engine process (``serving/executor.py``); named by its path so that
# importing this module imports no vLLM.
IN_PROCESS_EXECUTOR = "omni_cpu_fastpath.serving.executor.InProcessExecutor"


def stage_executor(environ: Mapping[str, str] | None = None) -> str | None:
    """The executor the CPU deploy config names for each stage: :data:`IN_PROCESS_EXECUTOR` where
    VLLM_OMNI_CPU_EXECUTOR asks for ``uni``, None (vLLM's CPU default, a worker process) for ``mp``.

    ``auto`` is ``uni`` unless the user binds threads with VLLM_CPU_OMP_THREADS_BIND, which vLLM's
    multiprocessing executor applies to the workers it spawns; ``uni`` beside it is refused, naming
    both variables.
    """
    environ = os.environ if environ is None else environ
    setting = envs.get("VLLM_OMNI_CPU_EXECUTOR", environ)
    bind = environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if setting == "mp" or (setting == "auto" and bind):
        return None
    if bind:
        raise envs.FlagError(
            f"VLLM_OMNI_CPU_EXECUTOR='uni' runs each stage's model in its engine process, but "
            f"VLLM_CPU_OMP_THREADS_BIND={bind!r} binds the threads of worker processes, which only "
            "the multiprocessing executor starts: unset one of them, or set VLLM_OMNI_CPU_EXECUTOR=mp"
        )
    return IN_PROCESS_EXECUTOR


def omp_binding_env(cpus: list[int], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The OpenMP variables vLLM's multiprocessing executor sets for a CPU worker bound to ``cpus``
    (``vllm/utils/ompmultiprocessing.py``), for the OpenMP runtime that ``environ``'s LD_PRELOAD
    loads: Intel OpenMP's affinity and 5 ms blocktime, GNU OpenMP's affinity, or the standard places."""
    environ = os.environ if environ is None else environ
    preload = environ.get("LD_PRELOAD", "")
    ids = [str(c) for c in cpus]
    env = {"OMP_NUM_THREADS": str(len(ids))}
    if "libiomp" in preload or "libomp" in preload:
        env["KMP_AFFINITY"] = f"granularity=fine,explicit,proclist=[{','.join(ids)}]"
        env["KMP_BLOCKTIME"] = "5"
        env["KMP_TPAUSE"] = "0"
    elif "libgomp" in preload:
        env["GOMP_CPU_AFFINITY"] = " ".join(ids)
    else:
        env["OMP_PLACES"] = "{" + ",".join(ids) + "}"
        env["OMP_PROC_BIND"] = "true"
    return env
