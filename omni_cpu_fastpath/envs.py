"""Every ``VLLM_OMNI_*`` environment variable this library reads, in one table.

Modelled on ``vllm/envs.py``: each flag has a type, a default, its accepted values and a one-line
doc. Values are parsed on every read (no caching), so a test or a launcher can change the
environment and see the effect. A bad value raises :class:`FlagError` naming the variable, the
value given and the accepted values; nothing is silently ignored.

``env.example`` at the repository root lists the same flags; ``tests/test_envs.py`` fails when the
two disagree.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


class FlagError(ValueError):
    """A ``VLLM_OMNI_*`` variable holds a value the library does not accept."""


@dataclass(frozen=True)
class Flag:
    name: str
    type: str  # "bool", "auto-bool", "choice", "int", "opt-int", "path"
    default: str | None  # the raw default, as it would be written in the environment
    doc: str
    choices: tuple[str, ...] = ()
    accepted: str = ""  # human description of accepted values (derived when empty)
    minimum: int = 0  # the least integer an "int" or "opt-int" flag takes

    def accepted_values(self) -> str:
        if self.accepted:
            return self.accepted
        if self.type == "bool":
            return "|".join(_TRUE + _FALSE)
        if self.type == "auto-bool":
            return "auto|" + "|".join(_TRUE + _FALSE)
        if self.type == "choice":
            return "|".join(self.choices)
        if self.type == "int":
            return f"an integer >= {self.minimum}"
        if self.type == "opt-int":
            return f"auto, an integer >= {self.minimum}, or empty"
        return "a directory path (empty: off)"

    def error(self, raw: str) -> FlagError:
        return FlagError(f"{self.name}={raw!r} is not valid; accepted values: {self.accepted_values()}")


# Names of the int8 predictor variants; each is a config class in ``qwen3_tts/quant/configs.py``.
INT8_VARIANTS = ("off", "ao-dynamic", "ao-nohead", "torchao-w8", "w8-channel", "w8-bf16head")
# Schemes of the talker's decoder linears; each is a vLLM quantization method registered by
# ``qwen3_tts/quant/talker_int8.py`` (names in ``serving/stage_settings.py``).
TALKER_INT8_SCHEMES = ("auto", "off", "w8-channel", "w8-plain", "w8-group", "w8-group-a8")

FLAGS: dict[str, Flag] = {
    f.name: f
    for f in (
        Flag(
            "VLLM_OMNI_CPU_FASTPATH",
            "auto-bool",
            "auto",
            "Master switch: serve Qwen3-TTS with FastQwen3TTSTalker (auto: on when no accelerator).",
        ),
        Flag(
            "VLLM_OMNI_CPU_PLATFORM",
            "auto-bool",
            "auto",
            "Register the CPU omni platform (auto: only when no accelerator is present; 0 forces it off).",
        ),
        Flag(
            "VLLM_OMNI_PREDICTOR_INCREMENTAL",
            "auto-bool",
            "auto",
            "KV-cached code predictor instead of 15 re-prefills per frame (auto: on on CPU).",
        ),
        Flag(
            "VLLM_OMNI_PREDICTOR_COMPILE",
            "choice",
            "off",
            "off: eager predictor step; step: torch.compile one static sub-step, warmed at load "
            "(`omni-cpu-fastpath serve` sets step where unset).",
            choices=("off", "step"),
        ),
        Flag(
            "VLLM_OMNI_COMPILE_CACHE_DIR",
            "path",
            "",
            "Inductor cache of the compiled predictor step, kept across restarts "
            "(empty: TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/omni-cpu-fastpath/inductor); "
            "under the CPU deploy config, of the compiled talker too (VLLM_OMNI_TALKER_COMPILE).",
            accepted="a directory path (empty: the default folder)",
        ),
        Flag(
            "VLLM_OMNI_PREDICTOR_INT8",
            "choice",
            "w8-channel",
            "int8 scheme for the predictor layers; the default was chosen by measured parity and speed.",
            choices=INT8_VARIANTS,
        ),
        Flag(
            "VLLM_OMNI_TALKER_INT8",
            "choice",
            "auto",
            "int8 scheme for the talker's decoder linears (vLLM quantization method, talker stage only); "
            "w8-channel keeps outlier input columns in fp32, w8-plain does not, w8-group is w8-channel with "
            "a scale per 64 input weights (it passes the parity rule), w8-group-a8 is w8-group with a "
            "long prefill on a CPU that emulates bf16 multiplied as int8 activations (7 bits per token) "
            "by per-channel int8 weights in the linears behind an RMSNorm (faster first audio; parity "
            "measured by `parity --talker`). auto: w8-group where the package's "
            "kernel serves and multiplies bf16 by AVX512-BF16 (then every row, a prompt's prefill too, is "
            "summed as a decode row, so audio does not depend on the batch) on a CPU without AMX (whose "
            "tiles prefill the bf16 talker several times faster), or on a CPU that emulates bf16 (AVX2) "
            "where the kernel is vectorized (a long prefill dequantized for a float32 GEMM there), unless "
            "VLLM_OMNI_TALKER_FP32_PREFILL=on or VLLM_OMNI_TALKER_DECODE_GEMV asks for the bf16 talker; "
            "else off. Off with VLLM_OMNI_CPU_FASTPATH off (a scheme set beside it is refused).",
            choices=TALKER_INT8_SCHEMES,
        ),
        Flag(
            "VLLM_OMNI_TALKER_FP32_PREFILL",
            "choice",
            "auto",
            "bf16 talker with int8 off: run its decoder linears in fp32 for calls of 16 rows or more "
            "(a prompt's prefill), where emulated bf16 is slow, and calls of 1-8 rows (decode) through "
            "VLLM_OMNI_CPU_GEMV's kernel (auto: on CPUs without AVX512-BF16 or AMX). Not bit-equal to "
            "the stock talker; off with VLLM_OMNI_CPU_FASTPATH off.",
            choices=("auto", "on", "off"),
        ),
        Flag(
            "VLLM_OMNI_TALKER_DECODE_GEMV",
            "bool",
            "0",
            "1: the bf16 talker's decoder linears (int8 off) run decode steps (1-8 rows; one or "
            "two where the CPU multiplies bf16 natively) through VLLM_OMNI_CPU_GEMV's kernel also where its "
            "prefill stays in bf16 "
            "(VLLM_OMNI_TALKER_FP32_PREFILL off, as auto is on CPUs with native bf16). Not bit-equal "
            "to the stock talker; off with VLLM_OMNI_CPU_FASTPATH off (1 beside it is refused).",
        ),
        Flag(
            "VLLM_OMNI_CPU_GEMV",
            "bool",
            "1",
            "Products of 1-8 rows (decode steps) of the int8 layers, and of the bf16 talker where the "
            "CPU lacks native bf16, through the package's C kernel when built; 0: torch's kernels.",
        ),
        Flag(
            "VLLM_OMNI_CPU_GEMV_ISA",
            "choice",
            "auto",
            "The widest instruction set VLLM_OMNI_CPU_GEMV's kernel may use: auto (the widest this CPU "
            "runs: AVX-512 with vdpbf16ps for bf16 activations where it has AVX512-BF16 and -VBMI, "
            "else AVX-512, else AVX2), avx512, avx2, scalar. The summation order, and so the last "
            "bits of a product, differ between them.",
            choices=("auto", "avx512", "avx2", "scalar"),
        ),
        Flag(
            "VLLM_OMNI_CPU_GEMV_PREFETCH",
            "int",
            "8192",
            "How many bytes ahead of each output channel VLLM_OMNI_CPU_GEMV's kernel asks for the "
            "weights it reads next (into L2), so that slow memory has answered by then; 0: leave it to "
            "the hardware prefetcher. Results are the same either way; read once per process.",
        ),
        Flag(
            "VLLM_OMNI_PREDICTOR_THREADS",
            "int",
            "0",
            "Cap on torch threads inside the predictor, restored after each call (0: no cap).",
        ),
        Flag(
            "VLLM_OMNI_PREDICTOR_PARITY_CHECK",
            "bool",
            "0",
            "Also run the higher-precision predictor, teacher-forced, and record parity in step_stats.",
        ),
        Flag(
            "VLLM_OMNI_TALKER_COMPILE",
            "choice",
            "off",
            "off: the talker's decoder runs eager; vllm: vLLM's own compilation (Inductor, traced once "
            "for every batch size) compiles it at load, cached on disk by Inductor (the CPU deploy "
            "config: in VLLM_OMNI_COMPILE_CACHE_DIR's folder). Not with talker int8 "
            "w8-channel or w8-plain, VLLM_OMNI_TALKER_FP32_PREFILL=on or VLLM_OMNI_TALKER_DECODE_GEMV=1 "
            "(their linears branch on the row count); off with VLLM_OMNI_CPU_FASTPATH off. auto: vllm "
            "where the talker serves int8 w8-group, or vLLM's bf16 linears on a CPU with AMX, else off "
            "(`omni-cpu-fastpath serve` sets auto where unset).",
            choices=("off", "vllm", "auto"),
        ),
        Flag(
            "VLLM_OMNI_TALKER_PARITY_CHECK",
            "bool",
            "0",
            "With talker int8 or VLLM_OMNI_TALKER_COMPILE on: also run the talker's decoder eager with "
            "its float linears on the same inputs each step and record codec-0 parity in step_stats.",
        ),
        Flag(
            "VLLM_OMNI_CPU_FAST_SAMPLER",
            "auto-bool",
            "auto",
            "Sample the talker's first codebook with the compile-free CpuSampler (auto: on on CPU).",
        ),
        Flag(
            "VLLM_OMNI_CPU_SAMPLER_KERNEL",
            "bool",
            "1",
            "CpuSampler takes the talker's step through its C kernel when built (0: the numpy path).",
        ),
        Flag(
            "VLLM_OMNI_CPU_PRELOAD",
            "choice",
            "auto",
            "LD_PRELOAD of a started server: tcmalloc and Intel OpenMP where installed (require: both).",
            choices=("auto", "require", "off"),
        ),
        Flag(
            "VLLM_OMNI_CODE2WAV_FAST",
            "auto-bool",
            "0",
            "code2wav decoder: in-place SnakeBeta and GEMM transposed convolutions (auto: on on CPU).",
        ),
        Flag(
            "VLLM_OMNI_CODE2WAV_STREAMING",
            "bool",
            "0",
            "code2wav: a later chunk runs the vocoder on its new frames only, from tails kept per request.",
        ),
        Flag(
            "VLLM_OMNI_CODE2WAV_DTYPE",
            "choice",
            "float32",
            "code2wav decoder's compute dtype (audio is returned in float32 either way). bfloat16: as "
            "vllm-omni's own deploy config runs it on GPUs; auto: bfloat16 on CPUs with AVX512-BF16 or "
            "AMX, float32 elsewhere (emulated bf16 is slow). Not with VLLM_OMNI_CPU_FASTPATH off.",
            choices=("float32", "bfloat16", "auto"),
        ),
        Flag(
            "VLLM_OMNI_CODE2WAV_CHUNK_FRAMES",
            "opt-int",
            "auto",
            "frames per chunk the talker hands code2wav after a request's first (vllm-omni's "
            "codec_chunk_frames), written into the CPU deploy config of `omni-cpu-fastpath serve` (a "
            "plain `vllm serve --omni` reads its deploy file's). auto: 10 where the streaming vocoder "
            "serves (a short chunk costs it little, and a request's last audio waits for fewer "
            "frames after its last talker step), else the deploy file's own (25). Not with "
            "VLLM_OMNI_CPU_FASTPATH off.",
            minimum=1,
        ),
        Flag(
            "VLLM_OMNI_CODE2WAV_IDLE_MS",
            "int",
            "10",
            "code2wav stage: after an engine step that had nothing to run (every request waiting for "
            "its next chunk), wait this long before the next (0: vLLM's own pace, a step every ~1 ms).",
        ),
        Flag(
            "VLLM_OMNI_CORE_SHARING",
            "bool",
            "0",
            "1: where code2wav runs on the talker's cores (fewer than 4 CPUs), the talker takes one "
            "torch thread while a code2wav step runs, all of them otherwise, its predictor sub-step "
            "by sub-step, and a chunk waits for a talker step already on all threads "
            "(0: always all; `omni-cpu-fastpath serve` sets 1 where unset).",
        ),
        Flag(
            "VLLM_OMNI_OMP_BLOCKTIME",
            "opt-int",
            "",
            "ms an Intel OpenMP thread of a stage worker spins after a parallel region before it sleeps "
            "(auto: 0 where code2wav shares the talker's cores, else vLLM's 5; empty: vLLM's).",
            accepted="auto, an integer >= 0 (milliseconds), or empty (vLLM's setting)",
        ),
        Flag(
            "VLLM_OMNI_CPU_EXECUTOR",
            "choice",
            "auto",
            "Where the CPU deploy config runs each stage's model. uni: in the stage's engine process "
            "(no worker process to wait on; vLLM's engine waits for its worker in a sched_yield loop "
            "that preempts the talker's OpenMP threads on a few cores); mp: in a worker process, as "
            "vLLM's CPU platform does; auto: uni unless VLLM_CPU_OMP_THREADS_BIND is set (mp applies "
            "it). A plain vllm serve --omni always runs mp.",
            choices=("auto", "uni", "mp"),
        ),
        Flag(
            "VLLM_OMNI_CODE2WAV_DEPLOY_CHUNK_FRAMES",
            "opt-int",
            "",
            "Set for the code2wav stage by the CPU deploy config, not by hand: the codec_chunk_frames "
            "it wrote (empty: the deploy file's own), so that code2wav can warn where its chunks do "
            "not suit the decoder that serves them.",
            minimum=1,
        ),
        Flag(
            "VLLM_OMNI_SHARED_CORES",
            "bool",
            "0",
            "Set per stage by the CPU deploy config, not by hand: 1 where code2wav shares the talker's "
            "cores.",
        ),
        Flag(
            "VLLM_OMNI_SPARK",
            "bool",
            "1",
            "Register Spark-X2.5 with vLLM: config, model and spark25 tool parser (0: leave vLLM as it is).",
        ),
        Flag(
            "VLLM_OMNI_SPARK_FP32_PREFILL",
            "choice",
            "auto",
            "Spark-X2.5 served eager in bf16 on CPU: its decoder linears run calls of 16 rows or more (a "
            "prompt's prefill) in fp32 and calls of 1-8 rows (decode) through VLLM_OMNI_CPU_GEMV's kernel "
            "(auto: on CPUs without AVX512-BF16 or AMX, where torch emulates bf16 products).",
            choices=("auto", "on", "off"),
        ),
        Flag(
            "VLLM_OMNI_STEP_STATS_DIR",
            "path",
            "",
            "Folder for per-step timers: <pid>.jsonl per process and <pid>.summary.json at exit.",
        ),
        Flag(
            "VLLM_OMNI_STEP_STATS_CODES",
            "bool",
            "0",
            "With a stats folder: also write every frame's codes per request (<pid>.codes.jsonl).",
        ),
        Flag(
            "VLLM_OMNI_STEP_STATS_SYNC",
            "bool",
            "0",
            "Synchronize the accelerator, when there is one, around the model timers.",
        ),
    )
}


@functools.cache
def has_accelerator() -> bool:
    """True when torch sees a GPU/XPU/NPU; the "auto" defaults key off this."""
    import torch

    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return True
    npu = getattr(torch, "npu", None)
    return bool(npu is not None and npu.is_available())


def raw(name: str, environ: Mapping[str, str] | None = None) -> str:
    """The raw string of a flag: the environment's value, else its default.

    ``environ`` reads another process's environment-to-be instead of this one's.
    """
    flag = _flag(name)
    value = (os.environ if environ is None else environ).get(name)
    return flag.default or "" if value is None else value


def _flag(name: str) -> Flag:
    try:
        return FLAGS[name]
    except KeyError:
        raise KeyError(f"{name} is not a flag of omni_cpu_fastpath (see omni_cpu_fastpath/envs.py)") from None


def _parse_bool(flag: Flag, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise flag.error(value)


def _parse(flag: Flag, value: str) -> Any:
    if flag.type == "bool":
        return _parse_bool(flag, value)
    if flag.type == "auto-bool":
        if value.strip().lower() == "auto":
            return not has_accelerator()
        return _parse_bool(flag, value)
    if flag.type == "choice":
        v = value.strip().lower()
        if v not in flag.choices:
            raise flag.error(value)
        return v
    if flag.type in ("int", "opt-int"):
        if flag.type == "opt-int" and value.strip().lower() in ("", "auto"):
            return value.strip().lower() or None
        try:
            n = int(value.strip())
        except ValueError:
            raise flag.error(value) from None
        if n < flag.minimum:
            raise flag.error(value)
        return n
    if flag.type == "path":
        return value.strip() or None
    raise AssertionError(f"unknown flag type {flag.type}")


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of flag ``name`` (raises FlagError on a bad value)."""
    flag = _flag(name)
    return _parse(flag, raw(name, environ))


def validate_all() -> None:
    """Parse every flag once, so a bad value fails at start-up rather than mid-serving."""
    for name in FLAGS:
        get(name)


def table() -> list[dict[str, Any]]:
    """The flag table with current values, as ``omni-cpu-fastpath flags --json`` prints it."""
    rows = []
    for flag in FLAGS.values():
        valid = True
        try:
            value: Any = get(flag.name)
        except FlagError as exc:
            value, valid = f"<invalid: {exc}>", False
        rows.append(
            {
                "name": flag.name,
                "valid": valid,
                "type": flag.type,
                "default": flag.default,
                "value": value,
                "accepted": flag.accepted_values(),
                "doc": flag.doc,
            }
        )
    return rows


def __getattr__(name: str) -> Any:
    # ``envs.<FLAG NAME>`` reads the current value, as in vllm.envs.
    if name in FLAGS:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(FLAGS))
