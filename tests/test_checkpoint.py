"""Random checkpoints: layout accepted by vllm-omni's loaders and by qwen-tts, determinism, outliers, CLI."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from omni_cpu_fastpath import cli
from omni_cpu_fastpath.testing import checkpoint
from omni_cpu_fastpath.testing import reference as ref


def _safetensors(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


# ------------------------------------------------------------------------------------------------
# vllm-omni's side
# ------------------------------------------------------------------------------------------------


def test_config_is_read_by_vllm_omni_as_written(tiny_model_dir: Path) -> None:
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
        configuration_qwen3_tts_tokenizer_v2 as stc,
    )

    from omni_cpu_fastpath.testing.stock import load_qwen3_tts_config

    raw = json.loads((tiny_model_dir / "config.json").read_text())
    cfg = load_qwen3_tts_config(tiny_model_dir)
    tc, cp = cfg.talker_config, cfg.talker_config.code_predictor_config
    # vllm-omni's config class defaults are stale (e.g. num_code_groups=32, pad 4196): every value
    # the stack relies on must come from the file.
    assert (tc.codec_pad_id, tc.codec_bos_id, tc.codec_eos_token_id) == (2148, 2149, 2150)
    assert tc.num_code_groups == cp.num_code_groups == 16
    assert cp.vocab_size == 2048 and tc.vocab_size == 3072
    assert cp.rope_parameters["rope_theta"] == 1_000_000 and cp.rms_norm_eps == 1e-6
    assert tc.hidden_size == raw["talker_config"]["hidden_size"] and cp.hidden_size == 64
    assert tc.spk_id["vivian"] == 3065 and set(tc.spk_id) == set(checkpoint.SPEAKERS)
    assert cfg.tts_model_type == "custom_voice"
    st = stc.Qwen3TTSTokenizerV2Config.from_pretrained(str(tiny_model_dir), subfolder="speech_tokenizer")
    assert st.decoder_config.num_quantizers == 16 and st.decode_upsample_rate == 1920
    assert st.encoder_valid_num_quantizers == 16 and st.decoder_config.codebook_size == cp.vocab_size


def test_text_tokenizer_keeps_qwen_special_ids(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    text = "Hello, wörld"
    ids = tok(f"<|im_start|>assistant\n{text}<|im_end|>\n")["input_ids"]
    # Independent expectation: the config's special ids around plain UTF-8 bytes.
    body = list(b"assistant\n") + list(text.encode())
    assert ids == [raw["im_start_token_id"], *body, raw["im_end_token_id"], ord("\n")]
    assert tok.convert_tokens_to_ids("<tts_pad>") == raw["tts_pad_token_id"]
    assert tok.decode(ids) == f"<|im_start|>assistant\n{text}<|im_end|>\n"


@pytest.mark.slow
def test_stock_talker_and_code2wav_load_every_weight(tiny_model_dir: Path, tmp_path: Path) -> None:
    """vLLM's strict loader through vllm-omni's own load_weights, both stages.

    ``DefaultModelLoader.load_weights`` raises when a parameter is left unloaded and vLLM's
    ``AutoWeightsLoader`` raises on a name it cannot place; the broken copies below prove both.
    """
    import torch
    from safetensors.torch import save_file

    from omni_cpu_fastpath.testing.stock import build_stock_code2wav, build_stock_talker, iter_checkpoint

    ckpt = dict(iter_checkpoint(tiny_model_dir))
    # The talker's load_weights silently drops anything outside these prefixes: nothing may be there.
    assert all(n.startswith(("talker.", "speaker_encoder.")) for n in ckpt)

    talker, _ = build_stock_talker(tiny_model_dir)
    # Values land where the official names say (mapper + fused qkv packing).
    torch.testing.assert_close(
        talker.model.embed_tokens.weight, ckpt["talker.model.codec_embedding.weight"], rtol=0, atol=0
    )
    torch.testing.assert_close(
        talker.text_embedding.weight, ckpt["talker.model.text_embedding.weight"], rtol=0, atol=0
    )
    q = ckpt["talker.code_predictor.model.layers.1.self_attn.q_proj.weight"]
    qkv = talker.code_predictor.model.layers[1].self_attn.qkv_proj.weight
    torch.testing.assert_close(qkv[: q.shape[0]], q, rtol=0, atol=0)

    code2wav, _ = build_stock_code2wav(tiny_model_dir)
    st = _safetensors(tiny_model_dir / "speech_tokenizer" / "model.safetensors")
    dec = {k[len("decoder.") :]: v for k, v in st.items() if k.startswith("decoder.")}
    got = dict(code2wav.decoder.named_parameters())
    assert set(got) == set(dec)
    for k in ("pre_conv.conv.weight", "quantizer.rvq_first.vq.layers.0._codebook.embedding_sum"):
        torch.testing.assert_close(got[k], dec[k], rtol=0, atol=0)
    codes = torch.randint(0, 2048, (1, 16, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        wav = code2wav.decoder.chunked_decode(codes)
    assert wav.shape[-1] == 3 * 1920 and torch.isfinite(wav).all() and wav.abs().max() > 0

    # Negative controls: the same folder with one tensor missing, or one unknown name, must not load.
    for label, edit, error in (
        ("missing", lambda d: d.pop("talker.model.norm.weight"), "not initialized from checkpoint"),
        (
            "unexpected",
            lambda d: d.__setitem__("talker.model.bogus.weight", torch.zeros(3)),
            "no module or parameter",
        ),
    ):
        broken = tmp_path / label
        shutil.copytree(tiny_model_dir, broken)
        tensors = _safetensors(broken / "model.safetensors")
        edit(tensors)
        save_file(tensors, str(broken / "model.safetensors"))
        with pytest.raises(ValueError, match=error):
            build_stock_talker(broken)


# ------------------------------------------------------------------------------------------------
# qwen-tts's side
# ------------------------------------------------------------------------------------------------

needs_ref = pytest.mark.usefixtures("qwen_tts_reference")  # fails under CI when .venv-ref is missing


@needs_ref
def test_layout_matches_qwen_tts(make_checkpoint) -> None:
    """qwen-tts's full model, built from each config, expects exactly the tensors written."""
    dirs = {
        "tiny": make_checkpoint(dims="tiny", seed=0),
        "tiny-proj": make_checkpoint(dims="tiny-proj", seed=0),
        "base": make_checkpoint(dims="tiny", kind="base", seed=0),
        "voice-design": make_checkpoint(dims="tiny", kind="voice-design", seed=0),
    }
    reports = dict(zip(dirs, ref.check_layouts(list(dirs.values())), strict=True))
    for label, report in reports.items():
        assert (report["missing"], report["unexpected"], report["mismatched"]) == ([], [], []), label
        assert report["n_expected"] > 50
        assert (
            report["decoded_samples"] == 2 * 1920
            and report["sample_rate"] == 24000
            and report["decoded_finite"]
        )
    # qwen-tts builds a speaker encoder only for "base": its tensors are expected there and only there.
    base_cfg = json.loads((dirs["base"] / "config.json").read_text())
    assert base_cfg["tts_model_type"] == "base" and base_cfg["talker_config"]["spk_id"] == {}
    assert reports["base"]["n_expected"] > reports["tiny"]["n_expected"]
    assert any(n.startswith("speaker_encoder.") for n in _safetensors(dirs["base"] / "model.safetensors"))
    for label in ("tiny", "voice-design"):
        assert not any(
            n.startswith("speaker_encoder.") for n in _safetensors(dirs[label] / "model.safetensors")
        )
    design_cfg = json.loads((dirs["voice-design"] / "config.json").read_text())
    assert design_cfg["tts_model_type"] == "voice_design" and design_cfg["talker_config"]["spk_id"] == {}


