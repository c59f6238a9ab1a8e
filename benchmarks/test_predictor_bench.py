"""pytest-benchmark: one predictor frame (15 sub-steps, batch 1, fp32), stock vs KV-cached.

Run with ``make bench`` (``pytest benchmarks --benchmark-enable``); with the repository default
``--benchmark-disable`` each body runs once as a smoke test. Real 0.6B dimensions, random weights.
Speed is reported, never asserted: each cached row records its speed-up against the stock row of
the same session and its ratio to the bandwidth floor measured in the same session
(``extra_info``), as ``omni-cpu-fastpath bench predictor --json`` does.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

DIMS = os.environ.get("OMNI_BENCH_DIMS", "0.6b")
BATCH = 1
_session: dict[str, Any] = {}


@pytest.fixture(scope="module")
def setup() -> dict[str, Any]:
    from omni_cpu_fastpath.bench.floor import floor_ms, measure_bandwidth, params_per_frame
    from omni_cpu_fastpath.bench.predictor import build_stock_random

    torch.set_num_threads(min(2, torch.get_num_threads()))
    stock = build_stock_random(DIMS, torch.float32)
    bw = measure_bandwidth()
    g = torch.Generator().manual_seed(0)
    width = stock.model.codec_embedding[0].weight.shape[1]
    inputs = {
        "layer0_code": torch.randint(0, 2048, (BATCH, 1), generator=g),
        "layer0_embed": torch.randn(BATCH, 1, width, generator=g),
        "last_talker_hidden": torch.randn(BATCH, 1, width, generator=g),
    }
    return {
        "stock": stock,
        "inputs": inputs,
        "bandwidth_gbs": bw.best_gbs,
        "floor_ms": floor_ms(params_per_frame(stock), "fp32", bw.best_gbs),
    }


def _frame(pred: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    gens = [torch.Generator().manual_seed(i) for i in range(BATCH)]
    return pred(**inputs, generators=gens)


def _record(benchmark: Any, name: str, setup: dict[str, Any]) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: nothing was timed
        return
    ms = stats.stats.mean * 1e3
    _session[name] = ms
    benchmark.extra_info.update(
        {
            "ms_per_frame": ms,
            "floor_ms": setup["floor_ms"],
            "bandwidth_gbs": setup["bandwidth_gbs"],
            "ratio_to_floor": ms / setup["floor_ms"],
            "load_1min": os.getloadavg()[0],
        }
    )
    if "stock" in _session and name != "stock":
        benchmark.extra_info["speedup_vs_stock"] = _session["stock"] / ms


def test_stock_frame(benchmark: Any, setup: dict[str, Any]) -> None:
    codes = benchmark.pedantic(_frame, args=(setup["stock"], setup["inputs"]), rounds=3, warmup_rounds=1)
    assert codes.shape == (BATCH, 16)
    _record(benchmark, "stock", setup)


def test_cached_eager_frame(benchmark: Any, setup: dict[str, Any]) -> None:
    from omni_cpu_fastpath.predictor import CachedCodePredictor

    pred = CachedCodePredictor.from_stock(setup["stock"], compile="off", threads=0)
    codes = benchmark.pedantic(_frame, args=(pred, setup["inputs"]), rounds=5, warmup_rounds=1)
    assert torch.equal(codes, _frame(setup["stock"], setup["inputs"]))
    _record(benchmark, "cached-eager", setup)


@pytest.mark.slow
def test_cached_compiled_frame(benchmark: Any, setup: dict[str, Any]) -> None:
    from omni_cpu_fastpath.predictor import CachedCodePredictor

    pred = CachedCodePredictor.from_stock(setup["stock"], compile="step", threads=0, buckets=(BATCH,))
    assert pred.compile_mode == "step", "the step did not compile (see the warning log)"
    codes = benchmark.pedantic(_frame, args=(pred, setup["inputs"]), rounds=5, warmup_rounds=1)
    assert codes.shape == (BATCH, 16)
    benchmark.extra_info["compile_s"] = pred.compile_seconds
    _record(benchmark, "cached-compiled", setup)
