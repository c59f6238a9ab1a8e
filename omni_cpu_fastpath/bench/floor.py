"""Floors: the least time each stage of a frame can take on this machine, measured in-process.

Batch-1 decoding of the talker and the code predictor is bound by reading their weights (each of
the predictor's 15 sub-steps of a frame reads every layer once plus one codebook head):
``floor_ms = bytes read per frame / read bandwidth``. code2wav's floor is its FLOPs per frame over
the measured matmul/convolution peak of its dtype. The bandwidth is the best of several read
kernels (a sum over fp32 / bf16 / int8 buffers, a copy, a matrix-vector product) on a buffer far
larger than the caches, with the current torch thread count: a single probe under-reads on some
machines, and the floor is only as good as the probe.

``omni-cpu-fastpath bench floors`` (:func:`cli`) prints them for the checkpoint dimensions without
starting a server or importing vLLM, so it runs on any machine with torch.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import FRAME_MS

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


def best_bandwidth(probes: list[Bandwidth]) -> Bandwidth:
    """The best read of several probes taken at different times (each kernel's best across them):
    a shared host's bandwidth moves within minutes, and a floor is the least time, so it takes the
    fastest read seen."""
    if not probes:
        raise ValueError("best_bandwidth needs at least one probe")
    per_kernel: dict[str, float] = {}
    for p in probes:
        for name, gbs in p.per_kernel_gbs.items():
            per_kernel[name] = max(per_kernel.get(name, 0.0), gbs)
    kernel = max(per_kernel, key=per_kernel.__getitem__)
    return Bandwidth(best_gbs=per_kernel[kernel], kernel=kernel, per_kernel_gbs=per_kernel)


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


def talker_norm_fed_prefill_flops(config: dict[str, Any], tokens: int) -> float:
    """The part of :func:`talker_prefill_flops` in the linears behind an RMSNorm (``qkv_proj``,
    ``gate_up_proj``): what talker int8 ``w8-group-a8`` multiplies with int8 activations."""
    t = config["talker_config"]
    hidden, heads = int(t["hidden_size"]), int(t["num_attention_heads"])
    head_dim = int(t.get("head_dim") or hidden // heads)
    qkv = hidden * (heads + 2 * int(t["num_key_value_heads"])) * head_dim
    gate_up = 2 * hidden * int(t["intermediate_size"])
    return 2.0 * int(t["num_hidden_layers"]) * (qkv + gate_up) * tokens


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


def stage_floors_ms(
    config: dict[str, Any],
    decoder: dict[str, Any],
    formats: Mapping[str, str],
    bandwidth_gbs: float,
    peak_gflops: Mapping[str, float],
    rows: int = 1,
) -> dict[str, float]:
    """Floor ms per frame of the talker (one decode step), the predictor and code2wav.

    ``formats`` maps each stage to a dtype name (:data:`BYTES_PER_DTYPE`): the weights the talker
    and predictor read, the dtype code2wav computes in (its peak taken from ``peak_gflops``).
    ``rows`` sequences share each weight read, so the weight floors per frame are 1/rows of a step's.
    """

    def read_ms(params: int, dtype: str) -> float:
        return params * BYTES_PER_DTYPE[dtype] / (bandwidth_gbs * 1e9) * 1e3 / rows

    return {
        "talker": read_ms(talker_params_per_step(config), formats["talker"]),
        "predictor": read_ms(predictor_params_per_frame(config), formats["predictor"]),
        "code2wav": code2wav_flops(decoder) / (peak_gflops[formats["code2wav"]] * 1e9) * 1e3,
    }


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


def measure_int8_peak(repeats: int = 5) -> Peak | None:
    """GOP/s of the int8 GEMM that talker int8 ``w8-group-a8`` prefills with (oneDNN, seven-bit
    activations: ``int8_prefill.py``) on a square 1024 product; None where it does not run here."""
    from omni_cpu_fastpath.qwen3_tts.quant import int8_prefill

    if int8_prefill.status() is not None:
        return None
    g = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (1024, 1024), generator=g, dtype=torch.int8)
    x = torch.randint(0, 2 * int8_prefill.LEVELS + 1, (1024, 1024), generator=g).to(torch.uint8)
    packed = int8_prefill.PackedWeight(w, torch.ones(1024))
    with torch.inference_mode():
        seconds = _best_time(lambda: packed.multiply(x), repeats)
    gops = 2 * 1024**3 / seconds / 1e9
    return Peak(best_gflops=gops, kernel="qlinear_1024", per_kernel_gflops={"qlinear_1024": gops})


# --- bench floors --------------------------------------------------------------------------------


def format_sets(environ: Mapping[str, str] | None = None) -> dict[str, dict[str, str]]:
    """The stages' formats the floors are given for: ``stock`` (vllm-omni's own on CPU: the bf16
    talker and predictor, the fp32 codec), ``flags`` (what ``serve`` runs under these
    ``VLLM_OMNI_*`` flags) and ``fewest-bytes`` (the int8 talker and predictor, the bf16 codec)."""
    from omni_cpu_fastpath import envs
    from omni_cpu_fastpath.serving.stage_settings import code2wav_dtype, talker_int8_scheme

    stock = {"talker": "bfloat16", "predictor": "bfloat16", "code2wav": "float32"}
    if envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        flags = {
            "talker": "bfloat16" if talker_int8_scheme(environ) == "off" else "int8",
            "predictor": "bfloat16" if envs.get("VLLM_OMNI_PREDICTOR_INT8", environ) == "off" else "int8",
            "code2wav": code2wav_dtype(environ),
        }
    else:
        flags = dict(stock)
    return {
        "stock": stock,
        "flags": flags,
        "fewest-bytes": {"talker": "int8", "predictor": "int8", "code2wav": "bfloat16"},
    }


def fast_path_off_reason(environ: Mapping[str, str] | None = None) -> str | None:
    """Why ``serve`` would run the stock stages under these flags (so the ``flags`` set is
    ``stock``'s), or None where the fast path is on."""
    from omni_cpu_fastpath import envs

    if envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        return None
    value = envs.raw("VLLM_OMNI_CPU_FASTPATH", environ)
    if value.strip().lower() == "auto":
        return "VLLM_OMNI_CPU_FASTPATH=auto is off where torch sees an accelerator"
    return f"VLLM_OMNI_CPU_FASTPATH={value}"


def floors_report(
    dims: list[str],
    rows: int,
    bandwidth: Bandwidth,
    peaks: Mapping[str, Peak],
    environ: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Each stage's floor and ``rtf_floor`` (their sum over the 80 ms of a frame) for every dims
    and format set, from the probes' results."""
    import torch

    from omni_cpu_fastpath.testing.checkpoint import build_config, speech_tokenizer_config

    peak_gflops = {name: p.best_gflops for name, p in peaks.items()}
    sets = format_sets(environ)
    floors = []
    for d in dims:
        config, decoder = build_config(d), speech_tokenizer_config(d)["decoder_config"]
        for name, formats in sets.items():
            ms = stage_floors_ms(config, decoder, formats, bandwidth.best_gbs, peak_gflops, rows)
            floors.append(
                {
                    "dims": d,
                    "set": name,
                    "formats": formats,
                    "floors_ms": ms,
                    "rtf_floor": sum(ms.values()) / FRAME_MS,
                }
            )
    return {
        "cpu": cpu_name(),
        "torch_threads": torch.get_num_threads(),
        "fast_path_off": fast_path_off_reason(environ),
        "rows": rows,
        "bandwidth_gbs": bandwidth.best_gbs,
        "bandwidth_kernel": bandwidth.kernel,
        "peak_gflops": peak_gflops,
        "floors": floors,
    }


def format_floors(report: dict[str, Any]) -> str:
    peaks = ", ".join(f"{n} {g:.0f}" for n, g in report["peak_gflops"].items())
    out = [
        f"{report['cpu']}; {report['torch_threads']} torch threads; read bandwidth "
        f"{report['bandwidth_gbs']:.1f} GB/s ({report['bandwidth_kernel']}); peaks (GFLOP/s) {peaks}",
        f"floors, ms per frame with {report['rows']} row(s) a step (a frame lasts {FRAME_MS:.0f} ms):",
        f"  {'dims':<6} {'formats: talker / predictor / code2wav':<53} {'talker':>8} {'predictor':>10} "
        f"{'code2wav':>9} {'rtf_floor':>10}",
    ]
    off = report.get("fast_path_off")
    for f in report["floors"]:
        fm, ms = f["formats"], f["floors_ms"]
        name = f"{f['set']}, fast path off" if off and f["set"] == "flags" else f["set"]
        label = f"{name} ({fm['talker']} / {fm['predictor']} / {fm['code2wav']})"
        out.append(
            f"  {f['dims']:<6} {label:<53} {ms['talker']:>8.2f} {ms['predictor']:>10.2f} "
            f"{ms['code2wav']:>9.2f} {f['rtf_floor']:>10.3f}"
        )
    if off:
        out.append(f"flags: the fast path is off ({off}), so serve runs the stock formats")
    return "\n".join(out)


def cli(args: argparse.Namespace) -> int:
    from omni_cpu_fastpath.testing.checkpoint import DIMS

    dims = [d.strip() for d in args.dims.split(",") if d.strip()]
    bad = [d for d in dims if d not in DIMS]
    if not dims or bad:
        raise SystemExit(
            f"omni-cpu-fastpath bench floors: --dims {args.dims!r} is not valid; accepted values: "
            f"a comma-separated list of {', '.join(DIMS)}"
        )
    report = floors_report(
        dims,
        args.rows,
        measure_bandwidth(),
        {name: measure_peak(getattr(torch, name)) for name in ("float32", "bfloat16")},
    )
    print(json.dumps(report, indent=1) if args.json else format_floors(report))
    return 0
