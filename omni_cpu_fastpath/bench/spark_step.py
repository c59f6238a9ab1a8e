"""``bench spark-step``: ms per decode step of the exportable Spark-X2.5 step, hybrid vs all-full.

Random weights at the released dimensions (built on the meta device, filled in place: no
checkpoint on disk), bf16 by default, one sequence at the last position of a ``context``-slot
full cache (every slot attended). The all-full layout shares the hybrid's weights. ``eager`` runs
``SparkDecodeStep`` itself, ``aoti`` the AOTInductor package of its ``torch.export`` (a compile of
minutes at 1.7B). ``attention`` is attention alone (scores, softmax, values over every layer's
cache), to show what the layouts change. The floor reads the weights (the tied head whole) and
the K/V a step attends, at the measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from omni_cpu_fastpath.bench.floor import cpu_name, measure_bandwidth
from omni_cpu_fastpath.spark.decode_step import FULL, SparkDecodeStep, example_inputs, export_step
from omni_cpu_fastpath.testing.spark_checkpoint import config_dict, tensor_shapes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


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
    impls: tuple[str, ...] = ("eager",),
    dtype: str = "bf16",
    steps: int = 5,
) -> dict[str, Any]:
    cfg = config_dict(dims)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    bw = measure_bandwidth()
    tdtype, nbytes = DTYPES[dtype], torch.finfo(DTYPES[dtype]).bits // 8
    weights = sum(math.prod(s) for s in tensor_shapes(cfg).values()) * nbytes
    hybrid = random_step(cfg, tdtype)
    layouts = {"hybrid": hybrid, "all-full": with_layout(hybrid, [FULL] * cfg["num_hidden_layers"])}
    rows = []
    with torch.no_grad():
        for name, step in layouts.items():
            for context in contexts:
                inputs = step_inputs(step.cfg, context, tdtype)
                kv = kv_read_bytes(cfg, step.layer_types, context, nbytes)
                row: dict[str, Any] = {"layout": name, "context": context, "kv_bytes_read": kv}
                row["floor_ms"] = 1e3 * (weights + kv) / (bw.best_gbs * 1e9)
                attn = attention_only(cfg, step.layer_types, context, tdtype)
                row["attention_ms"] = time_ms(attn, steps)
                if "eager" in impls:
                    row["eager_ms"] = time_ms(lambda s=step, i=inputs: s(*i), steps)
                if "aoti" in impls:
                    with tempfile.TemporaryDirectory() as tmp:
                        t0 = time.perf_counter()
                        path = torch._inductor.aoti_compile_and_package(
                            export_step(step, context), package_path=f"{tmp}/step.pt2"
                        )
                        row["aoti_compile_s"] = time.perf_counter() - t0
                        program = torch._inductor.aoti_load_package(path)
                        row["aoti_ms"] = time_ms(lambda p=program, i=inputs: p(*i), steps)
                rows.append(row)
    return {
        "dims": dims,
        "dtype": dtype,
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "threads": threads,
        "bandwidth_gbs": bw.best_gbs,
        "weight_bytes": weights,
        "steps": steps,
        "load_1min_at_end": os.getloadavg()[0],
        "rows": rows,
    }


def format_table(result: dict[str, Any]) -> str:
    head = (
        f"Spark-X2.5 {result['dims']} {result['dtype']} decode step, "
        f"{result['cpu']} ({result['cores']} cores), "
        f"read bandwidth {result['bandwidth_gbs']:.1f} GB/s, weights {result['weight_bytes'] / 1e9:.2f} GB"
    )
    cols = ("layout", "context", "eager ms", "aoti ms", "attn ms", "floor ms", "KV MiB read")
    lines = [head, "{:<8} {:>7} {:>9} {:>9} {:>9} {:>9} {:>11}".format(*cols)]
    for r in result["rows"]:
        eager, aoti = r.get("eager_ms", float("nan")), r.get("aoti_ms", float("nan"))
        lines.append(
            f"{r['layout']:<8} {r['context']:>7} {eager:>9.1f} {aoti:>9.1f} {r['attention_ms']:>9.2f} "
            f"{r['floor_ms']:>9.1f} {r['kv_bytes_read'] / 2**20:>11.1f}"
        )
    return "\n".join(lines)


def cli(args: argparse.Namespace) -> int:
    result = run(
        args.dims,
        contexts=tuple(int(c) for c in args.contexts.split(",")),
        impls=tuple(args.impls.split(",")),
        dtype=args.dtype,
        steps=args.steps,
    )
    print(json.dumps(result, indent=1) if args.json else format_table(result))
    return 0
