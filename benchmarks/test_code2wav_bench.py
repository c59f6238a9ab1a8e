"""pytest-benchmark: the code2wav decoder streaming a request as the stage does, stock vs ours.

The stage's async-chunk road: one frame first, then 25-frame chunks, each decoded with the
request's state (the transformer re-runs its retained window; the stock vocoder 12 frames of left
context, the streaming one (VLLM_OMNI_CODE2WAV_STREAMING) none, from the convolution tails it kept).
Rows: stock, fast (VLLM_OMNI_CODE2WAV_FAST), streaming, streaming with fast; and in bfloat16
(VLLM_OMNI_CODE2WAV_DTYPE): stock (vllm-omni's own decoder at its GPU deploy dtype) and streaming
with fast, whose SNR against the float32 stock audio is asserted within 3 dB of stock bf16's (bf16 is
fast only where the CPU multiplies it natively: AVX512-BF16 or AMX). Random codec weights
at ``OMNI_BENCH_DIMS`` (default ``0.6b``: the released codec; ``tiny`` for a smoke run), fp32,
torch threads capped at 2 (the stage runs 1 on a 2-core machine: set ``OMP_NUM_THREADS=1``).
Speed is reported, never asserted: each row's ``extra_info`` holds its ms per 80 ms frame, the
convolution and linear FLOPs per frame, the frames the vocoder ran per frame returned, the CPU, the
load average, its speed-up against the stock row of the same session and its SNR against stock's
audio (asserted >= 60 dB in float32). Wall-clock rows mean something only on an idle machine; on a shared one
add ``--benchmark-timer time.process_time``.
"""

from __future__ import annotations

import copy
import math
import os
from typing import Any

import pytest
import torch
from conftest import DIMS

CHUNKS = [1, 25, 25, 25, 25]
FRAMES = sum(CHUNKS)


