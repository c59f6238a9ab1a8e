"""Served fast path against served stock path: the same requests, the same codes, the same audio.

Real servers on loopback, one after another, on the tiny checkpoint, each given the same seeded
requests (non-streaming and streaming, one at a time and three at once). Every request's audio
bytes must be identical to the reference server's, and so must the codes of every frame (the CPU
runner writes them with ``VLLM_OMNI_STEP_STATS_CODES=1``, for the stock talker too). What served
each piece is read back from step_stats and asserted, so a fast path that silently fell back to
the stock one fails here.

- bf16, the dtype vLLM serves this float32 checkpoint in on CPU: ``FastQwen3TTSTalker`` (int8 off,
  eager cached predictor) against the stock talker (``VLLM_OMNI_CPU_FASTPATH=0``, on this
  package's CPU workers, since stock vllm-omni has none). The stock server also runs each stage's
  model in a worker process, as vLLM's CPU platform does (``VLLM_OMNI_CPU_EXECUTOR=mp``), and the
  fast one in the stage's engine process (the default): where the model runs changes no byte.
- fp32 (``--dtype float32``): the compiled step (``VLLM_OMNI_PREDICTOR_COMPILE=step``) against the
  eager fast talker. Not against the stock talker, which cannot serve float32 (vllm-omni 0.30
  builds its embeddings in bf16; the fast talker builds them in the model's dtype), and not in
  bf16, where Inductor rounds in other places than eager so bit equality is not defined: there
  the compiled step is bounded against eager in test_served_predictor.py, and the int8 default
  against its fp32 copy by the parity counters in test_serving_e2e.py.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.serving import commands as serving

pytestmark = pytest.mark.slow

FRAMES = 16

# (name, text, seed, streaming); the trios run concurrently.
SOLO = [("solo", "One request alone.", 11, False), ("solo-stream", "One streamed request.", 12, True)]
TRIO = [(f"trio-{i}", f"Three at once, number {i}.", 21 + i, False) for i in range(3)]
TRIO_STREAM = [(f"trio-stream-{i}", f"Three streams at once, number {i}.", 31 + i, True) for i in range(3)]


@dataclass
class Run:
    audio: dict[str, bytes]
    codes: list[list[list[int]]]  # every request's frames, in the talker's order of first frame
    served: dict[str, str]  # the talker process's components
    served_after: dict[str, str]  # the same, read again after the requests
    log: str


def _one(server: serving.Server, text: str, seed: int, stream: bool, sample_rate: int) -> bytes:
    if stream:
        speech = serving.synthesize_streaming(
            server, text, max_frames=FRAMES, seed=seed, sample_rate=sample_rate
        )
    else:
        speech = serving.synthesize(server, text, max_frames=FRAMES, seed=seed)
    assert speech.audio_s > 0, f"no audio for {text!r}"
    return speech.wav


def _concurrently(server: serving.Server, requests: list, sample_rate: int, audio: dict[str, bytes]) -> None:
    errors: list[BaseException] = []

    def run(name: str, text: str, seed: int, stream: bool) -> None:
        try:
            audio[name] = _one(server, text, seed, stream, sample_rate)
        except BaseException as exc:  # re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=r) for r in requests]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors


def talker_served(stats_dir: Path) -> dict[str, str]:
    """The components of the talker process (the one that served a predictor)."""
    (talker,) = [
        s for s in step_stats.served_dir(stats_dir).values() if "talker" in s.get("model", "").lower()
    ]
    return talker


def serve_workload(
    model: Path, work: Path, name: str, env: dict[str, str], args: tuple[str, ...] = ()
) -> Run:
    stats = work / name / "stats"
    full_env = {
        "VLLM_OMNI_STEP_STATS_DIR": str(stats),
        "VLLM_OMNI_STEP_STATS_CODES": "1",
        "XDG_CACHE_HOME": str(work / "cache"),
        # Bit-for-bit against stock: the float talker on both sides (whatever the default).
        "VLLM_OMNI_TALKER_INT8": "off",
        # Every step on all threads: with the step-down, a step's thread count follows code2wav's
        # timing, and vLLM's CPU attention splits its work by the thread count.
        "VLLM_OMNI_CORE_SHARING": "0",
        **env,
    }
    rate = serving.sample_rate_of(model)
    audio: dict[str, bytes] = {}
    with serving.running_server(
        str(model), work / name / "server.log", vllm_args=args, env=full_env
    ) as server:
        served = talker_served(stats)
        for req in SOLO:
            audio[req[0]] = _one(server, *req[1:], sample_rate=rate)
        _concurrently(server, TRIO, rate, audio)
        _concurrently(server, TRIO_STREAM, rate, audio)
        served_after = talker_served(stats)
    return Run(
        audio=audio,
        codes=list(step_stats.codes_dir(stats).values()),
        served=served,
        served_after=served_after,
        log=(work / name / "server.log").read_text(errors="replace"),
    )


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served-equals-stock")


FP32 = ("--dtype", "float32")


@pytest.fixture(scope="module")
def stock(tiny_model_dir: Path, work: Path) -> Run:
    env = {"VLLM_OMNI_CPU_FASTPATH": "0", "VLLM_OMNI_CPU_EXECUTOR": "mp"}
    return serve_workload(tiny_model_dir, work, "stock", env)


@pytest.fixture(scope="module")
def fast_eager_fp32(tiny_model_dir: Path, work: Path) -> Run:
    return serve_workload(tiny_model_dir, work, "fast-eager-fp32", _fast_env("off"), FP32)


def _fast_env(compile: str) -> dict[str, str]:
    return {
        "VLLM_OMNI_CPU_FASTPATH": "1",
        "VLLM_OMNI_PREDICTOR_INT8": "off",
        "VLLM_OMNI_PREDICTOR_COMPILE": compile,
        # The fp32 prefill (on by default where this CPU lacks native bf16) sums in another order.
        "VLLM_OMNI_TALKER_FP32_PREFILL": "off",
    }


def _assert_same(run: Run, reference: Run) -> None:
    assert run.served["model.dtype"] == reference.served["model.dtype"]
    names = [r[0] for r in SOLO + TRIO + TRIO_STREAM]
    assert sorted(run.audio) == sorted(reference.audio) == sorted(names)
    # Every request has its codes, and they are the reference server's, frame for frame.
    assert len(reference.codes) == len(names) and all(reference.codes), [len(c) for c in reference.codes]
    assert Counter(map(repr, run.codes)) == Counter(map(repr, reference.codes))
    different = [n for n in names if run.audio[n] != reference.audio[n]]
    assert not different, f"audio bytes differ from the reference server's for {different}"


def _assert_fast(run: Run, compile_status: str) -> None:
    assert run.served["model"] == "omni_cpu_fastpath.qwen3_tts.talker.FastQwen3TTSTalker"
    assert run.served["predictor"] == "cached"
    assert run.served["predictor.int8"] == "off"
    assert run.served["predictor.compile"].startswith(compile_status), run.served
    # Nothing fell back or compiled again while serving (a recompile would have failed).
    assert run.served_after == run.served
    assert run.served["sampler"] == "CpuSampler (C kernel)"
    assert "FastQwen3TTSTalker serves: " in run.log


def test_stock_server_served_the_stock_talker_in_bf16(stock: Run) -> None:
    assert stock.served["model"].endswith("qwen3_tts_talker.Qwen3TTSTalkerForConditionalGeneration")
    assert stock.served["model.dtype"] == "bfloat16"
    assert "predictor" not in stock.served
    assert stock.served["executor"].startswith("mp (a worker process); OMP_NUM_THREADS="), stock.served
    # Different seeds and texts give different audio (the comparisons below can fail).
    assert len(set(stock.audio.values())) == len(stock.audio)


def test_fast_eager_equals_stock_bf16(tiny_model_dir: Path, work: Path, stock: Run) -> None:
    run = serve_workload(tiny_model_dir, work, "fast-eager", _fast_env("off"))
    _assert_fast(run, "off")
    assert run.served["executor"].startswith("uni (the model runs in the stage's engine process)")
    _assert_same(run, stock)


def test_fast_compiled_equals_fast_eager_fp32(
    tiny_model_dir: Path, work: Path, fast_eager_fp32: Run, served_compile_cache: Path
) -> None:
    _assert_fast(fast_eager_fp32, "off")
    assert fast_eager_fp32.served["model.dtype"] == "float32"
    env = {**_fast_env("step"), "VLLM_OMNI_COMPILE_CACHE_DIR": str(served_compile_cache)}
    run = serve_workload(tiny_model_dir, work, "fast-step-fp32", env, FP32)
    # Every bucket the runner can reach (max_num_seqs 8) was compiled at load.
    _assert_fast(run, "step (buckets 1,2,4,8, compiled at load")
    _assert_same(run, fast_eager_fp32)


def test_fast_decode_rows_through_the_kernel_prefill_as_stock_bf16(
    tiny_model_dir: Path, work: Path, stock: Run
) -> None:
    """``VLLM_OMNI_TALKER_DECODE_GEMV=1``: the talker's decode rows through the few-row kernel,
    its prompts through vLLM's product, so every request's first frame is stock's."""
    from cpu_helpers import decode_gemv_rows_by_cpuinfo, widest_simd_by_cpuinfo

    env = {**_fast_env("off"), "VLLM_OMNI_TALKER_DECODE_GEMV": "1"}
    run = serve_workload(tiny_model_dir, work, "fast-decode-gemv", env)
    _assert_fast(run, "off")
    layers = 2  # tiny
    rows = decode_gemv_rows_by_cpuinfo()
    assert run.served["talker.prefill"] == (
        f"model dtype (bfloat16; {4 * layers} decoder linears; "
        f"{'1 row' if rows == 1 else f'1-{rows} rows'}: "
        f"C kernel ({widest_simd_by_cpuinfo()}); other rows in bfloat16)"
    )
    names = [r[0] for r in SOLO + TRIO + TRIO_STREAM]
    assert sorted(run.audio) == sorted(names) and len(run.codes) == len(names)
    assert Counter(repr(c[0]) for c in run.codes) == Counter(repr(c[0]) for c in stock.codes)
    # Later frames: the same products summed in another order, where one rounding can tip a
    # sampled code and the request then goes its own way; a kernel that mixed up rows or weights
    # would part every request from stock's codes.
    same = Counter(map(repr, run.codes)) & Counter(map(repr, stock.codes))
    assert sum(same.values()) >= len(names) * 3 // 4, f"{sum(same.values())} of {len(names)}"
