"""Spark-X2.5: the random checkpoint's layout, the config class, and the plain-torch reference
against mlx-lm's in-tree ``spark2_5`` model (an independent implementation), all in fp32.

The parity bound (logits SNR >= 110 dB, max abs <= 1e-4, identical top-5 at every position of a
sequence at least twice the window) is shown to be discriminating: the reference with one
deliberate error (window off by one, RoPE denominator head_dim, tanh GELU, gate after the head
merge) fails it against the same mlx-lm logits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from spark_helpers import mlx_python_or_fail, spark_tiny_dir  # noqa: F401

from omni_cpu_fastpath.spark.config import Spark2_5Config, SparkConfigError
from omni_cpu_fastpath.testing import spark_reference as reference
from omni_cpu_fastpath.testing.spark_checkpoint import config_dict, tensor_shapes

SNR_DB, MAX_ABS, TOP = 110.0, 1e-4, 5


def _ids(cfg: dict, n: int) -> list[int]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(16, cfg["vocab_size"], (n,), generator=g).tolist()


def _bound_failures(ref: torch.Tensor, test: torch.Tensor) -> list[str]:
    fails = []
    snr = reference.snr_db(ref, test)
    if snr < SNR_DB:
        fails.append(f"SNR {snr:.1f} dB < {SNR_DB}")
    err = (ref - test).abs().max().item()
    if err > MAX_ABS:
        fails.append(f"max abs {err:.2e} > {MAX_ABS}")
    if not torch.equal(ref.topk(TOP, -1).indices, test.topk(TOP, -1).indices):
        fails.append("top-5 differs")
    return fails


@pytest.fixture(scope="module")
def parity(spark_tiny_dir: Path) -> dict:  # noqa: F811
    py = mlx_python_or_fail()
    cfg = json.loads((spark_tiny_dir / "config.json").read_text())
    ids = _ids(cfg, 6 * cfg["sliding_window"])
    return {
        "dir": spark_tiny_dir,
        "cfg": cfg,
        "ids": ids,
        "mlx": reference.mlx_logits(spark_tiny_dir, ids, python=py),
    }


def test_tiny_checkpoint_has_the_released_layout_and_crosses_every_boundary(spark_tiny_dir: Path):  # noqa: F811
    cfg = json.loads((spark_tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["Spark2_5ForCausalLM"] and cfg["model_type"] == "spark2_5"
    assert cfg["auto_map"]["AutoConfig"] == "configuration_spark.Spark2_5Config"
    assert set(cfg["layer_types"]) == {"sliding_attention", "full_attention"}
    assert cfg["num_attention_heads"] * cfg["head_dim"] != cfg["hidden_size"]  # as the 4B
    with safe_open(str(spark_tiny_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in names}
    assert "model.embedding.weight" in names and not any("lm_head" in n or "embed_tokens" in n for n in names)
    assert shapes["model.layers.0.self_attn.q_k_v_proj.weight"] == (128 + 2 * 64, 64)
    assert shapes["model.layers.0.self_attn.g_proj.weight"] == (4, 64)
    assert shapes["model.layers.3.self_attn.out_proj.weight"] == (64, 128)
    assert shapes == tensor_shapes(cfg)


@pytest.mark.parametrize("dims,params", [("1.7b", 1_707_657_216), ("4b", 4_112_079_360)])
def test_released_dims_have_the_released_parameter_counts(dims: str, params: int):
    shapes = tensor_shapes(config_dict(dims))
    assert sum(torch.Size(s).numel() for s in shapes.values()) == params


def test_released_config_loads_without_remote_code_and_keeps_per_layer_rope(spark_tiny_dir: Path):  # noqa: F811
    from transformers import AutoConfig

    AutoConfig.register("spark2_5", Spark2_5Config, exist_ok=True)
    cfg = AutoConfig.from_pretrained(spark_tiny_dir, trust_remote_code=False)
    assert isinstance(cfg, Spark2_5Config)
    assert set(cfg.rope_parameters) == {"full_attention", "sliding_attention"}
    assert cfg.rotary_dim("full_attention") == 8 and cfg.rotary_dim("sliding_attention") == 32
    assert "rope_theta" not in cfg.to_dict() and "rope_theta" not in cfg.rope_parameters


@pytest.mark.parametrize(
    "change,words",
    [
        ({"layer_types": ["sliding_attention"] * 3 + ["chunked"]}, ["layer_types", "chunked"]),
        ({"layer_types": ["full_attention"] * 3}, ["layer_types", "3", "num_hidden_layers=4"]),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e4}}}, ["sliding_attention", "rope_"]),
        ({"hidden_act": "gelu_pytorch_tanh"}, ["hidden_act", "gelu_pytorch_tanh"]),
        ({"gate_attn_act_mode": "silu"}, ["gate_attn_act_mode", "silu"]),
        ({"headwise_attn_output_gate": False}, ["headwise_attn_output_gate"]),
        ({"tie_word_embeddings": False}, ["tie_word_embeddings"]),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e4, "partial_rotary_factor": 0.3},
                              "sliding_attention": {"rope_theta": 1e4}}}, ["partial_rotary_factor", "9"]),
    ],
)  # fmt: skip
def test_bad_config_values_are_refused_by_name(change: dict, words: list[str]):
    cfg = config_dict("tiny")
    cfg.update(change)
    cfg.pop("model_type")
    with pytest.raises(SparkConfigError) as err:
        Spark2_5Config(**cfg)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_reference_matches_mlx_lm_over_twice_the_window(parity: dict):
    ids = parity["ids"]
    assert len(ids) >= 2 * parity["cfg"]["sliding_window"]
    ref = reference.Reference(parity["dir"]).logits(ids)
    assert _bound_failures(ref, parity["mlx"]) == []


@pytest.mark.parametrize("variant", [v for v in reference.VARIANTS if v != "exact"])
def test_parity_bound_rejects_each_deliberate_error(parity: dict, variant: str):
    wrong = reference.Reference(parity["dir"], variant=variant).logits(parity["ids"])
    assert _bound_failures(wrong, parity["mlx"]), f"{variant} passed the bound: it does not discriminate"


def test_reference_fp32_agrees_with_float64(spark_tiny_dir: Path):  # noqa: F811
    cfg = json.loads((spark_tiny_dir / "config.json").read_text())
    ids = _ids(cfg, 3 * cfg["sliding_window"])
    f32 = reference.Reference(spark_tiny_dir).logits(ids)
    f64 = reference.Reference(spark_tiny_dir, dtype=torch.float64).logits(ids)
    assert reference.snr_db(f64, f32) >= SNR_DB


def test_flag_off_registers_nothing_and_bad_flag_is_named():
    code = (
        "import os\n"
        "from omni_cpu_fastpath.spark import plugin\n"
        "plugin.register()\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        "from vllm import ModelRegistry\n"
        "from vllm.tool_parsers.abstract_tool_parser import ToolParserManager\n"
        "print('spark2_5' in CONFIG_MAPPING, 'Spark2_5ForCausalLM' in ModelRegistry.get_supported_archs(),"
        " 'spark25' in ToolParserManager.list_registered())\n"
    )
    env = {**os.environ, "VLLM_OMNI_SPARK": "0"}
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-3000:]
    assert off.stdout.split()[-3:] == ["False", "False", "False"]
    on = subprocess.run([sys.executable, "-c", code], env={**env, "VLLM_OMNI_SPARK": "1"},
                        capture_output=True, text=True, timeout=300)  # fmt: skip
    assert on.returncode == 0, on.stderr[-3000:]
    assert on.stdout.split()[-3:] == ["True", "True", "True"]
    bad = subprocess.run([sys.executable, "-c", code], env={**env, "VLLM_OMNI_SPARK": "maybe"},
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode != 0 and "VLLM_OMNI_SPARK='maybe'" in bad.stderr
