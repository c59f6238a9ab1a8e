"""``bench spark-step``: ms per decode step of the exportable Spark-X2.5 step, hybrid vs all-full.

Random weights at the released dimensions (built on the meta device, filled in place: no
checkpoint on disk), one sequence at the last position of a ``context``-slot full cache (every
slot attended). The all-full layout shares the hybrid's weights. Each program is
``impl:dtype[:quant]``: ``eager`` runs ``SparkDecodeStep`` itself, ``aoti`` the AOTInductor
package of its ``torch.export`` (a compile of minutes at 1.7B), ``pte`` the ExecuTorch/XNNPACK
program; ``quant`` is a ``spark export --quant`` scheme. ``attention`` is attention alone
(scores, softmax, values over every layer's cache), to show what the layouts change. The floor
reads the weights as the program stores them (the head whole, one embedding row) and the K/V a
step attends, at the measured read bandwidth. A program that is not fp32 also gets its fidelity
against the fp32 eager step: greedy top-1 agreement and KL over ``fidelity_positions`` positions
of the hybrid layout.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from omni_cpu_fastpath.bench.floor import cpu_name, measure_bandwidth
from omni_cpu_fastpath.spark import program as spark_program
from omni_cpu_fastpath.spark.decode_step import (
    FULL,
    DecodeState,
    SparkDecodeStep,
    example_inputs,
    export_step,
)
from omni_cpu_fastpath.testing.spark_checkpoint import config_dict
from omni_cpu_fastpath.testing.spark_reference import fidelity

DTYPES = spark_program.DTYPES
IMPLS = ("eager", "aoti", "pte")
DEFAULT_PROGRAMS = "eager:bf16,aoti:bf16,aoti:bf16:w4,pte:fp32,pte:fp32:8da4w"


def random_step(cfg: dict[str, Any], dtype: torch.dtype, seed: int = 0) -> SparkDecodeStep:
    with torch.device("meta"):
        step = SparkDecodeStep(cfg).to(dtype)
    step = step.to_empty(device="cpu")  # allocated once, in the bench dtype
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in step.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=g)
    return step.eval()


def with_layout(step: SparkDecodeStep, layer_types: list[str]) -> SparkDecodeStep:
    """The same weights (shared, not copied) under other layer types."""
    with torch.device("meta"):
        other = SparkDecodeStep({**step.cfg, "layer_types": layer_types})
    other.load_state_dict(step.state_dict(), assign=True)
    return other.eval()


def step_inputs(cfg: dict[str, Any], context: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The last position of a full cache: every slot of both layer types attended."""
    inputs = list(example_inputs(cfg, context, dtype))
    inputs[5] = torch.zeros(context)
    inputs[6] = torch.zeros(cfg["sliding_window"])
    for i in range(7, 11):
        inputs[i] = torch.randn(inputs[i].shape).to(dtype)
    return tuple(inputs)


def parse_programs(spec: str) -> list[tuple[str, str, str]]:
    """``impl:dtype[:quant],...`` -> [(impl, dtype, quant)], each checked as ``spark export`` would."""
    programs = []
    for item in spec.split(","):
        parts = item.strip().split(":")
        if len(parts) not in (2, 3) or parts[0] not in IMPLS:
            raise ValueError(
                f"bench spark-step: bad program {item!r}; expected impl:dtype[:quant], impl in {IMPLS}"
            )
        impl, dtype, quant = parts[0], parts[1], parts[2] if len(parts) == 3 else "none"
        fmt = "pt2" if impl in ("eager", "aoti") else "pte"
        spark_program.check_options(fmt, dtype, quant)
        programs.append((impl, dtype, quant))
    return programs


_SUB_BYTE_BITS = {getattr(torch, f"int{b}"): b for b in range(1, 8)}