# ------------------------------------------------------------------------------------------------
# Determinism, outliers, CLI
# ------------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_files(tiny_model_dir: Path, tmp_path: Path) -> None:
    again = checkpoint.make_model(tmp_path / "again", dims="tiny", seed=0)
    for rel in ("model.safetensors", "speech_tokenizer/model.safetensors", "config.json", "tokenizer.json"):
        assert (again / rel).read_bytes() == (tiny_model_dir / rel).read_bytes(), rel
    other = checkpoint.make_model(tmp_path / "other", dims="tiny", seed=1, parts="predictor")
    a, b = _safetensors(tiny_model_dir / "model.safetensors"), _safetensors(other / "model.safetensors")
    name = "talker.code_predictor.lm_head.0.weight"
    assert not (a[name] == b[name]).all()


def test_predictor_part_equals_full_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    part = checkpoint.make_model(tmp_path / "part", dims="tiny", seed=0, parts="predictor")
    full, small = _safetensors(tiny_model_dir / "model.safetensors"), _safetensors(part / "model.safetensors")
    assert set(small) == {n for n in full if n.startswith("talker.code_predictor.")} | {
        checkpoint.LAYER0_EMBEDDING
    }
    for n, t in small.items():
        assert (t == full[n]).all(), n
    assert not (part / "speech_tokenizer" / "model.safetensors").exists()