def _decoder(dims: str) -> torch.nn.Module:
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
        configuration_qwen3_tts_tokenizer_v2 as st_config,
    )
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
        modeling_qwen3_tts_tokenizer_v2 as st_model,
    )

    from omni_cpu_fastpath.testing.checkpoint import speech_tokenizer_config

    cfg = speech_tokenizer_config(dims)
    config = st_config.Qwen3TTSTokenizerV2Config(
        **{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        decoder = st_model.Qwen3TTSTokenizerV2Decoder._from_config(config.decoder_config).eval()
        with torch.no_grad():
            for name, p in decoder.named_parameters():
                if name.endswith("embedding_sum"):  # module init leaves the codebooks at zero
                    p.copy_(torch.randn_like(p))
                elif name.endswith((".alpha", ".beta")):
                    p.copy_(0.3 * torch.randn_like(p))
    decoder.precompute_snake_caches()
    decoder._initial_codec_chunk_frames = CHUNKS[0]
    decoder._incremental_chunk_frames = CHUNKS[1]
    return decoder


def stream(decoder: torch.nn.Module, codes: torch.Tensor) -> torch.Tensor:
    state: dict[str, Any] = {"prefix_frames": 0}
    out, pos = [], 0
    with torch.inference_mode():
        for n in CHUNKS:
            out.append(decoder.batched_chunked_decode(codes[:, :, pos : pos + n], [n], caches=[state])[0])
            pos += n
    return torch.cat(out, dim=-1)


def count_work(decoder: torch.nn.Module, codes: torch.Tensor) -> tuple[float, float]:
    """(convolution + linear FLOPs per frame, vocoder frames run per frame returned) of one stream."""
    from torch import nn

    flops = [0.0]
    vocoder_frames = [0]

    def conv(m: nn.Conv1d, args: tuple[Any, ...], out: torch.Tensor) -> None:
        flops[0] += 2.0 * out.numel() * (m.in_channels // m.groups) * m.kernel_size[0]

    def tconv(m: nn.ConvTranspose1d, args: tuple[Any, ...], out: torch.Tensor) -> None:
        flops[0] += 2.0 * args[0].numel() * m.out_channels * m.kernel_size[0]

    def linear(m: nn.Linear, args: tuple[Any, ...], out: torch.Tensor) -> None:
        flops[0] += 2.0 * out.numel() * m.in_features

    def frames(m: nn.Module, args: tuple[Any, ...]) -> None:
        vocoder_frames[0] += int(args[0].shape[0]) * int(args[0].shape[-1])

    hooks = [decoder.upsample[0][0].register_forward_pre_hook(frames)]
    for m in decoder.modules():
        if isinstance(m, nn.Conv1d):
            hooks.append(m.register_forward_hook(conv))
        elif isinstance(m, nn.ConvTranspose1d):
            hooks.append(m.register_forward_hook(tconv))
        elif isinstance(m, nn.Linear):
            hooks.append(m.register_forward_hook(linear))
    try:
        stream(decoder, codes)
    finally:
        for h in hooks:
            h.remove()
    return flops[0] / FRAMES, vocoder_frames[0] / FRAMES


@pytest.fixture(scope="module")
def code2wav_setup() -> dict[str, Any]:
    from omni_cpu_fastpath.bench.floor import cpu_name
    from omni_cpu_fastpath.qwen3_tts.code2wav import make_fast_decoder

    torch.set_num_threads(min(2, torch.get_num_threads()))
    stock = _decoder(DIMS)
    fast = copy.deepcopy(stock)
    make_fast_decoder(fast)
    codes = torch.randint(0, 2048, (1, 16, FRAMES), generator=torch.Generator().manual_seed(0))
    stream_decoder, stream_fast = _streaming(stock, fast=False), _streaming(stock, fast=True)
    work = {name: count_work(d, codes) for name, d in (("stock", stock), ("stream", stream_decoder))}
    return {
        "stock": stock,
        "fast": fast,
        "stream": stream_decoder,
        "stream_fast": stream_fast,
        "stock_bf16": _in_bf16(copy.deepcopy(stock)),
        "stream_fast_bf16": _in_bf16(_streaming(stock, fast=True, bf16=True)),
        "codes": codes,
        "want": stream(stock, codes),
        "work": work,
        "cpu": cpu_name(),
        "session": {},
    }


def _in_bf16(decoder: torch.nn.Module) -> torch.nn.Module:
    """``decoder`` cast as vllm-omni's stage casts it to its dtype (``.to``, then the SnakeBeta caches)."""
    decoder.to(torch.bfloat16)
    decoder.precompute_snake_caches()
    return decoder


def _streaming(stock: torch.nn.Module, fast: bool, bf16: bool = False) -> torch.nn.Module:
    """The streaming decoder with ``stock``'s weights (and the fast modules when ``fast``), cast to
    bfloat16 (when ``bf16``) before the fast modules pack their weights, as a bfloat16 stage loads."""
    from omni_cpu_fastpath.qwen3_tts.code2wav import make_fast_decoder
    from omni_cpu_fastpath.qwen3_tts.code2wav_stream import StreamingCodecDecoder

    decoder = StreamingCodecDecoder._from_config(stock.config).eval()
    decoder.load_state_dict(stock.state_dict())
    decoder.precompute_snake_caches()
    decoder._initial_codec_chunk_frames = CHUNKS[0]
    decoder._incremental_chunk_frames = CHUNKS[1]
    if bf16:
        _in_bf16(decoder)
    if fast:
        make_fast_decoder(decoder)
    decoder.enable_streaming()
    return decoder


def snr_db(want: torch.Tensor, got: torch.Tensor) -> float:
    noise = float((got.double() - want.double()).pow(2).sum())
    return float("inf") if noise == 0 else 10.0 * math.log10(float(want.double().pow(2).sum()) / noise)


def _check_and_record(benchmark: Any, setup: dict[str, Any], name: str, wav: torch.Tensor) -> None:
    assert wav.shape == (1, FRAMES * 1920)
    snr = snr_db(setup["want"], wav)
    if name.endswith("_bf16"):
        # bf16's bound: no further from float32 stock than vllm-omni's own bf16 decode (3 dB).
        reference = snr_db(setup["want"], stream(setup["stock_bf16"], setup["codes"]))
        assert snr >= reference - 3.0, f"{name}: {snr:.1f} dB against stock, stock bf16 {reference:.1f} dB"
    elif name != "stock":
        assert snr >= 60.0, f"{name}: {snr:.1f} dB against stock"
    _record(benchmark, setup, name)
    benchmark.extra_info["snr_db_vs_stock"] = snr


def _record(benchmark: Any, setup: dict[str, Any], name: str) -> None:
    stats = getattr(benchmark, "stats", None)
    if stats is None:  # --benchmark-disable: nothing was timed
        return
    flops, decoded_per_frame = setup["work"]["stream" if name.startswith("stream") else "stock"]
    extra = {"dtype": "bfloat16" if name.endswith("_bf16") else "float32"}
    ms = stats.stats.min * 1e3 / FRAMES  # min: the machine is shared
    setup["session"][name] = ms
    benchmark.extra_info.update(
        {
            "dims": DIMS,
            "ms_per_frame": ms,
            "frame_ms": 80.0,
            "real_time_factor": ms / 80.0,
            "flops_per_frame": flops,
            "vocoder_frames_per_frame": decoded_per_frame,
            "threads": torch.get_num_threads(),
            "load_1min": os.getloadavg()[0],
            "cpu": setup["cpu"],
            **extra,
        }
    )
    if "stock" in setup["session"] and name != "stock":
        benchmark.extra_info["speedup_vs_stock"] = setup["session"]["stock"] / ms


@pytest.mark.parametrize("name", ["stock", "fast", "stream", "stream_fast", "stock_bf16", "stream_fast_bf16"])
def test_stream(benchmark: Any, code2wav_setup: dict[str, Any], name: str) -> None:
    wav = benchmark.pedantic(stream, args=(code2wav_setup[name], code2wav_setup["codes"]), rounds=3)
    _check_and_record(benchmark, code2wav_setup, name, wav)
