"""The talker's int8 decoder linears (``VLLM_OMNI_TALKER_INT8``, ``quant/talker_int8.py``).

References: float64 arithmetic on the dequantized weights (the linear method), vLLM's own model
construction (which layers get the method), the fp32 and bf16 talkers built the same way
(teacher-forced parity on the tiny ``outliers=True`` checkpoint, bounds frozen from measurement),
and one real server on loopback (audio comes with the flag on).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.serving import deploy_config, stage_settings

METHOD = stage_settings.TALKER_INT8_METHODS["w8-channel"]


# --- the linear method against float64 ---------------------------------------------------------


def _method_layer(weight, bias=None):
    """A module with ``TalkerW8LinearMethod``'s weights, loaded and processed as vLLM's loader does."""
    import torch
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.config.vllm import set_current_vllm_config

    from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import TalkerW8LinearMethod
    from omni_cpu_fastpath.testing.stock import ensure_single_process_world

    with set_current_vllm_config(VllmConfig()):
        ensure_single_process_world()
    method = TalkerW8LinearMethod()
    layer = nn.Module()
    n, k = weight.shape
    method.create_weights(layer, k, [n], k, n, weight.dtype, weight_loader=lambda p, w: p.data.copy_(w))
    layer.weight.weight_loader(layer.weight, weight)
    method.process_weights_after_loading(layer)
    method.process_weights_after_loading(layer)  # a second call changes nothing
    assert layer.qweight.dtype == torch.int8 and layer.weight.numel() == 0
    return method, layer


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_linear_method_matches_float64_of_dequantized_weights(dtype: str) -> None:
    import torch

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    n, k = 96, 160
    w = torch.randn(n, k) * 0.02
    w[:, 7] *= 30  # an outlier input column: per-row scales must still hold every row
    w[5] = 0.0  # an all-zero row (scale 1, not 0/0)
    bias = torch.randn(n) * 0.1
    method, layer = _method_layer(w.to(dt))
    x = torch.randn(3, 4, k).to(dt)
    y = method.apply(layer, x, bias.to(dt))
    assert y.shape == (3, 4, n) and y.dtype == dt

    # Quantization: symmetric per output row, each weight within half a step of its row's scale.
    q = layer.qweight.double()
    s = layer.scales.double()  # as the kernel reads them (bf16)
    s_exact = w.to(dt).double().abs().amax(1) / 127
    assert q.abs().max() <= 127
    recon_err = (q * s_exact[:, None] - w.to(dt).double()).abs()
    assert bool((recon_err <= s_exact[:, None] / 2 + 1e-12).all())
    assert torch.equal(layer.qweight[5], torch.zeros(k, dtype=torch.int8))

    # Output: float64 product of the bf16 activations and the dequantized weights (the arithmetic
    # the method promises), then rounded once to the output dtype; accumulation in fp32 and
    # the bf16 output rounding are all that may differ.
    xb = x.to(torch.bfloat16).double().reshape(-1, k)
    ref = (xb @ (q * s[:, None]).T + bias.to(dt).double()).reshape(3, 4, n)
    err = (y.double() - ref).abs().max() / ref.abs().max()
    assert err < 2**-7, err
    # Control: the unquantized weights give a visibly different product (the check can fail).
    exact = (xb @ w.to(dt).double().T).reshape(3, 4, n) + bias.to(dt).double()
    assert (exact - ref).abs().max() > (y.double() - ref).abs().max()


def test_dequantizing_fallback_computes_the_same() -> None:
    import torch

    from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import int8_linear

    torch.manual_seed(1)
    method, layer = _method_layer(torch.randn(64, 128) * 0.02)
    x = torch.randn(5, 128, dtype=torch.bfloat16)
    fast = int8_linear(x, layer.qweight, layer.scales, kernel=True)
    slow = int8_linear(x, layer.qweight, layer.scales, kernel=False)
    assert (fast.float() - slow.float()).abs().max() <= 2**-7 * slow.float().abs().max()


# --- the flag, the stage table, the deploy config ----------------------------------------------


def test_bad_flag_value_is_refused_naming_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "w4-group")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_INT8='w4-group'.*off\|w8-channel"):
        envs.validate_all()
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_TALKER_INT8"):
        deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])


def test_flag_selects_the_method_for_the_talker_stage_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_OMNI_TALKER_INT8", raising=False)
    assert envs.get("VLLM_OMNI_TALKER_INT8") == "off"
    stages = deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"]
    assert all("quantization" not in s for s in stages)
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "w8-channel")
    by_id = {s["stage_id"]: s for s in deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"]}
    assert by_id[0]["quantization"] == METHOD and "quantization" not in by_id[1]
    rows = {s.model_stage: stage_settings.stage_quantization(s) for s in stage_settings.QWEN3_TTS_STAGES}
    assert rows == {"qwen3_tts": METHOD, "code2wav": None}


def test_both_roads_give_the_talker_stage_the_method(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """The CPU deploy config through vllm-omni's merge, and plain engine args through the platform
    hook, each resolved by vLLM's own config code; code2wav stays unquantized on both."""
    from vllm_omni.config.stage_config import load_deploy_config, merge_pipeline_deploy
    from vllm_omni.engine.arg_utils import OmniEngineArgs
    from vllm_omni.model_executor.models.qwen3_tts.pipeline import QWEN3_TTS_PIPELINE

    from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import TalkerW8Config

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "w8-channel")
    stages = merge_pipeline_deploy(
        QWEN3_TTS_PIPELINE, load_deploy_config(deploy_config.cpu_deploy_config_path())
    )
    for stage in stages:
        written = stage.yaml_engine_args
        # The deploy road names the method for the talker stage's engine arguments only.
        assert written.get("quantization") == (METHOD if stage.model_stage == "qwen3_tts" else None)
        common = dict(
            model=str(tiny_model_dir),
            stage_id=stage.stage_id,
            model_stage=stage.model_stage,
            model_arch=written["model_arch"],
            worker_type=stage.worker_type,
            trust_remote_code=True,
            max_model_len=512,
        )
        deployed = OmniEngineArgs(**common, quantization=written.get("quantization")).create_engine_config()
        hooked = OmniEngineArgs(**common).create_engine_config()
        for config in (deployed, hooked):
            if stage.model_stage == "qwen3_tts":
                assert config.model_config.quantization == METHOD
                assert isinstance(config.quant_config, TalkerW8Config)
            else:
                assert config.quant_config is None and config.model_config.quantization is None