def _predictor_stats(model_dir: Path, rows: int = 16):
    """Per-channel |activation| max at the last layer's qkv_proj input, and teacher-forced top-1 probs."""
    import torch

    from omni_cpu_fastpath.testing.stock import build_stock_predictor, layer0_embedding

    pred = build_stock_predictor(model_dir)
    seen = []
    hook = pred.model.layers[-1].self_attn.qkv_proj.register_forward_hook(lambda m, i, o: seen.append(i[0]))
    inputs = ref.random_inputs(model_dir, rows, seed=1)
    c0 = inputs["layer0_codes"].reshape(rows, 1)
    e0 = layer0_embedding(model_dir, c0)
    h = inputs["talker_hidden"].reshape(rows, 1, -1)
    codes = pred(layer0_code=c0, layer0_embed=e0, last_talker_hidden=h, do_sample=False)
    hook.remove()
    width = pred.model.norm.weight.shape[0]
    chmax = seen[-1].reshape(-1, width).abs().amax(0)
    with torch.no_grad():
        seq = [h[:, 0], e0[:, 0]] + [
            pred.model.codec_embedding[k](codes[:, k + 1].clone()) for k in range(14)
        ]
        hidden = pred.model(torch.stack(seq, 1), torch.arange(16).expand(rows, -1))
        top1 = torch.stack([pred.lm_head[k](hidden[:, k + 1]).softmax(-1).amax(-1) for k in range(15)], 1)
    return chmax / chmax.median(), top1


def test_outliers_are_real_channels_and_heads_are_peaked(
    tiny_model_dir: Path, tiny_outlier_model_dir: Path
) -> None:
    ratio_plain, top1_plain = _predictor_stats(tiny_model_dir)
    ratio_out, top1_out = _predictor_stats(tiny_outlier_model_dir)
    meta = json.loads((tiny_outlier_model_dir / "omni_cpu_fastpath.json").read_text())
    chans = meta["outlier_channels"]
    assert chans == checkpoint.outlier_channels("tiny", 0) and len(chans) == checkpoint.OUTLIER_CHANNELS
    # Measured on the stock predictor's activations, not read back from the weights.
    assert ratio_plain.max() < 3
    assert sorted(ratio_out.topk(len(chans)).indices.tolist()) == chans
    assert ratio_out[chans].min() > 15
    others = [i for i in range(ratio_out.numel()) if i not in chans]
    assert ratio_out[others].max() < 3
    # Near-uniform heads on plain weights (1/2048 ~ 5e-4), substantial top-1 with outliers=True.
    assert top1_plain.median() < 0.01
    assert top1_out.median() > 0.15


def test_cli_make_model_writes_the_folder(tmp_path: Path, capsys) -> None:
    out = tmp_path / "m"
    assert cli.main(["make-model", str(out), "--dims", "tiny", "--seed", "3", "--outliers"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["dir"] == str(out) and printed["outliers"] is True
    for rel in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "speech_tokenizer/config.json",
        "speech_tokenizer/preprocessor_config.json",
        "speech_tokenizer/model.safetensors",
    ):
        assert (out / rel).is_file(), rel
    meta = json.loads((out / "omni_cpu_fastpath.json").read_text())
    assert meta["seed"] == 3 and meta["outlier_channels"] == checkpoint.outlier_channels("tiny", 3)


def test_bad_dims_and_kind_are_rejected(tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.build_parser().parse_args(["make-model", str(tmp_path), "--dims", "3b"])
    assert exc.value.code == 2
    assert "invalid choice: '3b'" in capsys.readouterr().err
    with pytest.raises(checkpoint.CheckpointError, match="dims='3b'.*tiny"):
        checkpoint.make_model(tmp_path, dims="3b")
    with pytest.raises(checkpoint.CheckpointError, match="kind='clone'"):
        checkpoint.make_model(tmp_path, kind="clone")
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("dims", ["tiny", "tiny-proj", "0.6b", "1.7b"])
def test_talker_head_dim_is_served_by_vllm_cpu_attention(dims: str) -> None:
    # vLLM's CPU attention backend serves only some head sizes; a tiny model outside them would
    # load fine and then fail on its first request.
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    talker = checkpoint.build_config(dims)["talker_config"]
    head_dim = talker.get("head_dim") or talker["hidden_size"] // talker["num_attention_heads"]
    assert head_dim in CPUAttentionBackend.get_supported_head_sizes()
