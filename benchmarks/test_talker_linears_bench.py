"""pytest-benchmark: the bf16 talker's decoder linears, stock (vLLM's) against the package's
method for CPUs without native bf16 (``VLLM_OMNI_TALKER_FP32_PREFILL``): one prefill (a 100-token
prompt through the decoder and codec head, in fp32 there) and one decode step at 1 and 8 rows
(through the few-row kernel there, ``VLLM_OMNI_CPU_GEMV``); and a decode step of the same method
with its prefill left in bf16 (``VLLM_OMNI_TALKER_DECODE_GEMV``, the ``decode-gemv`` row).

Run with ``make bench``; with the repository default ``--benchmark-disable`` each body runs once
as a smoke test. ``OMNI_BENCH_DIMS`` (default ``0.6b``) picks the dimensions of the random
checkpoint. Speed is reported, never asserted. Each row's ``extra_info``: ``ms_per_prefill``,
``tokens``, ``cpu``, ``native_bf16`` and, for the fp32-prefill row, ``speedup_vs_stock-bf16``
(measured in the same session). A prefill is compute-bound: the floor beside it is the bf16
weights read once (``floor_ms``), which no prompt of this length approaches. A decode step reads
every weight once: ``floor_ms`` is its bound, and rows report ``ms_per_step`` (the median of the
steps after a 16-position context) and ``ratio_to_floor``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import DIMS

TOKENS = 100


@pytest.fixture(scope="module")
def prefill_setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import torch

    from omni_cpu_fastpath.bench.floor import cpu_name, measure_bandwidth
    from omni_cpu_fastpath.qwen3_tts import talker_parity
    from omni_cpu_fastpath.serving.stage_settings import TALKER_DECODE_GEMV_METHOD, TALKER_FP32_PREFILL_METHOD
    from omni_cpu_fastpath.testing.checkpoint import make_model
    from omni_cpu_fastpath.testing.stock import build_stock_talker

    torch.set_num_threads(min(2, torch.get_num_threads()))
    model_dir: Path = make_model(tmp_path_factory.mktemp("talker-prefill"), dims=DIMS, seed=0)
    stock = build_stock_talker(model_dir, torch.bfloat16)
    fast = build_stock_talker(model_dir, torch.bfloat16, quantization=TALKER_FP32_PREFILL_METHOD)
    decode = build_stock_talker(model_dir, torch.bfloat16, quantization=TALKER_DECODE_GEMV_METHOD)
    embeds = talker_parity.make_embeds(stock[0], 1, TOKENS).to(torch.bfloat16)
    bw = measure_bandwidth()
    return {
        "builds": {"stock-bf16": stock, "fp32-prefill": fast, "decode-gemv": decode},
        "embeds": embeds,
        "floor_ms": talker_parity.weight_bytes(stock[0]) / (bw.best_gbs * 1e9) * 1e3,
        "cpu": cpu_name(),
        "native_bf16": torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),
        "session": {},
    }


@pytest.mark.parametrize("row", ["stock-bf16", "fp32-prefill"])
def test_talker_prefill(benchmark: Any, prefill_setup: dict[str, Any], row: str) -> None:
    import torch

    from omni_cpu_fastpath.qwen3_tts import talker_parity

    model, cfg = prefill_setup["builds"][row]
    benchmark.group = f"talker prefill ({DIMS}, {TOKENS} tokens, bf16)"
    with torch.inference_mode():
        logits = benchmark.pedantic(
            talker_parity.teacher_forced_logits, args=(model, cfg, prefill_setup["embeds"]), rounds=3
        )
    assert logits.shape[:2] == (1, TOKENS) and bool(torch.isfinite(logits).all())
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: nothing was timed
        return
    ms = stats.stats.min * 1e3
    prefill_setup["session"][row] = ms
    benchmark.extra_info.update(
        {
            "ms_per_prefill": ms,
            "tokens": TOKENS,
            "floor_ms": prefill_setup["floor_ms"],
            "cpu": prefill_setup["cpu"],
            "native_bf16": prefill_setup["native_bf16"],
            "load_1min": os.getloadavg()[0],
        }
    )
    if row != "stock-bf16" and "stock-bf16" in prefill_setup["session"]:
        benchmark.extra_info["speedup_vs_stock-bf16"] = prefill_setup["session"]["stock-bf16"] / ms


DECODE_CONTEXT = 16  # a short context: the stock rows prefill it in emulated bf16
DECODE_STEPS = 8


@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("row", ["stock-bf16", "fp32-prefill", "decode-gemv"])
def test_talker_decode_step(benchmark: Any, prefill_setup: dict[str, Any], row: str, rows: int) -> None:
    import torch
    from vllm.config.vllm import set_current_vllm_config

    from omni_cpu_fastpath.qwen3_tts import talker_parity

    model, cfg = prefill_setup["builds"][row]
    embeds = talker_parity.make_embeds(model, rows, DECODE_CONTEXT + DECODE_STEPS).to(torch.bfloat16)
    ids = talker_parity.codec_ids(model)

    def steps() -> torch.Tensor:
        cache = talker_parity.KVCache()
        talker_parity.decoder_forward(model, embeds[:, :DECODE_CONTEXT], cache)
        times = []
        for s in range(DECODE_STEPS):
            at = DECODE_CONTEXT + s
            t0 = time.perf_counter()
            h = talker_parity.decoder_forward(model, embeds[:, at : at + 1], cache, start=at)
            logits = talker_parity.codec_logits(model, h, ids)
            times.append(time.perf_counter() - t0)
        step_ms.append(1e3 * sorted(times)[len(times) // 2])
        return logits

    step_ms: list[float] = []
    benchmark.group = f"talker decode step ({DIMS}, {rows} rows, bf16)"
    with torch.inference_mode(), set_current_vllm_config(cfg):
        logits = benchmark.pedantic(steps, rounds=2)
    assert logits.shape[0] == rows and bool(torch.isfinite(logits).all())
    if getattr(benchmark, "stats", None) is None:  # --benchmark-disable: nothing was timed
        return
    ms = min(step_ms)
    name = f"{row}-decode-{rows}"
    prefill_setup["session"][name] = ms
    benchmark.extra_info.update(
        {
            "ms_per_step": ms,
            "rows": rows,
            "floor_ms": prefill_setup["floor_ms"],
            "ratio_to_floor": ms / prefill_setup["floor_ms"],
            "cpu": prefill_setup["cpu"],
            "native_bf16": prefill_setup["native_bf16"],
            "load_1min": os.getloadavg()[0],
        }
    )
    stock = f"stock-bf16-decode-{rows}"
    if name != stock and stock in prefill_setup["session"]:
        benchmark.extra_info["speedup_vs_stock-bf16"] = prefill_setup["session"][stock] / ms
