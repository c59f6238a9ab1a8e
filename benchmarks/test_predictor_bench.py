"""pytest-benchmark: one predictor frame (15 sub-steps, batch 1, fp32), stock vs KV-cached.

Run with ``make bench`` (``pytest benchmarks --benchmark-enable``); with the repository default
``--benchmark-disable`` each body runs once as a smoke test. Real 0.6B dimensions, random weights.
Speed is reported, never asserted: each cached row records its speed-up against the stock row of
the same session and its ratio to the bandwidth floor measured in the same session
(``extra_info``), as ``omni-cpu-fastpath bench predictor --json`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import BATCH, frame


def test_stock_frame(benchmark: Any, predictor_setup: dict[str, Any], record: Any) -> None:
    codes = benchmark.pedantic(
        frame, args=(predictor_setup["stock"], predictor_setup["inputs"]), rounds=3, warmup_rounds=1
    )
    assert codes.shape == (BATCH, 16)
    record(benchmark, "stock", "fp32")


@pytest.mark.slow
def test_stock_compiled_frame(benchmark: Any, predictor_setup: dict[str, Any], record: Any) -> None:
    """vllm-omni's own compiled predictor (its GPU-platform torch.compile path): the strongest stock row."""
    from omni_cpu_fastpath.bench.predictor import build_stock_compiled

    pred, compile_s = build_stock_compiled(predictor_setup["stock"], [BATCH])
    codes = benchmark.pedantic(frame, args=(pred, predictor_setup["inputs"]), rounds=3, warmup_rounds=1)
    assert torch.equal(codes, frame(predictor_setup["stock"], predictor_setup["inputs"]))
    record(benchmark, "stock-compiled", "fp32", compile_s=compile_s)


def test_cached_eager_frame(benchmark: Any, predictor_setup: dict[str, Any], record: Any) -> None:
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    pred = CachedCodePredictor.from_stock(predictor_setup["stock"], compile="off", threads=0)
    codes = benchmark.pedantic(frame, args=(pred, predictor_setup["inputs"]), rounds=5, warmup_rounds=1)
    assert torch.equal(codes, frame(predictor_setup["stock"], predictor_setup["inputs"]))
    record(benchmark, "cached-eager", "fp32")


@pytest.mark.slow
def test_cached_compiled_frame(benchmark: Any, predictor_setup: dict[str, Any], record: Any) -> None:
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    pred = CachedCodePredictor.from_stock(
        predictor_setup["stock"], compile="step", threads=0, buckets=(BATCH,)
    )
    assert pred.compile_mode == "step", "the step did not compile (see the warning log)"
    codes = benchmark.pedantic(frame, args=(pred, predictor_setup["inputs"]), rounds=5, warmup_rounds=1)
    assert codes.shape == (BATCH, 16)
    record(benchmark, "cached-compiled", "fp32", compile_s=pred.compile_seconds)