def _tensor_bytes(t: torch.Tensor) -> int:
    if type(t) not in (torch.Tensor, torch.nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, meta = t.__tensor_flatten__()  # a quantized tensor: its data and scales
        bits = _SUB_BYTE_BITS.get(meta.get("target_dtype")) if isinstance(meta, dict) else None
        total = 0
        for n in names:
            inner = getattr(t, n)
            # torchao keeps sub-byte weights one per int8 until lowering; a runtime packs them.
            packed = n == "qdata" and bits is not None and inner.dtype == torch.int8
            total += inner.numel() * bits // 8 if packed else _tensor_bytes(inner)
        return total
    return t.numel() * t.element_size()


def weight_read_bytes(step: SparkDecodeStep) -> int:
    """Bytes of weights one step reads: everything once, but of an untied embedding one row."""
    total = 0
    for name, p in step.named_parameters():
        if name == "model.embedding.weight" and step.lm_head is not None:
            total += _tensor_bytes(p[0])
        else:
            total += _tensor_bytes(p)
    return total


def compiled(step: SparkDecodeStep, impl: str, context: int, tmp: str) -> tuple[Callable, float, int]:
    """The step as ``impl`` at capacity ``context``: (callable, seconds to build, program bytes)."""
    if impl == "eager":
        return step, 0.0, 0
    t0 = time.perf_counter()
    fmt = "pt2" if impl == "aoti" else "pte"
    path = spark_program.lower(export_step(step, context), fmt, Path(tmp) / f"step-c{context}.{fmt}")
    build_s = time.perf_counter() - t0
    size, fn = path.stat().st_size, spark_program.load_program(path)
    path.unlink()  # GBs at the released dimensions; the loaded program keeps what it needs
    return fn, build_s, size


def time_ms(fn: Callable[[], object], steps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def attention_only(cfg: dict[str, Any], layer_types: list[str], context: int, dtype: torch.dtype) -> Callable:
    n_kv, hd, group = (
        cfg["num_key_value_heads"],
        cfg["head_dim"],
        cfg["num_attention_heads"] // cfg["num_key_value_heads"],
    )
    caches = []
    for t in layer_types:
        length = context if t == FULL else min(context, cfg["sliding_window"])
        caches.append((torch.randn(n_kv, length, hd).to(dtype), torch.randn(n_kv, length, hd).to(dtype)))
    q = torch.randn(n_kv, group, hd)

    def run() -> None:
        for k, v in caches:
            s = (q @ k.float().transpose(-1, -2)) / math.sqrt(hd)
            s.softmax(-1) @ v.float()

    return run


def kv_read_bytes(cfg: dict[str, Any], layer_types: list[str], context: int, dtype_bytes: int) -> int:
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * dtype_bytes
    return sum((context if t == FULL else cfg["sliding_window"]) * per_token for t in layer_types)


def run(
    dims: str = "1.7b",
    contexts: tuple[int, ...] = (1024, 4096),
    programs: str = DEFAULT_PROGRAMS,
    steps: int = 5,
    fidelity_positions: int = 32,
    on_row: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Time each program at each layout and context; ``on_row`` sees each row as it is measured
    (a run at the released dimensions takes most of an hour)."""
    cfg = config_dict(dims)
    specs = parse_programs(programs)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    bw = measure_bandwidth()
    full_types = [FULL] * cfg["num_hidden_layers"]
    ids = torch.randint(
        16, cfg["vocab_size"], (fidelity_positions,), generator=torch.Generator().manual_seed(1)
    )
    reference: torch.Tensor | None = None  # fp32 eager logits of ``ids``, built on first need
    rows, fid = [], []
    with torch.no_grad(), tempfile.TemporaryDirectory() as tmp:
        attention: dict[tuple[str, int, str], float] = {}
        for impl, dtype, quant in specs:
            tdtype = DTYPES[dtype]
            for name in ("hybrid", "all-full"):
                step = random_step(cfg, tdtype)  # the same seed: the same weights for every program
                if name == "all-full":
                    step = with_layout(step, full_types)
                step = spark_program.quantize_step(step, quant)
                nbytes = torch.finfo(tdtype).bits // 8
                for context in contexts:
                    fn, build_s, program_bytes = compiled(step, impl, context, tmp)
                    kv = kv_read_bytes(cfg, step.layer_types, context, nbytes)
                    weights = weight_read_bytes(step)
                    row: dict[str, Any] = {
                        "program": f"{impl}:{dtype}:{quant}",
                        "layout": name,
                        "context": context,
                        "kv_bytes_read": kv,
                        "weight_bytes_read": weights,
                        "floor_ms": 1e3 * (weights + kv) / (bw.best_gbs * 1e9),
                        "build_s": build_s,
                        "program_bytes": program_bytes,
                    }
                    inputs = step_inputs(step.cfg, context, tdtype)
                    row["step_ms"] = time_ms(lambda f=fn, i=inputs: f(*i), steps)
                    key = (name, context, dtype)
                    if key not in attention:
                        attention[key] = time_ms(
                            attention_only(cfg, step.layer_types, context, tdtype), steps
                        )
                    row["attention_ms"] = attention[key]
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
                    if name == "hybrid" and context == contexts[0] and (dtype, quant) != ("fp32", "none"):
                        if reference is None:
                            reference = _logits(
                                cfg, random_step(cfg, torch.float32), ids, context, torch.float32
                            )
                        got = _logits(cfg, fn, ids, context, tdtype)
                        fid.append(
                            {"program": row["program"], "positions": len(ids), **fidelity(reference, got)}
                        )
                    del fn
                del step
                gc.collect()  # a 1.7B program's weights before the next one is built
    return {
        "dims": dims,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "bandwidth_gbs": bw.best_gbs,
        "steps": steps,
        "load_1min_at_end": os.getloadavg()[0],
        "rows": rows,
        "fidelity_vs_fp32": fid,
    }


def _logits(
    cfg: dict[str, Any], fn: Callable, ids: torch.Tensor, context: int, dtype: torch.dtype
) -> torch.Tensor:
    state = DecodeState(cfg, lambda c: fn, context=context, dtype=dtype, buckets=(context,))
    return state.prefill(ids.tolist())


def format_table(result: dict[str, Any]) -> str:
    head = (
        f"Spark-X2.5 {result['dims']} decode step, {result['cpu']} ({result['cores']} cores, "
        f"{result['threads']} threads), read bandwidth {result['bandwidth_gbs']:.1f} GB/s"
    )
    cols = (
        "program",
        "layout",
        "context",
        "step ms",
        "floor ms",
        "x floor",
        "attn ms",
        "weights GB",
        "KV MiB",
        "build s",
    )
    fmt = "{:<20} {:<8} {:>7} {:>9} {:>9} {:>7} {:>8} {:>10} {:>7} {:>8}"
    lines = [head, fmt.format(*cols)]
    for r in result["rows"]:
        lines.append(
            fmt.format(
                r["program"],
                r["layout"],
                r["context"],
                f"{r['step_ms']:.1f}",
                f"{r['floor_ms']:.1f}",
                f"{r['step_ms'] / r['floor_ms']:.2f}",
                f"{r['attention_ms']:.2f}",
                f"{r['weight_bytes_read'] / 1e9:.2f}",
                f"{r['kv_bytes_read'] / 2**20:.0f}",
                f"{r['build_s']:.0f}",
            )
        )
    if result["fidelity_vs_fp32"]:
        lines.append("fidelity against the fp32 eager step (hybrid, greedy positions):")
        for f in result["fidelity_vs_fp32"]:
            lines.append(
                f"  {f['program']:<20} top-1 {f['top1_agreement']:.3f}  KL mean {f['kl_mean']:.2e} "
                f"max {f['kl_max']:.2e}  SNR {f['snr_db']:.1f} dB over {f['positions']} positions"
            )
    return "\n".join(lines)


def cli(args: argparse.Namespace) -> int:
    try:
        parse_programs(args.programs)  # before minutes of set-up
    except ValueError as exc:
        raise SystemExit(f"omni-cpu-fastpath: error: {exc}") from None
    result = run(
        args.dims,
        contexts=tuple(int(c) for c in args.contexts.split(",")),
        programs=args.programs,
        steps=args.steps,
        fidelity_positions=args.fidelity_positions,
        on_row=lambda row: print(json.dumps(row), file=sys.stderr, flush=True),
    )
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
