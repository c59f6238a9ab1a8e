"""pytest-benchmark: one predictor frame (15 sub-steps, batch 1) per int8 variant, vs stock fp32.

Run with ``make bench``; with the repository default ``--benchmark-disable`` each body runs once
as a smoke test. Real 0.6B dimensions (``OMNI_BENCH_DIMS`` to change), random weights: speed does
not depend on the values (parity lives in tests/test_quant.py and ``omni-cpu-fastpath parity``).
Speed is reported, never asserted. Each row's ``extra_info`` holds, measured in the same session:
``ms_per_frame``, ``floor_ms`` (int8 bytes per frame / best read bandwidth, ``bench.floor``),
``ratio_to_floor`` and ``speedup_vs_stock-fp32`` (the stock vllm-omni predictor, fp32, eager).
The eager rows by product compare ATen's int8 kernel with the package's
(``speedup_vs_w8-channel-off-aten``).
Targets on the 2-core machine: the default variant within 1.5x of the int8 floor and
>= 10x faster than stock fp32.
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import BATCH, DIMS, frame


def test_stock_fp32_frame(benchmark: Any, predictor_setup: dict[str, Any], record: Any) -> None:
    codes = benchmark.pedantic(
        frame, args=(predictor_setup["stock"], predictor_setup["inputs"]), rounds=3, warmup_rounds=1
    )
    assert codes.shape == (BATCH, 16)
    record(benchmark, "stock-fp32", "fp32")


@pytest.mark.parametrize(
    "variant,compile",
    [
        ("w8-channel", "step"),
        ("w8-bf16head", "step"),
        ("torchao-w8", "step"),
        ("w8-channel", "off"),
        ("ao-dynamic", "off"),
    ],
)
def test_int8_frame(
    benchmark: Any, predictor_setup: dict[str, Any], record: Any, variant: str, compile: str
) -> None:
    import copy

    from omni_cpu_fastpath.qwen3_tts import quant
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    pred = CachedCodePredictor.from_stock(
        copy.deepcopy(predictor_setup["stock"]), compile=compile, threads=0, buckets=(BATCH,), warmup=False
    )
    quant.quantize_predictor(pred, variant, compile=compile)
    if compile == "step":
        pred.warmup()
        assert pred.compiler.steps is not None, "the compiled step fell back to eager"
    benchmark.group = f"predictor frame int8 ({DIMS}, batch {BATCH})"
    codes = benchmark.pedantic(frame, args=(pred, predictor_setup["inputs"]), rounds=5, warmup_rounds=1)
    assert codes.shape == (BATCH, 16)
    record(benchmark, f"{variant}-{compile}", "int8", baseline="stock-fp32", compile_s=pred.compile_seconds)


@pytest.mark.parametrize("product", ["aten", "kernel"])
def test_int8_eager_frame_by_product(
    benchmark: Any, predictor_setup: dict[str, Any], record: Any, product: str, monkeypatch: Any
) -> None:
    """The eager ``w8-channel`` frame with its 1-8-row products from ATen's ``_weight_int8pack_mm``
    and from the package's kernel (``VLLM_OMNI_CPU_GEMV``), each against the ATen row."""
    import copy

    from omni_cpu_fastpath import cpu_gemv
    from omni_cpu_fastpath.qwen3_tts import quant
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    monkeypatch.setenv("VLLM_OMNI_CPU_GEMV", "1" if product == "kernel" else "0")
    pred = CachedCodePredictor.from_stock(
        copy.deepcopy(predictor_setup["stock"]), compile="off", threads=0, buckets=(BATCH,), warmup=False
    )
    quant.quantize_predictor(pred, "w8-channel", compile="off")
    layer = pred.model.layers[0].mlp.down_proj
    assert layer.gemv == (product == "kernel"), cpu_gemv.status()
    benchmark.group = f"predictor frame int8 eager, by product ({DIMS}, batch {BATCH})"
    codes = benchmark.pedantic(frame, args=(pred, predictor_setup["inputs"]), rounds=5, warmup_rounds=1)
    assert codes.shape == (BATCH, 16)
    record(
        benchmark,
        f"w8-channel-off-{product}",
        "int8",
        baseline=("stock-fp32", "w8-channel-off-aten"),
        product=cpu_gemv.status(),
    )
