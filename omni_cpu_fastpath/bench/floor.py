"""The code predictor's memory-bandwidth floor, measured in-process.

Batch-1 decoding of the predictor is bound by reading its weights: each of the 15 sub-steps of a
frame reads every layer once plus one codebook head. ``floor_ms = bytes read per frame / read
bandwidth``. The bandwidth is the best of several read kernels (a sum over fp32 / bf16 / int8
buffers, a copy, a matrix-vector product) on a buffer far larger than the caches, with the
current torch thread count: a single probe under-reads on some machines, and the floor is only
as good as the probe.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

BYTES_PER_PARAM = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0}


@dataclass(frozen=True)
class Bandwidth:
    best_gbs: float
    kernel: str  # which probe read fastest
    per_kernel_gbs: dict[str, float]


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: page in, thread pool up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _sum_fp32(nbytes: int, repeats: int) -> float:
    buf = torch.rand(nbytes // 4)
    return nbytes / _best_time(lambda: buf.sum(), repeats) / 1e9


def _copy_fp32(nbytes: int, repeats: int) -> float:
    # A copy reads and writes: count only the bytes read, like the other probes.
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    return nbytes / _best_time(lambda: dst.copy_(src), repeats) / 1e9


def _sum_bf16(nbytes: int, repeats: int) -> float:
    buf = torch.rand(nbytes // 2, dtype=torch.bfloat16)
    return nbytes / _best_time(lambda: buf.sum(dtype=torch.float32), repeats) / 1e9


def _sum_int8(nbytes: int, repeats: int) -> float:
    buf = torch.randint(-127, 127, (nbytes,), dtype=torch.int8)
    return nbytes / _best_time(lambda: buf.sum(dtype=torch.int32), repeats) / 1e9


def _matvec_fp32(nbytes: int, repeats: int) -> float:
    cols = 4096
    w = torch.rand(nbytes // 4 // cols, cols)
    x = torch.rand(1, cols)
    return w.numel() * 4 / _best_time(lambda: F.linear(x, w), repeats) / 1e9


_PROBES: dict[str, Callable[[int, int], float]] = {
    "sum_fp32": _sum_fp32,
    "copy_fp32": _copy_fp32,
    "sum_bf16": _sum_bf16,
    "sum_int8": _sum_int8,
    "matvec_fp32": _matvec_fp32,
}


def measure_bandwidth(mbytes: int = 256, repeats: int = 5) -> Bandwidth:
    """Read bandwidth (GB/s, 1e9 bytes) of this process with its current torch threads."""
    if mbytes < 16:
        raise ValueError(f"mbytes must be >= 16 (the buffer must not fit in cache), got {mbytes}")
    nbytes = mbytes * 2**20
    results: dict[str, float] = {}
    with torch.inference_mode():
        for name, probe in _PROBES.items():
            # Each probe allocates its own buffer, freed before the next one.
            results[name] = probe(nbytes, repeats)
    kernel = max(results, key=results.__getitem__)
    return Bandwidth(best_gbs=results[kernel], kernel=kernel, per_kernel_gbs=results)


def params_per_frame(predictor: nn.Module) -> int:
    """Weights read per frame: 15 sub-steps x (every layer + one codebook head [+ projection]).

    Works on vllm-omni's predictor and on ``CachedCodePredictor`` (same ``model`` / ``lm_head``).
    Norm weights are counted; embeddings are gathered rows, not read whole.
    """
    layers = sum(p.numel() for p in predictor.model.layers.parameters())
    heads = predictor.lm_head
    head = heads[0].weight.numel()
    proj = predictor.small_to_mtp_projection
    proj_params = sum(p.numel() for p in proj.parameters()) if isinstance(proj, nn.Linear) else 0
    return len(heads) * (layers + head + proj_params)


def floor_ms(params: int, fmt: str, bandwidth_gbs: float) -> float:
    """Milliseconds to read ``params`` weights of format ``fmt`` (fp32/bf16/int8) once."""
    if fmt not in BYTES_PER_PARAM:
        raise ValueError(f"fmt={fmt!r} is not valid; accepted values: {', '.join(BYTES_PER_PARAM)}")
    if bandwidth_gbs <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth_gbs}")
    return params * BYTES_PER_PARAM[fmt] / (bandwidth_gbs * 1e9) * 1e3


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), to print beside every figure: machines differ."""
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
