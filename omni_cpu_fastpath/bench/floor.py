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
from typing import Any

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


# --- floors of the served stages, from a checkpoint's config ------------------------------------

BYTES_PER_DTYPE = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0}


def _decoder_layer_params(hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int) -> int:
    """Weights of one Qwen3 decoder layer: q/k/v/o, q/k norms, gated MLP, two RMSNorms."""
    attn = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    return attn + 2 * head_dim + 3 * hidden * mlp + 2 * hidden


def talker_params_per_step(config: dict[str, Any]) -> int:
    """Weights a talker decode step reads (``config.json``): every layer, the final norm, the
    codec head. Embeddings are gathered rows; the text projection runs once per request."""
    t = config["talker_config"]
    hidden = int(t["hidden_size"])
    layer = _decoder_layer_params(
        hidden,
        int(t["num_attention_heads"]),
        int(t["num_key_value_heads"]),
        int(t.get("head_dim") or hidden // int(t["num_attention_heads"])),
        int(t["intermediate_size"]),
    )
    return int(t["num_hidden_layers"]) * layer + hidden + int(t["vocab_size"]) * hidden


def talker_prefill_flops(config: dict[str, Any], tokens: int) -> float:
    """FLOPs of a talker prefill over ``tokens`` prompt tokens (``config.json``): every decoder
    weight once per token, the codec head once (only the last position's logits are taken).
    Attention scores are left out, so this is a lower bound."""
    t = config["talker_config"]
    head = int(t["vocab_size"]) * int(t["hidden_size"])
    return 2.0 * ((talker_params_per_step(config) - head) * tokens + head)


def predictor_params_per_frame(config: dict[str, Any]) -> int:
    """Weights the code predictor reads per frame (``config.json``), as :func:`params_per_frame`
    counts them on a module: each of the 15 sub-steps reads every layer, one codebook head and,
    where the talker is wider than the predictor, the projection between them."""
    t = config["talker_config"]
    cp = t["code_predictor_config"]
    hidden = int(cp["hidden_size"])
    layer = _decoder_layer_params(
        hidden,
        int(cp["num_attention_heads"]),
        int(cp["num_key_value_heads"]),
        int(cp.get("head_dim") or hidden // int(cp["num_attention_heads"])),
        int(cp["intermediate_size"]),
    )
    talker_hidden = int(t["hidden_size"])
    proj = hidden * talker_hidden + hidden if talker_hidden != hidden else 0
    heads = int(cp.get("num_code_groups") or t["num_code_groups"]) - 1
    return heads * (int(cp["num_hidden_layers"]) * layer + int(cp["vocab_size"]) * hidden + proj)


def code2wav_flops(decoder: dict[str, Any], frames: int = 1) -> float:
    """FLOPs (2 per multiply-add) of the codec decoder's convolutions and linears for ``frames``
    12.5 Hz frames, from ``speech_tokenizer/config.json``'s ``decoder_config``.

    The layout is vllm-omni's ``Qwen3TTSTokenizerV2Decoder``: quantizer output projections, a
    causal pre-conv, a sliding-window transformer, two transposed-conv + ConvNeXt upsamplers, a
    conv, one transposed conv and three dilated residual units per upsample rate, a last conv.
    Attention scores and elementwise activations are left out: under 1 % at released sizes.
    """
    cb, latent, dd = int(decoder["codebook_dim"]), int(decoder["latent_dim"]), int(decoder["decoder_dim"])
    h, mlp = int(decoder["hidden_size"]), int(decoder["intermediate_size"])
    heads, kv, hd = (
        int(decoder["num_attention_heads"]),
        int(decoder["num_key_value_heads"]),
        int(decoder["head_dim"]),
    )
    t = frames
    macs = 2 * (cb // 2) * cb * t  # semantic and acoustic output projections
    macs += cb * latent * 3 * t  # pre_conv, kernel 3
    layer = h * heads * hd + 2 * h * kv * hd + heads * hd * h + 3 * h * mlp
    macs += (latent * h + int(decoder["num_hidden_layers"]) * layer + h * latent) * t
    for factor in decoder["upsampling_ratios"]:
        macs += latent * latent * factor * t  # transposed conv, kernel = stride = factor
        t *= factor
        macs += (latent * 7 + 2 * latent * 4 * latent) * t  # ConvNeXt: depthwise 7, two pointwise
    macs += latent * dd * 7 * t
    rates = list(decoder["upsample_rates"])
    for i, rate in enumerate(rates):
        cin, cout = dd // 2**i, dd // 2 ** (i + 1)
        macs += cin * cout * 2 * rate * t  # transposed conv, kernel 2 * rate
        t *= rate
        macs += 3 * (cout * cout * 7 + cout * cout) * t  # residual units: kernel 7, then 1
    macs += (dd // 2 ** len(rates)) * 7 * t
    return 2.0 * macs


@dataclass(frozen=True)
class Peak:
    best_gflops: float
    kernel: str
    per_kernel_gflops: dict[str, float]


def measure_peak(dtype: torch.dtype, repeats: int = 5) -> Peak:
    """GFLOP/s of this process (current torch threads) at ``dtype``: a square matmul and a
    codec-like conv1d (384 channels, kernel 7, 640 steps), the best of each; the peak is the
    better one."""
    results: dict[str, float] = {}
    with torch.inference_mode():
        a, b = torch.rand(1024, 1024, dtype=dtype), torch.rand(1024, 1024, dtype=dtype)
        results["matmul_1024"] = 2 * 1024**3 / _best_time(lambda: a @ b, repeats) / 1e9
        x, w = torch.rand(1, 384, 646, dtype=dtype), torch.rand(384, 384, 7, dtype=dtype)
        flops = 2 * 384 * 384 * 7 * 640
        results["conv1d_384x7"] = flops / _best_time(lambda: F.conv1d(x, w), repeats) / 1e9
    kernel = max(results, key=results.__getitem__)
    return Peak(best_gflops=results[kernel], kernel=kernel, per_kernel_gflops=results)
