"""``FastQwen3TTSCode2Wav``: the fast decoder against vllm-omni's own, its flag, its registration, its timers.

The reference is vllm-omni's stock ``Qwen3TTSCode2Wav`` built directly (not through the registry)
on the tiny random checkpoint; SNR is computed here in float64 numpy, independently of the code
under test.
"""

from __future__ import annotations

import json
import os
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


def _build(model_dir: Path, cls: Any) -> Any:
    from omni_cpu_fastpath.testing.stock import _build_stock_stage

    model, _ = _build_stock_stage(
        model_dir, cls, "code2wav", "generation", torch.float32, "auto", arch="Qwen3TTSCode2Wav"
    )
    return model


@pytest.fixture(scope="module")
def stages(tiny_model_dir: Path) -> dict[str, Any]:
    """The stock stage, the fast stage (flag on) and the fast stage with the flag off."""
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    from omni_cpu_fastpath.qwen3_tts.code2wav import FastQwen3TTSCode2Wav

    saved = os.environ.get("VLLM_OMNI_CODE2WAV_FAST")
    try:
        stock = _build(tiny_model_dir, Qwen3TTSCode2Wav)
        os.environ["VLLM_OMNI_CODE2WAV_FAST"] = "1"
        fast = _build(tiny_model_dir, FastQwen3TTSCode2Wav)
        os.environ["VLLM_OMNI_CODE2WAV_FAST"] = "0"
        off = _build(tiny_model_dir, FastQwen3TTSCode2Wav)
    finally:
        if saved is None:
            os.environ.pop("VLLM_OMNI_CODE2WAV_FAST", None)
        else:
            os.environ["VLLM_OMNI_CODE2WAV_FAST"] = saved
    # The random checkpoint leaves every SnakeBeta at alpha = beta = 0; give them distinct values
    # (the same in every stage) so the activations are exercised.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in stock.decoder.named_parameters():
            if name.endswith((".alpha", ".beta")):
                values = 0.3 * torch.randn(p.shape, generator=g)
                for model in (stock, fast, off):
                    dict(model.decoder.named_parameters())[name].copy_(values)
    for model in (stock, fast, off):
        model.decoder.precompute_snake_caches()
    return {"stock": stock, "fast": fast, "off": off}


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

    from omni_cpu_fastpath.qwen3_tts.code2wav import GemmCausalTransConv, InplaceSnakeBeta

    fast, off = stages["fast"], stages["off"]
    assert fast.served.startswith("fast decoder (") and "GemmCausalTransConv" in fast.served
    assert any(isinstance(m, InplaceSnakeBeta) for m in fast.decoder.modules())
    assert any(isinstance(m, GemmCausalTransConv) for m in fast.decoder.modules())
    assert off.served == "stock decoder (VLLM_OMNI_CODE2WAV_FAST off)"
    assert not any(isinstance(m, (InplaceSnakeBeta, GemmCausalTransConv)) for m in off.decoder.modules())
    assert any(type(m) is SnakeBeta for m in off.decoder.modules())
    # Parameter names (what loading goes by) are the stock ones.
    assert {n for n, _ in fast.decoder.named_parameters()} == {
        n for n, _ in stages["stock"].decoder.named_parameters()
    }


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

    from omni_cpu_fastpath.qwen3_tts.code2wav import GemmCausalTransConv

    torch.manual_seed(0)
    for c_in, c_out, kernel, stride, length in ((16, 8, 10, 5, 37), (12, 12, 2, 2, 1), (6, 3, 6, 3, 4)):
        stock = Stock(c_in, c_out, kernel, stride).eval()
        fast = GemmCausalTransConv(stock)
        x = torch.randn(2, c_in, length)
        with torch.inference_mode():
            want, got = stock(x), fast(x)
        assert got.shape == want.shape == (2, c_out, length * stride)
        assert snr_db(want, got) >= 100.0


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


def test_flag_refuses_a_bad_value_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_FAST", "sometimes")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_FAST='sometimes'"):
        envs.get("VLLM_OMNI_CODE2WAV_FAST")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_CODE2WAV_FAST"):
        plugins.register_models()
    monkeypatch.setenv("VLLM_OMNI_CODE2WAV_FAST", "auto")
    assert envs.get("VLLM_OMNI_CODE2WAV_FAST") is (not envs.has_accelerator())


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
