"""Shared set-up of the predictor benchmarks: real-dimension stock predictor, inputs, floors.

``OMNI_BENCH_DIMS`` picks the dimensions (default ``0.6b``; ``tiny`` for a quick smoke run).
Speed is reported, never asserted: each row's ``extra_info`` holds its ms per frame, the floor of
the weight format measured in the same session and its speed-up against the stock row.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

DIMS = os.environ.get("OMNI_BENCH_DIMS", "0.6b")
BATCH = 1
# The stock rows every cached row is compared with: vllm-omni's eager predictor (what it runs on
# CPU) and its compiled one (what it runs on GPU platforms), each measured in the same session.
STOCK_ROWS = ("stock", "stock-compiled")


@pytest.fixture(scope="session")
def predictor_setup() -> dict[str, Any]:
    from omni_cpu_fastpath.bench.floor import cpu_name, floor_ms, measure_bandwidth, params_per_frame
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
    params = params_per_frame(stock)
    return {
        "dims": DIMS,
        "batch": BATCH,
        "stock": stock,
        "inputs": inputs,
        "bandwidth_gbs": bw.best_gbs,
        "cpu": cpu_name(),
        "floor_ms": {fmt: floor_ms(params, fmt, bw.best_gbs) for fmt in ("fp32", "bf16", "int8")},
        "session": {},  # row name -> ms per frame, for the speed-ups
    }


def frame(pred: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One predictor call (15 sub-steps), seeded per row."""
    gens = [torch.Generator().manual_seed(i) for i in range(BATCH)]
    return pred(**inputs, generators=gens)


@pytest.fixture
def record(predictor_setup: dict[str, Any]) -> Callable[..., None]:
    def _record(
        benchmark: Any, name: str, fmt: str, baseline: str | tuple[str, ...] = STOCK_ROWS, **extra: Any
    ) -> None:
        stats = getattr(benchmark, "stats", None)
        if stats is None:  # --benchmark-disable: nothing was timed
            return
        ms = stats.stats.min * 1e3  # min: the machine is shared, and the floor is a best case too
        session = predictor_setup["session"]
        session[name] = ms
        floor = predictor_setup["floor_ms"][fmt]
        benchmark.extra_info.update(
            {
                "ms_per_frame": ms,
                "floor_ms": floor,
                "weight_format": fmt,
                "bandwidth_gbs": predictor_setup["bandwidth_gbs"],
                "ratio_to_floor": ms / floor,
                "load_1min": os.getloadavg()[0],
                "cpu": predictor_setup["cpu"],
                **extra,
            }
        )
        for base in (baseline,) if isinstance(baseline, str) else baseline:
            if base in session and name != base:
                benchmark.extra_info[f"speedup_vs_{base}"] = session[base] / ms

    return _record
