"""``omni-cpu-fastpath bench predictor``: ms per frame of the code predictor against its floor.

Builds vllm-omni's own predictor at real dimensions with random weights (no checkpoint), wraps it
in :class:`~omni_cpu_fastpath.qwen3_tts.predictor.CachedCodePredictor` (eager and compiled), and times one
frame (15 sub-steps) per call for each impl / dtype / batch. Every row carries the memory-bandwidth
floor of its weight format measured in the same run (``bench.floor``) and its speed-up against the
stock predictor of the same dtype and batch, measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# "stock-compiled": vllm-omni's own torch.compile path, as it runs on GPU platforms (the strongest
# stock row); "stock": its eager path, which is what it runs on CPU.
IMPLS = ("stock", "stock-compiled", "cached-eager", "cached-compiled")
STOCK_IMPLS = ("stock", "stock-compiled")


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    # vLLM builds models under the checkpoint dtype, so fp32-only buffers (inv_freq) stay fp32.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(prev)


def predictor_configs(dims: str) -> tuple[Any, Any]:
    """vllm-omni's (code predictor config, talker config) at ``dims`` (checkpoint.DIMS)."""
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import (
        Qwen3TTSTalkerCodePredictorConfig,
        Qwen3TTSTalkerConfig,
    )

    from omni_cpu_fastpath.testing.checkpoint import CODEBOOK_VOCAB, NUM_CODE_GROUPS, dims_of

    d = dims_of(dims)
    cp = Qwen3TTSTalkerCodePredictorConfig(
        hidden_size=d.cp_hidden,
        intermediate_size=d.cp_mlp,
        num_hidden_layers=d.cp_layers,
        num_attention_heads=d.cp_heads,
        num_key_value_heads=d.cp_kv_heads,
        head_dim=d.cp_head_dim,
        vocab_size=CODEBOOK_VOCAB,
        num_code_groups=NUM_CODE_GROUPS,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    talker = Qwen3TTSTalkerConfig(
        hidden_size=d.talker_hidden, code_predictor_config=cp.to_dict(), num_code_groups=NUM_CODE_GROUPS
    )
    return cp, talker


def build_stock_random(dims: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Module:
    """vllm-omni's Qwen3-TTS code predictor at ``dims`` with random weights, eval mode."""
    from vllm.config import DeviceConfig, VllmConfig
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code_predictor_vllm import (
        Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM,
    )

    cp, talker = predictor_configs(dims)
    vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with default_dtype(dtype):
        stock = Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM(
            vllm_config=vllm_config, config=cp, talker_config=talker
        )
    randomize_(stock, seed)
    return stock.eval()


def build_stock_compiled(stock: nn.Module, batches: list[int]) -> tuple[nn.Module, float]:
    """vllm-omni's compiled stock predictor with ``stock``'s weights, warmed up; and its compile seconds.

    Its buckets are those vllm-omni derives from ``max_num_seqs``, set to the largest batch.
    """
    from torch._dynamo.utils import counters

    from omni_cpu_fastpath.testing.stock import compiled_predictor_cls

    compiled = copy.deepcopy(stock)
    compiled.__class__ = compiled_predictor_cls()  # the same module; only _setup_compile differs
    compiled._vllm_config.scheduler_config.max_num_seqs = max(batches)
    # A stock predictor that has run once holds its eager forward; the copy must set up anew.
    compiled._compiled_model_fwd = None
    graphs = int(counters["stats"]["unique_graphs"])
    t0 = time.perf_counter()
    compiled._setup_compile()
    seconds = time.perf_counter() - t0
    if int(counters["stats"]["unique_graphs"]) == graphs:
        raise RuntimeError("stock-compiled: vllm-omni's compile path compiled no graph")
    return compiled, seconds


@torch.no_grad()
def randomize_(module: nn.Module, seed: int) -> None:
    """Weights like a trained model's scale: N(0, 0.02) matrices, norms near 1, in place."""
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        r = torch.randn(p.shape, generator=g, dtype=torch.float32)
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * r)
        elif name.endswith("bias"):
            p.copy_(0.02 * r)
        else:
            p.copy_(0.02 * r if "embedding" not in name else r)


def _csv(value: str, allowed: tuple[str, ...] | None, what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--{what} is empty")
    if allowed is not None:
        bad = [v for v in items if v not in allowed]
        if bad:
            raise ValueError(f"--{what}: {', '.join(bad)} not valid; accepted values: {', '.join(allowed)}")
    return items


def _batches(value: str) -> list[int]:
    try:
        out = [int(v) for v in _csv(value, None, "batches")]
    except ValueError as exc:
        raise ValueError(f"--batches must be comma-separated positive integers, got {value!r}") from exc
    if any(b < 1 for b in out):
        raise ValueError(f"--batches must be positive, got {value!r}")
    return out


def build_impl(
    stock: nn.Module, impl: str, batches: list[int], int8: str | None = None
) -> tuple[Any, float | None]:
    """The predictor behind ``impl`` (and its compile seconds), sharing ``stock``'s weights."""
    from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor

    if impl in STOCK_IMPLS and int8:
        raise ValueError("int8 rows are cached predictors; use impl cached-eager or cached-compiled")
    if impl == "stock":
        return stock, None
    if impl == "stock-compiled":
        return build_stock_compiled(stock, batches)
    compiled = impl == "cached-compiled"
    if int8:
        # Quantization rewrites the layers in place: each int8 row gets its own copy of the weights.
        stock = copy.deepcopy(stock)
    pred = CachedCodePredictor.from_stock(
        stock, compile="step" if compiled else "off", threads=0, buckets=batches, warmup=False
    )
    if int8:
        if importlib.util.find_spec("omni_cpu_fastpath.qwen3_tts.quant") is None:
            raise ValueError("--int8 needs omni_cpu_fastpath.qwen3_tts.quant, which is not installed")
        from omni_cpu_fastpath.qwen3_tts import quant

        quant.quantize_predictor(pred, int8, compile="step" if compiled else "off")
    if compiled and not pred.warmup():
        raise RuntimeError("the compiled step fell back to eager (see the warning above)")
    return pred, pred.compile_seconds


def time_frames(pred: Any, batch: int, frames: int, emb_dim: int, dtype: torch.dtype, seed: int = 0) -> float:
    """Mean ms per frame (one predictor call on ``batch`` rows, default sampling, seeded)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, 1, emb_dim, generator=g).to(dtype)
    embed = torch.randn(batch, 1, emb_dim, generator=g).to(dtype)
    code = torch.randint(0, 2048, (batch, 1), generator=g)

    def call() -> None:
        gens = [torch.Generator().manual_seed(seed + i) for i in range(batch)]
        pred(layer0_code=code, layer0_embed=embed, last_talker_hidden=hidden, generators=gens)

    call()  # warm
    t0 = time.perf_counter()
    for _ in range(frames):
        call()
    return (time.perf_counter() - t0) / frames * 1e3


def run(
    dims: str = "0.6b",
    dtypes: list[str] | None = None,
    batches: list[int] | None = None,
    impls: list[str] | None = None,
    int8: list[str] | None = None,
    frames: int = 8,
) -> list[dict[str, Any]]:
    """Rows ``{impl, dtype, batch, ms_per_frame, floor_ms, bandwidth_gbs, ratio_to_floor, ...}``."""
    import os

    from .floor import cpu_name, floor_ms, measure_bandwidth, params_per_frame

    dtypes = dtypes or ["fp32", "bf16"]
    batches = batches or [1, 8]
    impls = impls or list(IMPLS)
    int8 = int8 or []
    if frames < 1:
        raise ValueError(f"--frames must be >= 1, got {frames}")
    bw = measure_bandwidth()
    logger.info("read bandwidth %.1f GB/s (best probe: %s)", bw.best_gbs, bw.kernel)
    rows: list[dict[str, Any]] = []
    for dt in dtypes:
        dtype = DTYPES[dt]
        stock = build_stock_random(dims, dtype)
        params = params_per_frame(stock)
        emb_dim = stock.model.codec_embedding[0].weight.shape[1]
        variants: list[tuple[str, str | None]] = [(i, None) for i in impls]
        variants += [(i, v) for v in int8 for i in impls if i not in STOCK_IMPLS]
        stock_ms: dict[str, dict[int, float]] = {i: {} for i in STOCK_IMPLS}
        for impl, variant in variants:
            pred, compile_s = build_impl(stock, impl, batches, variant)
            fmt = "int8" if variant else dt
            floor = floor_ms(params, fmt, bw.best_gbs)
            for b in batches:
                ms = time_frames(pred, b, frames, emb_dim, dtype)
                if impl in STOCK_IMPLS:
                    stock_ms[impl][b] = ms
                row: dict[str, Any] = {
                    "impl": impl,
                    "dtype": dt,
                    "batch": b,
                    "ms_per_frame": round(ms, 2),
                    "floor_ms": round(floor, 2),
                    "bandwidth_gbs": round(bw.best_gbs, 2),
                    "ratio_to_floor": round(ms / floor, 3),
                    "speedup_vs_stock": _ratio(stock_ms["stock"].get(b), ms),
                    "speedup_vs_stock_compiled": _ratio(stock_ms["stock-compiled"].get(b), ms),
                    "cpu": cpu_name(),
                    "dims": dims,
                    "threads": torch.get_num_threads(),
                    "load_1min": round(os.getloadavg()[0], 2),
                    "compile_s": round(compile_s, 1) if compile_s is not None else None,
                }
                if variant:
                    row["int8"] = variant
                rows.append(row)
            if pred is not stock:
                # Free the compiled graphs (frozen weight copies) before the next impl.
                del pred
        del stock
    return rows


def _ratio(base: float | None, ms: float) -> float | None:
    return round(base / ms, 3) if base else None


def format_rows(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'impl':<16}{'int8':<12}{'dtype':<6}{'batch':>6}{'ms/frame':>10}{'floor':>9}{'x floor':>9}"
        f"{'vs stock':>10}{'vs compiled stock':>19}"
    )
    out = [head, "-" * len(head)]
    for r in rows:
        vs = f"{r['speedup_vs_stock']:.2f}x" if r["speedup_vs_stock"] else "-"
        vs_c = f"{r['speedup_vs_stock_compiled']:.2f}x" if r["speedup_vs_stock_compiled"] else "-"
        out.append(
            f"{r['impl']:<16}{r.get('int8', '-'):<12}{r['dtype']:<6}{r['batch']:>6}{r['ms_per_frame']:>10.1f}"
            f"{r['floor_ms']:>9.1f}{r['ratio_to_floor']:>9.2f}{vs:>10}{vs_c:>19}"
        )
    if rows:
        r = rows[0]
        out.append(
            f"{r['cpu']}: read bandwidth {r['bandwidth_gbs']} GB/s, {r['threads']} threads, "
            f"load {r['load_1min']} at the end"
        )
    return "\n".join(out)


def cli(args: argparse.Namespace) -> int:
    try:
        # vLLM's log handler binds sys.stdout when vllm is first imported: keep it on stderr so that
        # stdout holds only the table or the JSON.
        with contextlib.redirect_stdout(sys.stderr):
            rows = run(
                dims=args.dims,
                dtypes=_csv(args.dtypes, tuple(DTYPES), "dtypes"),
                batches=_batches(args.batches),
                impls=_csv(args.impls, IMPLS, "impls"),
                int8=_csv(args.int8, None, "int8") if args.int8 else [],
                frames=args.frames,
            )
    except ValueError as exc:
        print(f"omni-cpu-fastpath bench predictor: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows))
    return 0
