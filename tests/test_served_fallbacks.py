"""Each fast path that cannot run says why, the stock path serves, and the audio still comes.

Faults are injected into real servers on loopback (``tests/fault_injection/sitecustomize.py``, on
PYTHONPATH, acts in every process of the server): the cached predictor cannot be built and the
sampler's and the few-row product's C kernels are missing (one server, which also serves the int8
talker, ``VLLM_OMNI_TALKER_INT8``, with its in-situ parity on), or the compiled predictor step
fails at the first request after a good warm-up (another). The reference for "the audio
still comes" is the checkpoint's own frame size; for "says why", the reasons step_stats records
and the log.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.serving import commands as serving

pytestmark = pytest.mark.slow

FAULTS_DIR = Path(__file__).resolve().parent / "fault_injection"
FRAMES = 8


def _served_talker(stats: Path) -> dict[str, str]:
    processes = step_stats.served_dir(stats).values()
    (talker,) = [s for s in processes if "talker" in s.get("model", "").lower()]
    return talker


def _serve_with_faults(
    model: Path, work: Path, faults: str, args: tuple[str, ...] = (), **env: str
) -> tuple[dict, dict, str]:
    stats = work / "stats"
    full_env = {
        "OMNI_TEST_FAULTS": faults,
        "PYTHONPATH": str(FAULTS_DIR),
        "VLLM_OMNI_CPU_FASTPATH": "1",
        "VLLM_OMNI_STEP_STATS_DIR": str(stats),
        "XDG_CACHE_HOME": str(work / "cache"),
        **env,
    }
    per_frame = serving.sample_rate_of(model) * 2 // 25  # 80 ms frames
    with serving.running_server(str(model), work / "server.log", vllm_args=args, env=full_env) as server:
        before = _served_talker(stats)
        for seed, stream in ((1, False), (2, True)):
            if stream:
                rate = serving.sample_rate_of(model)
                speech = serving.synthesize_streaming(
                    server, "Still speaking.", max_frames=FRAMES, seed=seed, sample_rate=rate
                )
            else:
                speech = serving.synthesize(server, "Still speaking.", max_frames=FRAMES, seed=seed)
            samples = round(speech.audio_s * speech.sample_rate)
            assert samples > 0 and samples % per_frame == 0, (samples, per_frame)
        after = _served_talker(stats)
    return before, after, (work / "server.log").read_text(errors="replace")


def test_predictor_construction_error_missing_kernels_and_the_int8_talker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    faults = "predictor-construction,kernel-missing,gemv-missing"
    before, after, log = _serve_with_faults(
        tiny_model_dir,
        tmp_path,
        faults,
        VLLM_OMNI_TALKER_INT8="w8-channel",
        VLLM_OMNI_TALKER_PARITY_CHECK="1",
        VLLM_OMNI_OMP_BLOCKTIME="",
        VLLM_OMNI_CORE_SHARING="0",
    )
    # The defaults, set here as the off side of test_serving_e2e.py's server: vLLM's OpenMP spin,
    # and the talker on all its threads throughout.
    assert before["openmp.blocktime"] == "5 ms (Intel OpenMP; VLLM_OMNI_OMP_BLOCKTIME empty; vLLM's setting)"
    assert before["core_sharing"] == "off (VLLM_OMNI_CORE_SHARING=0)", before
    assert before["talker.compile"] == "off (eager)", before  # VLLM_OMNI_TALKER_COMPILE's default
    # The stock predictor serves, and the reason is recorded and logged.
    assert before["predictor"].startswith("stock (CachedCodePredictor.from_stock failed"), before
    assert "injected: CachedCodePredictor cannot be built" in before["predictor"]
    assert before["predictor.compile"] == "off (stock predictor)"
    # The int8 default still applies to the stock predictor.
    assert before["predictor.int8"] == "w8-channel"
    # CpuSampler takes its numpy road and says why.
    assert before["sampler"].startswith("CpuSampler (numpy (the C kernel is not built"), before
    assert "injected: the C kernel is not built" in before["sampler"]
    # The int8 layers' few-row products: torch's kernels, and why.
    assert before["predictor.int8.product"].startswith("torch's kernels (the C kernel is not built"), before
    assert "injected: the few-row kernel is not built" in before["predictor.int8.product"]
    assert after == before
    assert "keeping the stock code predictor" in log
    assert "FastQwen3TTSTalker serves: " in log

    # The int8 talker serves beside the stock predictor, its few-row products through torch's.
    layers = 2  # tiny
    assert before["talker.int8"].startswith(
        f"w8-channel ({4 * layers} decoder linears, outlier input columns fp32 from the RMSNorm gains, "
        "_weight_int8pack_mm; torch's kernels (the C kernel is not built"
    ), before
    assert "injected: the few-row kernel is not built" in before["talker.int8"]
    # In-situ parity: every forward's positions against the bf16 reference of the same layers.
    assert before["talker.parity"].startswith("on"), before
    summary = step_stats.summarize_dir(tmp_path / "stats")
    top1, kl = summary["talker.parity.top1"], summary["talker.parity.kl"]
    assert top1["count"] >= FRAMES and summary["talker.parity.check_ms"]["count"] >= FRAMES
    # The tiny model (random weights, no outliers): int8 close to bf16, and not identical to it.
    assert top1["mean"] >= 0.9 and kl["mean"] < 0.01, (top1, kl)
    assert summary["talker.parity.max_logit_diff"]["max"] > 0.0


def test_compiled_step_failing_at_run_time_falls_back_to_eager(
    tiny_model_dir: Path, tmp_path: Path, served_compile_cache: Path
) -> None:
    # The fp32 step without int8 of test_served_equals_stock.py, whose compiled graphs it loads from
    # the shared cache (the fault acts on the loaded step as on a freshly compiled one).
    before, after, log = _serve_with_faults(
        tiny_model_dir,
        tmp_path,
        "compile-at-run-time",
        args=("--dtype", "float32"),
        VLLM_OMNI_PREDICTOR_COMPILE="step",
        VLLM_OMNI_PREDICTOR_INT8="off",
        VLLM_OMNI_COMPILE_CACHE_DIR=str(served_compile_cache),
    )
    assert before["predictor"] == "cached"
    assert before["predictor.compile"].startswith("step (buckets 1,2,4,8, compiled at load"), before
    # Each request's bucket failed: it was dropped, with the reason, and the next call padded to the
    # next bucket, until none was left and the predictor ran eager; the audio came every time.
    status = after["predictor.compile"]
    assert status.startswith("eager (dropped buckets 1,2") and "failed at run time" in status, status
    assert "injected: the compiled step failed" in status, status
    assert "bucket 1 dropped" in log