# --- which layers, and parity on the tiny outliers checkpoint ----------------------------------


@pytest.fixture(scope="module")
def tiny_w8_talker(tiny_outlier_model_dir: Path):
    from omni_cpu_fastpath.qwen3_tts import talker_parity

    return talker_parity.build_talker(tiny_outlier_model_dir, "w8-channel")


def test_only_the_talker_decoder_linears_are_quantized(tiny_w8_talker) -> None:
    import torch
    from torch import nn
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import TalkerW8LinearMethod

    talker, vllm_config = tiny_w8_talker
    quantized = {
        n
        for n, m in talker.named_modules()
        if isinstance(getattr(m, "quant_method", None), TalkerW8LinearMethod)
    }
    layers = len(talker.model.layers)
    expected = {
        f"model.layers.{i}.{name}"
        for i in range(layers)
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    }
    assert quantized == expected
    for name in expected:
        assert talker.get_submodule(name).qweight.dtype == torch.int8
    # Embeddings and the codec head keep float weights; the code predictor's nn.Linear layers too.
    assert talker.lm_head.weight.dtype == torch.bfloat16 and talker.lm_head.weight.numel() > 0
    assert talker.model.embed_tokens.weight.dtype == torch.bfloat16
    cp_linears = [m for m in talker.code_predictor.modules() if isinstance(m, nn.Linear)]
    assert cp_linears and all(m.weight.is_floating_point() for m in cp_linears)
    # The config itself: other vLLM linears get the unquantized method, non-linears None.
    cfg = vllm_config.quant_config
    qkv = talker.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, LinearBase)
    assert isinstance(
        cfg.get_quant_method(qkv, "code_predictor.model.layers.0.self_attn.qkv_proj"), UnquantizedLinearMethod
    )
    assert isinstance(
        cfg.get_quant_method(qkv, "model.layers.0.self_attn.qkv_proj_extra"), UnquantizedLinearMethod
    )
    assert cfg.get_quant_method(talker.lm_head, "lm_head") is None


def test_parity_bounds_on_the_tiny_outliers_checkpoint(tiny_outlier_model_dir: Path) -> None:
    from omni_cpu_fastpath.qwen3_tts import talker_parity

    rows = {
        r["variant"]: r
        for r in talker_parity.talker_parity_table(tiny_outlier_model_dir, positions=64, seqs=2)
    }
    bf16, w8 = rows["bf16"], rows["w8-channel"]
    print(rows)
    # Frozen from measurement (128 positions; README): bf16 top-1 0.977, KL 7.3e-4; w8-channel
    # top-1 0.969, KL 2.7e-3 against fp32, and top-1 0.961, KL 2.6e-3 against bf16.
    assert bf16["top1"] >= 0.95 and bf16["kl"] < 2e-3
    assert w8["top1"] >= 0.93 and w8["kl"] < 6e-3
    assert w8["vs_bf16"]["top1"] >= 0.92 and w8["vs_bf16"]["kl"] < 6e-3
    # It is a measurement, not an identity: int8 differs from bf16.
    assert w8["vs_bf16"]["kl"] > 0


# --- served --------------------------------------------------------------------------------------


@pytest.mark.slow
def test_served_with_the_flag_on_gives_audio(tiny_model_dir: Path, tmp_path: Path) -> None:
    from omni_cpu_fastpath import step_stats
    from omni_cpu_fastpath.serving import commands as serving

    stats = tmp_path / "stats"
    env = {
        "VLLM_OMNI_TALKER_INT8": "w8-channel",
        "VLLM_OMNI_STEP_STATS_DIR": str(stats),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
    }
    frames = 8
    per_frame = serving.sample_rate_of(tiny_model_dir) * 2 // 25  # 80 ms frames
    with serving.running_server(str(tiny_model_dir), tmp_path / "server.log", env=env) as server:
        speech = serving.synthesize(server, "Quantized talker.", max_frames=frames, seed=3)
    samples = round(speech.audio_s * speech.sample_rate)
    assert samples > 0 and samples % per_frame == 0, (samples, per_frame)
    (talker,) = [s for s in step_stats.served_dir(stats).values() if "talker" in s.get("model", "").lower()]
    layers = 2  # tiny
    assert talker["talker.int8"] == f"w8-channel ({4 * layers} decoder linears, _weight_int8pack_mm)", talker
