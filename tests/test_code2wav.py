"""``FastQwen3TTSCode2Wav``: the fast decoder against vllm-omni's own, its flag, its registration, its timers.

The reference is vllm-omni's stock ``Qwen3TTSCode2Wav`` built directly (not through the registry)
on the tiny random checkpoint; SNR is computed here in float64 numpy, independently of the code
under test.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.serving import plugins

FRAME = 1920  # samples per codec frame (24 kHz, 12.5 Hz)


def snr_db(reference: torch.Tensor, candidate: torch.Tensor) -> float:
    ref = reference.detach().double().cpu().numpy().reshape(-1)
    cand = candidate.detach().double().cpu().numpy().reshape(-1)
    assert ref.shape == cand.shape
    noise = float(np.sum((ref - cand) ** 2))
    signal = float(np.sum(ref**2))
    assert signal > 0
    return float("inf") if noise == 0 else 10.0 * np.log10(signal / noise)


def _build(model_dir: Path, cls: Any, dtype: str = "float32") -> Any:
    """The stage built as a worker builds it (the platform hook sets its dtype from
    VLLM_OMNI_CODE2WAV_DTYPE, here ``dtype``; the environment is restored after)."""
    from omni_cpu_fastpath.testing.stock import _build_stock_stage

    saved = os.environ.get("VLLM_OMNI_CODE2WAV_DTYPE")
    try:
        os.environ["VLLM_OMNI_CODE2WAV_DTYPE"] = dtype
        model, _ = _build_stock_stage(
            model_dir, cls, "code2wav", "generation", torch.float32, "auto", arch="Qwen3TTSCode2Wav"
        )
    finally:
        if saved is None:
            os.environ.pop("VLLM_OMNI_CODE2WAV_DTYPE", None)
        else:
            os.environ["VLLM_OMNI_CODE2WAV_DTYPE"] = saved
    return model


def _build_with(model_dir: Path, fast: str, streaming: str, dtype: str = "float32") -> Any:
    """``FastQwen3TTSCode2Wav`` built with these flags (the environment is restored after);
    ``dtype``: VLLM_OMNI_CODE2WAV_DTYPE."""
    from omni_cpu_fastpath.qwen3_tts.code2wav import FastQwen3TTSCode2Wav

    names = ("VLLM_OMNI_CODE2WAV_FAST", "VLLM_OMNI_CODE2WAV_STREAMING")
    saved = {name: os.environ.get(name) for name in names}
    try:
        os.environ.update(zip(names, (fast, streaming), strict=True))
        return _build(model_dir, FastQwen3TTSCode2Wav, dtype)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@pytest.fixture(scope="module")
def stages(tiny_model_dir: Path) -> dict[str, Any]:
    """The stock stage, at float32 and at bfloat16 (vllm-omni's GPU deploy dtype); ours with the
    fast decoder, with no flag, streaming, and in bfloat16 (alone, and fast and streaming)."""
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    stock = _build(tiny_model_dir, Qwen3TTSCode2Wav)
    built = {
        "stock": stock,
        "stock_bf16": _build(tiny_model_dir, Qwen3TTSCode2Wav, "bfloat16"),
        "fast": _build_with(tiny_model_dir, "1", "0"),
        "off": _build_with(tiny_model_dir, "0", "0"),
        "stream": _build_with(tiny_model_dir, "0", "1"),
        "bf16": _build_with(tiny_model_dir, "0", "0", "bfloat16"),
        "bf16_fast_stream": _build_with(tiny_model_dir, "1", "1", "bfloat16"),
    }
    # The random checkpoint leaves every SnakeBeta at alpha = beta = 0; give them distinct values
    # (the same in every stage) so the activations are exercised.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in stock.decoder.named_parameters():
            if name.endswith((".alpha", ".beta")):
                values = 0.3 * torch.randn(p.shape, generator=g)
                for model in built.values():
                    dict(model.decoder.named_parameters())[name].copy_(values)
    for model in built.values():
        model.decoder.precompute_snake_caches()
    return built


def _codes(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (1, 16, frames), generator=torch.Generator().manual_seed(seed))


def _stream(decoder: Any, codes: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    """A stateful (async-chunk) decode as the stage runs it: one request, chunk after chunk."""
    decoder._initial_codec_chunk_frames = chunks[0]
    decoder._incremental_chunk_frames = max(chunks[1:], default=chunks[0])
    state: dict[str, Any] = {"prefix_frames": 0}
    out, pos = [], 0
    with torch.inference_mode():
        for n in chunks:
            out.append(decoder.batched_chunked_decode(codes[:, :, pos : pos + n], [n], caches=[state])[0])
            pos += n
    return torch.cat(out, dim=-1)


def test_fast_stage_serves_the_fast_modules(stages: dict[str, Any]) -> None:
    from vllm_omni.model_executor.models.common.snake_activation import SnakeBeta
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        EuclideanCodebook,
        Qwen3TTSTokenizerV2CausalConvNet,
        Qwen3TTSTokenizerV2ConvNeXtBlock,
    )

    from omni_cpu_fastpath.qwen3_tts.code2wav import (
        CachedCodebook,
        GemmCausalTransConv,
        GemmConv1d,
        InplaceSnakeBeta,
        ShortInputLinear,
    )

    fast, off = stages["fast"], stages["off"]
    assert fast.served.startswith("fast decoder (") and "GemmCausalTransConv" in fast.served
    assert "GemmConv1d" in fast.served
    assert "ShortInputLinear" in fast.served and "CachedCodebook" in fast.served
    assert any(isinstance(m, InplaceSnakeBeta) for m in fast.decoder.modules())
    assert any(isinstance(m, GemmCausalTransConv) for m in fast.decoder.modules())
    # Every ungrouped causal convolution; the ConvNeXt blocks' depthwise ones stay stock.
    convs = [m.conv for m in fast.decoder.modules() if type(m) is Qwen3TTSTokenizerV2CausalConvNet]
    assert {type(m).__name__ for m in convs if m.groups == 1} == {"GemmConv1d"}
    assert {type(m).__name__ for m in convs if m.groups > 1} == {"Conv1d"}
    # The ConvNeXt blocks' pointwise linears, and every codebook of the quantizer.
    blocks = [m for m in fast.decoder.modules() if type(m) is Qwen3TTSTokenizerV2ConvNeXtBlock]
    assert blocks and all(type(b.pwconv1) is type(b.pwconv2) is ShortInputLinear for b in blocks)
    codebooks = [m for m in fast.decoder.modules() if isinstance(m, EuclideanCodebook)]
    assert len(codebooks) == 16 and all(type(m) is CachedCodebook for m in codebooks)
    assert off.served == "stock decoder (VLLM_OMNI_CODE2WAV_FAST off)"
    kinds = (InplaceSnakeBeta, GemmCausalTransConv, GemmConv1d, ShortInputLinear, CachedCodebook)
    assert not any(isinstance(m, kinds) for m in off.decoder.modules())
    assert any(type(m) is SnakeBeta for m in off.decoder.modules())
    # Parameter names (what loading goes by) are the stock ones, streaming or not.
    names = {n for n, _ in stages["stock"].decoder.named_parameters()}
    for name in ("fast", "stream"):
        assert {n for n, _ in stages[name].decoder.named_parameters()} == names, name


def test_inplace_snake_is_bit_identical() -> None:
    from vllm_omni.model_executor.models.common.snake_activation import SnakeBeta

    from omni_cpu_fastpath.qwen3_tts.code2wav import InplaceSnakeBeta

    g = torch.Generator().manual_seed(0)
    stock = SnakeBeta(24)
    with torch.no_grad():
        stock.alpha.copy_(torch.randn(24, generator=g))
        stock.beta.copy_(torch.randn(24, generator=g))
    fast = InplaceSnakeBeta.from_stock(stock)
    x = 3 * torch.randn(2, 24, 1001, generator=g)
    with torch.inference_mode():
        assert torch.equal(fast(x), stock(x))


def test_gemm_transposed_conv_matches_onednn() -> None:
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        Qwen3TTSTokenizerV2CausalTransConvNet as Stock,
    )

    from omni_cpu_fastpath.qwen3_tts.code2wav import SHORT_INPUT_COLUMNS, GemmCausalTransConv

    torch.manual_seed(0)
    long = SHORT_INPUT_COLUMNS + 7  # the per-phase products; shorter inputs take one product
    for c_in, c_out, kernel, stride, length in (
        (16, 8, 10, 5, 37),
        (12, 12, 2, 2, 1),
        (6, 3, 6, 3, 4),
        (16, 8, 10, 5, long),
        (6, 3, 6, 3, long),
    ):
        stock = Stock(c_in, c_out, kernel, stride).eval()
        fast = GemmCausalTransConv(stock)
        x = torch.randn(2, c_in, length)
        with torch.inference_mode():
            want, got = stock(x), fast(x)
        assert got.shape == want.shape == (2, c_out, length * stride)
        assert snr_db(want, got) >= 100.0


@pytest.mark.parametrize("onednn", [True, False])
def test_gemm_conv_matches_conv1d(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short input as one product of the unfolded input (through oneDNN's matmul, or torch's
    where oneDNN is missing) against torch's Conv1d; a long one is Conv1d's own forward, bit for bit."""
    from torch import nn

    from omni_cpu_fastpath.qwen3_tts import code2wav
    from omni_cpu_fastpath.qwen3_tts.code2wav import SHORT_INPUT_COLUMNS, GemmConv1d

    monkeypatch.setattr(code2wav, "_ONEDNN_LINEAR", {torch.float32: onednn})
    torch.manual_seed(0)
    shapes = ((24, 40, 7, 1, True), (16, 16, 7, 3, True), (8, 12, 1, 1, False))
    for c_in, c_out, kernel, dilation, bias in shapes:
        stock = nn.Conv1d(c_in, c_out, kernel, dilation=dilation, bias=bias).eval()
        fast = GemmConv1d.from_stock(stock)
        assert fast.weight is stock.weight and fast.bias is stock.bias
        span = (kernel - 1) * dilation + 1
        for columns in (1, 4, SHORT_INPUT_COLUMNS, SHORT_INPUT_COLUMNS + 1):
            x = torch.randn(2, c_in, columns + span - 1)
            with torch.inference_mode():
                want, got = stock(x), fast(x)
            assert got.shape == want.shape == (2, c_out, columns)
            if columns > SHORT_INPUT_COLUMNS:
                assert torch.equal(got, want)
            else:
                assert snr_db(want, got) >= 100.0, (c_in, c_out, kernel, dilation, columns)
    with pytest.raises(ValueError, match="not an ungrouped stride-1 unpadded convolution"):
        GemmConv1d.from_stock(nn.Conv1d(8, 8, 7, groups=8))
    with pytest.raises(ValueError, match="not an ungrouped stride-1 unpadded convolution"):
        GemmConv1d.from_stock(nn.Conv1d(8, 8, 7, padding=3))


@pytest.mark.parametrize("onednn", [True, False])
def test_short_input_linear_matches_linear(onednn: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A few rows through oneDNN's matmul (or torch's product where oneDNN is missing) against
    torch's Linear, within float32 rounding of a float64 product; more rows are Linear's own
    forward, bit for bit."""
    from torch import nn

    from omni_cpu_fastpath.qwen3_tts import code2wav
    from omni_cpu_fastpath.qwen3_tts.code2wav import SHORT_INPUT_COLUMNS, ShortInputLinear

    monkeypatch.setattr(code2wav, "_ONEDNN_LINEAR", {torch.float32: onednn})
    torch.manual_seed(0)
    for bias in (True, False):
        stock = nn.Linear(48, 192, bias=bias).eval()
        fast = ShortInputLinear.from_stock(stock)
        assert fast.weight is stock.weight and fast.bias is stock.bias
        for rows in (1, 4, SHORT_INPUT_COLUMNS // 2, SHORT_INPUT_COLUMNS // 2 + 1):
            x = torch.randn(2, rows, 48)  # (batch, columns, channels), as a ConvNeXt block feeds it
            with torch.inference_mode():
                want, got = stock(x), fast(x)
            assert got.shape == want.shape == (2, rows, 192)
            if 2 * rows > SHORT_INPUT_COLUMNS:
                assert torch.equal(got, want)
            else:
                exact = x.double() @ stock.weight.double().t() + (stock.bias.double() if bias else 0.0)
                assert snr_db(exact, got) >= 100.0 and snr_db(exact, want) >= 100.0, rows
    with pytest.raises(ValueError, match="not a plain Linear"):
        ShortInputLinear.from_stock(ShortInputLinear(4, 4))


def test_cached_codebook_looks_up_stocks_values_and_follows_its_parameters() -> None:
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (
        EuclideanCodebook,
    )

    from omni_cpu_fastpath.qwen3_tts.code2wav import CachedCodebook

    g = torch.Generator().manual_seed(0)
    stock = EuclideanCodebook(16, 64)
    with torch.no_grad():
        stock.embedding_sum.copy_(torch.randn(64, 16, generator=g))
        stock.cluster_usage.copy_(torch.rand(64, generator=g) * 10)
        stock.cluster_usage[3] = 0.0  # below epsilon: the clamp
    cached = CachedCodebook.from_stock(stock)
    assert cached.embedding_sum is stock.embedding_sum and cached.cluster_usage is stock.cluster_usage
    codes = torch.randint(0, 64, (2, 9), generator=g)
    codes[0, 0] = 3
    with torch.inference_mode():
        assert torch.equal(cached.decode(codes), stock.decode(codes))
        assert torch.equal(cached.decode(codes), stock.decode(codes))  # from the kept table
    with torch.no_grad():  # a reload writes the parameters in place
        stock.embedding_sum.mul_(2.0)
        stock.cluster_usage.add_(1.0)
    with torch.inference_mode():
        assert torch.equal(cached.decode(codes), stock.decode(codes))
    with pytest.raises(ValueError, match="not a stock EuclideanCodebook"):
        CachedCodebook.from_stock(cached)


def test_stateless_stage_forward_matches_stock(stages: dict[str, Any]) -> None:
    """The stage's own forward (no async chunking): a 40-frame request with 5 frames of left context."""
    codes = _codes(40)
    info = [{"meta": {"left_context_size": 5}}]
    outs = {}
    for name in ("stock", "fast", "off"):
        out = stages[name](input_ids=codes.reshape(-1), runtime_additional_information=info)
        outs[name] = out.multimodal_outputs["model_outputs"][0]
    assert outs["stock"].shape == (35 * FRAME,)
    assert torch.equal(outs["off"], outs["stock"])  # the flag off changes no math
    assert snr_db(outs["stock"], outs["fast"]) >= 60.0


def test_streaming_decode_matches_stock(stages: dict[str, Any]) -> None:
    """The async-chunk road: one frame first, then 25-frame chunks decoded with the request's state."""
    codes = _codes(51, seed=1)
    chunks = [1, 25, 25]
    want = _stream(stages["stock"].decoder, codes, chunks)
    got = _stream(stages["fast"].decoder, codes, chunks)
    assert want.shape == got.shape == (1, 51 * FRAME)
    assert snr_db(want, got) >= 60.0


def test_snake_swap_alone_is_bit_identical(stages: dict[str, Any]) -> None:
    """Only the activations swapped (what changes no math): the waveform is bit-equal to stock."""
    import copy

    from vllm_omni.model_executor.models.common.snake_activation import SnakeBeta

    from omni_cpu_fastpath.qwen3_tts.code2wav import InplaceSnakeBeta

    decoder = copy.deepcopy(stages["stock"].decoder)
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is SnakeBeta:
                setattr(parent, name, InplaceSnakeBeta.from_stock(child))
    codes = _codes(26, seed=2)
    assert torch.equal(_stream(decoder, codes, [1, 25]), _stream(stages["stock"].decoder, codes, [1, 25]))


def test_timers_count_decoded_and_emitted_frames(stages: dict[str, Any], tmp_path: Path) -> None:
    fast = stages["fast"]
    step_stats.configure(str(tmp_path), sync=False, codes=False)
    try:
        step_stats.served("code2wav", fast.served)
        fast(
            input_ids=_codes(30).reshape(-1),
            runtime_additional_information=[{"meta": {"left_context_size": 5}}],
        )
        step_stats.end_step()
        line = json.loads((tmp_path / f"{os.getpid()}.jsonl").read_text().splitlines()[-1])
        values = line["values"]
        assert values["code2wav.frames_decoded"] == [30.0]
        assert values["code2wav.frames_emitted"] == [25.0]
        assert values["code2wav.transformer_frames"] == [30.0]
        assert len(values["code2wav.forward_ms"]) == 1 and values["code2wav.forward_ms"][0] > 0
        served = step_stats.served_dir(tmp_path)[str(os.getpid())]
        assert served["code2wav"].startswith("fast decoder")
    finally:
        step_stats.configure(None)


# Two requests served together as the runner batches them: chunk k of each in step k. Both open
# with one frame; "b" ends on a short chunk beside a full one of "a", "a" on a short chunk alone.
# (VLLM_OMNI_CODE2WAV_FAST with streaming: benchmarks/test_code2wav_bench.py, which CI runs too.)
SCHEDULE = {"a": [1, 25, 9], "b": [1, 13]}


def _serve_chunks(
    stage: Any, codes: dict[str, torch.Tensor], schedule: dict[str, list[int]]
) -> tuple[dict[str, torch.Tensor], list[dict[str, bool]]]:
    """Every request's audio through the stage's async-chunk forward, and after each step, per live
    request, whether its state holds vocoder tails."""
    from omni_cpu_fastpath.qwen3_tts.code2wav_stream import STATE_KEY

    audio: dict[str, list[torch.Tensor]] = {rid: [] for rid in schedule}
    pos = dict.fromkeys(schedule, 0)
    tails: list[dict[str, bool]] = []
    for step in range(max(map(len, schedule.values()))):
        rids = [rid for rid, chunks in schedule.items() if step < len(chunks)]
        flat, infos = [], []
        for rid in rids:
            n = schedule[rid][step]
            flat.append(codes[rid][0, :, pos[rid] : pos[rid] + n].reshape(-1))  # codebook-major, as sent
            pos[rid] += n
            infos.append({"meta": {"request_id": rid, "finished": step == len(schedule[rid]) - 1}})
        out = stage(
            input_ids=torch.cat(flat),
            runtime_additional_information=infos,
            seq_token_counts=[int(f.numel()) for f in flat],
        )
        step_stats.end_step()
        for rid, wav in zip(rids, out.multimodal_outputs["model_outputs"], strict=True):
            audio[rid].append(wav)
        tails.append({rid: STATE_KEY in state for rid, state in stage._decoder_state_cache.items()})
    return {rid: torch.cat(parts) for rid, parts in audio.items()}, tails


def test_streaming_vocoder_matches_stock_chunks_and_the_full_decode(
    stages: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The streamed vocoder (new frames only, tails in the request state) against vllm-omni's stage
    running the same schedule, and against the whole request decoded at once (``_forward_exact``)."""
    codes = {rid: _codes(sum(chunks), seed=10 + i) for i, (rid, chunks) in enumerate(SCHEDULE.items())}
    for name in ("stock", "stream"):
        monkeypatch.setattr(stages[name], "_async_chunk", True)  # the CPU deploy config's mode
    want, _ = _serve_chunks(stages["stock"], codes, SCHEDULE)
    step_stats.configure(str(tmp_path), sync=False, codes=False)
    try:
        got, tails = _serve_chunks(stages["stream"], codes, SCHEDULE)
        lines = [
            json.loads(x)["values"] for x in (tmp_path / f"{os.getpid()}.jsonl").read_text().splitlines()
        ]
    finally:
        step_stats.configure(None)
    assert stages["stream"].served_streaming.startswith("streaming vocoder (")
    for rid, frames in ((rid, sum(chunks)) for rid, chunks in SCHEDULE.items()):
        with torch.inference_mode():
            exact = stages["stock"].decoder._forward_exact(codes[rid]).reshape(-1)
        assert want[rid].shape == got[rid].shape == exact.shape == (frames * FRAME,)
        # The first chunk is stock's own decode, which seeds the tails.
        assert torch.equal(got[rid][:FRAME], want[rid][:FRAME])
        print(
            f"request {rid}: streaming vs stock chunks {snr_db(want[rid], got[rid]):.1f} dB, "
            f"vs the full decode {snr_db(exact, got[rid]):.1f} dB"
        )
        assert snr_db(want[rid], got[rid]) >= 60.0
        assert snr_db(exact, got[rid]) >= 60.0
    # The vocoder ran over the frames it returned and no others: no left context, no batch padding.
    decoded = [v["code2wav.frames_decoded"][0] for v in lines if "code2wav.frames_decoded" in v]
    emitted = [v["code2wav.frames_emitted"][0] for v in lines if "code2wav.frames_emitted" in v]
    assert decoded == emitted == [2.0, 38.0, 9.0]
    # Tails live in the request state while the request does, and leave with it.
    assert tails == [{"a": True, "b": True}, {"a": True}, {}]
    assert stages["stream"]._decoder_state_cache == {}


def test_streaming_state_is_freed_on_abort(stages: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_cpu_fastpath.qwen3_tts.code2wav_stream import STATE_KEY

    stage = stages["stream"]
    monkeypatch.setattr(stage, "_async_chunk", True)
    codes = _codes(1, seed=3)
    stage(input_ids=codes.reshape(-1), runtime_additional_information=[{"meta": {"request_id": "gone"}}])
    assert STATE_KEY in stage._decoder_state_cache["gone"]
    stage.on_requests_finished({"gone"})
    assert stage._decoder_state_cache == {}


def test_streaming_after_the_transformer_window_rolls(stages: dict[str, Any]) -> None:
    """Past the transformer's sliding window (72 frames), stock recomputes the context frames with a
    shorter attention history than when they were new; streaming keeps what they were then. On the
    one-layer tiny codec that is exactly the full decode's value."""
    chunks = [1, 25, 25, 25, 10]  # the last chunk is the first with a rolled window
    codes = _codes(sum(chunks), seed=4)
    want = _stream(stages["stock"].decoder, codes, chunks)
    got = _stream(stages["stream"].decoder, codes, chunks)
    with torch.inference_mode():
        exact = stages["stock"].decoder._forward_exact(codes)
    rolled = slice(76 * FRAME, None)  # the chunks decoded with a rolled window
    print(
        f"after rolling: streaming vs full decode {snr_db(exact[..., rolled], got[..., rolled]):.1f} dB, "
        f"stock vs full decode {snr_db(exact[..., rolled], want[..., rolled]):.1f} dB, "
        f"streaming vs stock {snr_db(want[..., rolled], got[..., rolled]):.1f} dB"
    )
    assert snr_db(exact, got) >= 60.0
    assert snr_db(exact[..., rolled], got[..., rolled]) >= snr_db(exact[..., rolled], want[..., rolled])


def test_streaming_icl_request_matches_stock(stages: dict[str, Any]) -> None:
    """A request with a 10-frame reference prefix (ICL): its first chunk decodes the prefix too."""
    from omni_cpu_fastpath.qwen3_tts.code2wav_stream import STATE_KEY

    chunks, prefix = [1, 12], 10
    codes = _codes(prefix + sum(chunks), seed=5)
    outs = {}
    for name in ("stock", "stream"):
        decoder = stages[name].decoder
        state: dict[str, Any] = {"prefix_frames": prefix}
        parts, pos = [], 0
        with torch.inference_mode():
            for i, n in enumerate(chunks):
                start = prefix + pos if i else 0  # the first chunk carries the prefix before its frame
                part = codes[:, :, start : prefix + pos + n]
                parts.append(decoder.batched_chunked_decode(part, [part.shape[-1]], caches=[state])[0])
                pos += n
        outs[name] = torch.cat(parts, dim=-1)
        assert (STATE_KEY in state) is (name == "stream")  # streamed to the end, no fallback
    assert outs["stock"].shape == outs["stream"].shape == (1, sum(chunks) * FRAME)
    print(f"ICL request: streaming vs stock chunks {snr_db(outs['stock'], outs['stream']):.1f} dB")
    assert snr_db(outs["stock"], outs["stream"]) >= 60.0


def test_streaming_refuses_a_vocoder_it_does_not_know(stages: dict[str, Any]) -> None:
    import copy

    from torch import nn

    from omni_cpu_fastpath.qwen3_tts.code2wav_stream import (
        StreamingCausalConv,
        StreamingCodecDecoder,
        StreamingUnsupported,
    )

    assert isinstance(stages["stream"].decoder, StreamingCodecDecoder)
    assert any(isinstance(m, StreamingCausalConv) for m in stages["stream"].decoder.modules())
    assert stages["off"].served_streaming == "stock (VLLM_OMNI_CODE2WAV_STREAMING off)"
    assert type(stages["off"].decoder).__name__ == "Qwen3TTSTokenizerV2Decoder"
    stage = copy.deepcopy(stages["off"])
    stage._streaming = True
    stage.decoder = StreamingCodecDecoder._from_config(stage.decoder.config)
    stage.decoder.decoder[-2] = nn.Identity()  # a layer whose time behaviour the stream cannot know
    served = stage._enable_streaming()
    assert served.startswith("stock (enable_streaming failed: StreamingUnsupported: decoder.")
    assert "Identity" in served
    assert not stage.decoder.streaming
    assert not any(isinstance(m, StreamingCausalConv) for m in stage.decoder.modules())
    with pytest.raises(StreamingUnsupported):
        stage.decoder.enable_streaming()


def test_stock_chunks_fallback_warns_where_the_deploy_config_chunks_are_short(
    stages: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the streaming vocoder cannot serve, the stock decoder takes the chunks that the CPU
    deploy config sized for it: the served status says what they cost and what to set, and only
    where they are shorter than vllm-omni's own."""
    import copy

    from torch import nn
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import modeling_qwen3_tts_tokenizer_v2

    from omni_cpu_fastpath.qwen3_tts.code2wav_stream import StreamingCodecDecoder
    from omni_cpu_fastpath.serving.deploy_config import DEPLOY_CHUNK_FRAMES_ENV

    context = modeling_qwen3_tts_tokenizer_v2._DOWNSTREAM_CONTEXT_FRAME
    stage = copy.deepcopy(stages["off"])
    stage._streaming = True
    stage.decoder = StreamingCodecDecoder._from_config(stage.decoder.config)
    stage.decoder.decoder[-2] = nn.Identity()
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", "auto")
    for told, warned in (("10", True), ("24", True), ("25", False), ("40", False), (None, False)):
        if told is None:
            monkeypatch.delenv(DEPLOY_CHUNK_FRAMES_ENV, raising=False)
        else:
            monkeypatch.setenv(DEPLOY_CHUNK_FRAMES_ENV, told)
        served = stage._enable_streaming()
        assert served.startswith("stock (enable_streaming failed: StreamingUnsupported"), told
        if warned:
            assert f"hands code2wav {told}-frame chunks (VLLM_OMNI_CODE2WAV_CHUNK_FRAMES=auto)" in served
            assert f"({int(told) + context} frames for {told} new)" in served
            assert "set VLLM_OMNI_CODE2WAV_CHUNK_FRAMES=25" in served
        else:
            assert "chunks (" not in served, told
    # Where the streaming vocoder serves, short chunks are what it was given them for.
    monkeypatch.setenv(DEPLOY_CHUNK_FRAMES_ENV, "10")
    served = copy.deepcopy(stages["stream"])._enable_streaming()
    assert served.startswith("streaming vocoder (") and "chunks (" not in served


def test_bf16_decoder_is_vllm_omnis_stage_at_bf16(stages: dict[str, Any]) -> None:
    """With VLLM_OMNI_CODE2WAV_DTYPE=bfloat16 (and the fast modules off) our stage computes what
    vllm-omni's own stage computes at bfloat16 (its GPU deploy config's dtype): bit for bit, the
    weights loaded at bfloat16, the audio returned in float32."""
    ours, stock = stages["bf16"], stages["stock_bf16"]
    assert ours.served_dtype == "bfloat16 (VLLM_OMNI_CODE2WAV_DTYPE=bfloat16)"
    assert stages["off"].served_dtype == "float32 (VLLM_OMNI_CODE2WAV_DTYPE=float32)"
    assert {p.dtype for p in ours.decoder.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in stock.decoder.parameters()} == {torch.bfloat16}
    info = [{"meta": {"left_context_size": 5}}]
    codes = _codes(40)
    outs = [
        stage(input_ids=codes.reshape(-1), runtime_additional_information=info).multimodal_outputs[
            "model_outputs"
        ][0]
        for stage in (ours, stock)
    ]
    assert outs[0].dtype == outs[1].dtype == torch.float32
    assert torch.equal(outs[0], outs[1])
    codes = _codes(26, seed=2)
    assert torch.equal(_stream(ours.decoder, codes, [1, 25]), _stream(stock.decoder, codes, [1, 25]))


def test_bf16_fast_streaming_decoder_is_as_close_to_float32_as_vllm_omnis_bf16(
    stages: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reduced precision's bound: bf16 keeps 8 significant bits, so no bf16 decode is bit-equal to
    the float32 one; the fast, streaming decoder in bf16 must be no further from vllm-omni's
    float32 stage than vllm-omni's own stage in bf16 (what its GPU deploy config serves) is, within
    3 dB (noise twice as strong), on the async-chunk road of two batched requests."""
    codes = {rid: _codes(sum(chunks), seed=20 + i) for i, (rid, chunks) in enumerate(SCHEDULE.items())}
    names = ("stock", "stock_bf16", "bf16_fast_stream")
    for name in names:
        monkeypatch.setattr(stages[name], "_async_chunk", True)  # the CPU deploy config's mode
    want, upstream, got = (_serve_chunks(stages[name], codes, SCHEDULE)[0] for name in names)
    ours = stages["bf16_fast_stream"]
    assert ours.served.startswith("fast decoder (")
    assert ours.served_streaming.startswith("streaming vocoder (")
    for rid in SCHEDULE:
        assert got[rid].dtype == torch.float32
        reference_db, ours_db = snr_db(want[rid], upstream[rid]), snr_db(want[rid], got[rid])
        print(f"request {rid}: vs float32, vllm-omni's bf16 {reference_db:.1f} dB, ours {ours_db:.1f} dB")
        assert reference_db >= 20.0  # a sanity floor for the reference itself
        assert ours_db >= reference_db - 3.0


def test_dtype_flag_on_both_roads_and_refused_by_name(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The deploy config writes the stage dtype the flag resolves to (auto: by the CPU's flags as
    /proc/cpuinfo lists them); bad values, and any but float32 beside the fast path off (the stock
    stage does not cast), are refused by name on both roads."""
    from cpu_helpers import native_bf16_by_cpuinfo

    from omni_cpu_fastpath.serving import deploy_config, stage_settings

    talker, code2wav = stage_settings.QWEN3_TTS_STAGES
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    auto = "bfloat16" if native_bf16_by_cpuinfo() else "float32"
    for flag, want in (("float32", "float32"), ("bfloat16", "bfloat16"), ("auto", auto)):
        monkeypatch.setenv("VLLM_OMNI_CODE2WAV_DTYPE", flag)
        overlay = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
        written = {s["stage_id"]: s for s in overlay["stages"]}
        assert written[code2wav.stage_id]["dtype"] == want, flag
        assert "dtype" not in written[talker.stage_id], flag
        # The plain road: vllm-omni's deploy file says bfloat16; the platform hook sets the flag's
        # dtype before the worker loads the weights.
        assert _plain_code2wav_config(tiny_model_dir).model_config.dtype == getattr(torch, want), flag
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_DTYPE", "fp16")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_CODE2WAV_DTYPE='fp16'.*float32\|bfloat16\|auto"):
        envs.validate_all()
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_DTYPE='fp16'"):
        deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
    for flag in ("bfloat16", "auto"):
        monkeypatch.setenv("VLLM_OMNI_CODE2WAV_DTYPE", flag)
        refused = rf"VLLM_OMNI_CODE2WAV_DTYPE='{flag}'.*VLLM_OMNI_CPU_FASTPATH='0'"
        with pytest.raises(envs.FlagError, match=refused):
            deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
        # The plain road: the platform hook (vLLM's config validation wraps the error).
        with pytest.raises(ValueError, match=refused):
            _plain_code2wav_config(tiny_model_dir)
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_DTYPE", "float32")
    written = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"][code2wav.stage_id]
    assert written["dtype"] == "float32"
    assert _plain_code2wav_config(tiny_model_dir).model_config.dtype == torch.float32


def test_chunk_frames_reach_vllm_omnis_connector_through_the_deploy_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """VLLM_OMNI_CODE2WAV_CHUNK_FRAMES lands in the connector's ``codec_chunk_frames`` as vllm-omni's
    own loader merges the CPU deploy config over its qwen3_tts.yaml, every other connector setting
    kept; auto: the streaming vocoder's size where it serves, else the file's own. Bad values, and
    a number beside the fast path off, are refused by name."""
    import vllm_omni
    from vllm_omni.config.stage_config import resolve_deploy_yaml

    from omni_cpu_fastpath.serving import deploy_config, stage_settings

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    stock_file = resolve_deploy_yaml(Path(vllm_omni.__file__).parent / "deploy" / "qwen3_tts.yaml")
    stock = stock_file["connectors"][deploy_config.CODEC_CONNECTOR]
    assert "codec_chunk_frames" in stock["extra"]  # the setting this flag writes

    assert stock["extra"]["codec_chunk_frames"] == stage_settings.STOCK_CHUNK_FRAMES

    def connector() -> dict[str, Any]:
        return resolve_deploy_yaml(deploy_config.cpu_deploy_config_path())["connectors"][
            deploy_config.CODEC_CONNECTOR
        ]

    def code2wav_env() -> dict[str, str]:
        stages = resolve_deploy_yaml(deploy_config.cpu_deploy_config_path())["stages"]
        (code2wav,) = [s for s in stages if s["stage_id"] == 1]
        return code2wav.get("env") or {}

    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    cases = [
        ("0", "auto", None),
        ("1", "auto", stage_settings.STREAMING_CHUNK_FRAMES),
        ("0", "7", 7),
        ("1", "40", 40),
    ]
    for streaming, flag, want in cases:
        monkeypatch.setenv("VLLM_OMNI_CODE2WAV_STREAMING", streaming)
        monkeypatch.setenv("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", flag)
        assert stage_settings.code2wav_chunk_frames() == want, (streaming, flag)
        expected = (
            stock if want is None else {**stock, "extra": {**stock["extra"], "codec_chunk_frames": want}}
        )
        assert connector() == expected, (streaming, flag)
        # The code2wav stage is told the chunk size (to warn where its decoder does not suit it).
        told = code2wav_env().get(deploy_config.DEPLOY_CHUNK_FRAMES_ENV)
        assert told == (None if want is None else str(want)), (streaming, flag)
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_STREAMING", "1")
    for bad in ("0", "-4", "ten", "2.5"):
        monkeypatch.setenv("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", bad)
        refused = rf"VLLM_OMNI_CODE2WAV_CHUNK_FRAMES='{re.escape(bad)}'.*auto, an integer >= 1"
        with pytest.raises(envs.FlagError, match=refused):
            envs.validate_all()
        with pytest.raises(envs.FlagError, match=refused):
            deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", "12")
    with pytest.raises(
        envs.FlagError, match="VLLM_OMNI_CODE2WAV_CHUNK_FRAMES='12'.*VLLM_OMNI_CPU_FASTPATH='0'"
    ):
        deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_CHUNK_FRAMES", "auto")
    assert connector() == stock


def _plain_code2wav_config(model: Path) -> Any:
    """The code2wav stage's config as a plain ``vllm serve MODEL --omni`` builds it from vllm-omni's
    deploy file (stage dtype bfloat16), the platform hook applied."""
    from vllm_omni.engine.arg_utils import OmniEngineArgs

    return OmniEngineArgs(
        model=str(model),
        dtype="bfloat16",
        stage_id=1,
        model_stage="code2wav",
        model_arch="Qwen3TTSCode2Wav",
        worker_type="generation",
        trust_remote_code=True,
        max_model_len=512,
    ).create_engine_config()


def test_flag_refuses_a_bad_value_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_FAST", "sometimes")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_FAST='sometimes'"):
        envs.get("VLLM_OMNI_CODE2WAV_FAST")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_FAST"):
        plugins.register_models()
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_FAST", "auto")
    assert envs.get("VLLM_OMNI_CODE2WAV_FAST") is (not envs.has_accelerator())
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_STREAMING", "auto")  # a plain 0/1 flag
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_STREAMING='auto'"):
        envs.get("VLLM_OMNI_CODE2WAV_STREAMING")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_STREAMING"):
        plugins.register_models()


def test_register_models_switches_the_code2wav_class(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav as Stock
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from omni_cpu_fastpath.qwen3_tts.code2wav import FastQwen3TTSCode2Wav

    arch = plugins.CODE2WAV_ARCH
    try:
        monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
        plugins.register_models()
        plugins.register_models()  # idempotent
        assert OmniModelRegistry._try_load_model_cls(arch) is FastQwen3TTSCode2Wav
        assert issubclass(FastQwen3TTSCode2Wav, Stock)
        monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
        plugins.register_models()
        assert OmniModelRegistry._try_load_model_cls(arch) is Stock
    finally:
        monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
        plugins.register_models()
