"""Spark-X2.5 in vLLM's offline ``LLM`` on CPU against the plain-torch reference.

fp32, eager and compiled: greedy tokens equal for 32 steps and every top-20 logprob (of the
generated and of the prompt positions) within 1e-4 of the reference's float64 log-softmax.
Prompts are longer than the tiny window (8) and 32 steps more reach past 6 windows, so the
sliding layers' window, the full layers' partial RoPE and the gate are all exercised.
bf16 (eager; compiled too on a CPU with AMX, where vLLM's CPU linear dispatch takes the other
layers) against the fp32 reference: a bound measured once and frozen here, held by vLLM's bf16
linears and by the package's fp32-prefill ones (``VLLM_OMNI_SPARK_FP32_PREFILL``). Two tensor-parallel
ranks (one core each) hold the head-gate rows of their own heads and decode as the reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from cpu_helpers import native_bf16_by_cpuinfo
from spark_helpers import PROMPTS, STEPS, TOPK, run_llm, spark_tiny_dir  # noqa: F401

from omni_cpu_fastpath.testing.spark_reference import Reference

LOGPROB_TOL = 1e-4
# bf16 (weights, activations, KV cache) against the fp32 reference, tiny model, frozen from a
# measured run with margin: the largest difference of any returned top-20 logprob, of the top-1
# logprob, and how many leading greedy tokens must agree (a near-tie may flip one in bf16).
BF16_TOP20_TOL = 1.0
BF16_TOP1_TOL = 0.35
BF16_AGREE_STEPS = 16


@pytest.fixture(scope="module")
def ref(spark_tiny_dir: Path) -> Reference:  # noqa: F811
    return Reference(spark_tiny_dir)


@pytest.fixture(scope="module")
def expected(ref: Reference) -> list[dict]:
    out = []
    for prompt in PROMPTS:
        tokens, logprobs = ref.greedy(prompt, STEPS)
        prompt_lp = ref.logits(prompt).double().log_softmax(-1)
        out.append({"tokens": tokens, "logprobs": logprobs, "prompt_logprobs": prompt_lp})
    return out


def _max_logprob_diff(got: list[dict | None], want: list[torch.Tensor], steps: int) -> float:
    worst = 0.0
    for d, lp in zip(got[:steps], want[:steps], strict=True):
        if d is None:
            continue
        # vLLM returns the top-20 plus the sampled token; compare every one it returned.
        assert len(d) >= TOPK
        for tok, value in d.items():
            worst = max(worst, abs(value - lp[int(tok)].item()))
    return worst


def _check_fp32(result: dict, expected: list[dict], ranks: int = 1) -> None:
    assert result["hf_config"] == "Spark2_5Config"
    # Every worker's every layer's cos/sin cache has max_model_len rows, not the config's 8192.
    assert result["rope_rows"] == [[256] * 4] * ranks
    for got, want in zip(result["results"], expected, strict=True):
        assert got["tokens"] == want["tokens"]
        assert _max_logprob_diff(got["logprobs"], want["logprobs"], STEPS) <= LOGPROB_TOL
        # Position 0 has no prompt logprob; position i predicts prompt token i from the ones before.
        want_prompt = [want["prompt_logprobs"][i - 1] for i in range(1, len(got["prompt_logprobs"]))]
        assert got["prompt_logprobs"][0] is None
        assert _max_logprob_diff(got["prompt_logprobs"][1:], want_prompt, len(want_prompt)) <= LOGPROB_TOL


def test_llm_eager_fp32_equals_reference(spark_tiny_dir: Path, tmp_path: Path, expected: list[dict]):  # noqa: F811
    _check_fp32(run_llm(spark_tiny_dir, "eager", tmp_path), expected)


def test_llm_compiled_fp32_equals_reference(spark_tiny_dir: Path, tmp_path: Path, expected: list[dict]):  # noqa: F811
    result = run_llm(spark_tiny_dir, "compiled", tmp_path)
    # torch.compile really ran: vLLM wrote its compile cache.
    assert any((tmp_path / "vllm-cache-compiled").rglob("*")), "no torch.compile artefacts"
    _check_fp32(result, expected)


def _check_bf16(result: dict, expected: list[dict]) -> None:
    for got, want in zip(result["results"], expected, strict=True):
        agree = 0
        while agree < STEPS and got["tokens"][agree] == want["tokens"][agree]:
            agree += 1
        assert agree >= BF16_AGREE_STEPS, (agree, got["tokens"], want["tokens"])
        # Up to and including the first differing step, both saw the same context.
        steps = min(agree + 1, STEPS)
        assert _max_logprob_diff(got["logprobs"], want["logprobs"], steps) <= BF16_TOP20_TOL
        for d, lp in zip(got["logprobs"][:steps], want["logprobs"][:steps], strict=True):
            tok, value = max(d.items(), key=lambda kv: kv[1])
            assert abs(value - lp[int(tok)].item()) <= BF16_TOP1_TOL


def _linear_methods(result: dict) -> set[tuple[str, bool]]:
    return {tuple(v) for rank in result["linear_methods"] for v in rank.values()}


def test_llm_bf16_within_the_frozen_bound_of_fp32_reference(
    spark_tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    expected: list[dict],
):
    # vLLM's bf16 linears, then the package's fp32-prefill ones on every decoder linear: the
    # prompts' prefill (15 and 20 rows) in fp32, the decode steps (2 rows) through the few-row
    # kernel. Both hold the same bound; where the CPU multiplies bf16 natively they differ in
    # rounding, so the second path really ran. Where torch emulates bf16, its product also sums
    # each row in fp32 and may give the same bits at these widths.
    from omni_cpu_fastpath import cpu_gemv

    off, on = ({"VLLM_OMNI_SPARK_FP32_PREFILL": v} for v in ("off", "on"))
    stock = run_llm(spark_tiny_dir, "eager-bf16", tmp_path / "off", env=off)
    assert _linear_methods(stock) == {("UnquantizedLinearMethod", False)}
    _check_bf16(stock, expected)
    ours = run_llm(spark_tiny_dir, "eager-bf16", tmp_path / "on", env=on)
    assert _linear_methods(ours) == {("Fp32PrefillLinearMethod", cpu_gemv.wanted())}
    assert len(ours["linear_methods"][0]) == 4  # q_k_v_proj, out_proj, gate_up_proj, down_proj
    _check_bf16(ours, expected)
    if native_bf16_by_cpuinfo():
        assert ours["results"] != stock["results"]


def test_fp32_prefill_linears_only_where_they_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from cpu_helpers import native_bf16_by_cpuinfo
    from vllm.config import CompilationMode

    from omni_cpu_fastpath.fp32_prefill import Fp32PrefillConfig
    from omni_cpu_fastpath.spark.model import decoder_linears_config

    def config(dtype=torch.bfloat16, mode=CompilationMode.NONE, quant=None) -> SimpleNamespace:
        return SimpleNamespace(
            quant_config=quant,
            model_config=SimpleNamespace(dtype=dtype),
            compilation_config=SimpleNamespace(mode=mode),
        )

    monkeypatch.setenv("VLLM_OMNI_SPARK_FP32_PREFILL", "on")
    assert isinstance(decoder_linears_config(config())[0], Fp32PrefillConfig)
    assert decoder_linears_config(config(dtype=torch.float32)) == (
        None,
        "vLLM's unquantized linears (torch.float32: nothing to widen)",
    )
    quant, why = decoder_linears_config(config(mode=CompilationMode.VLLM_COMPILE))
    assert quant is None and "--enforce-eager" in why
    checkpoint = Fp32PrefillConfig()  # stands for a quantized checkpoint's own config
    assert decoder_linears_config(config(quant=checkpoint))[0] is checkpoint
    monkeypatch.setenv("VLLM_OMNI_SPARK_FP32_PREFILL", "off")
    assert decoder_linears_config(config())[0] is None
    monkeypatch.setenv("VLLM_OMNI_SPARK_FP32_PREFILL", "auto")
    got = decoder_linears_config(config())[0]
    assert isinstance(got, Fp32PrefillConfig) == (not native_bf16_by_cpuinfo())
    monkeypatch.setenv("VLLM_OMNI_SPARK_FP32_PREFILL", "fast")
    with pytest.raises(ValueError, match="VLLM_OMNI_SPARK_FP32_PREFILL.*auto"):
        decoder_linears_config(config())


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="needs a CPU with AMX (sgl-kernel)")
def test_llm_compiled_bf16_with_vllm_cpu_linear_dispatch_on_amx(
    spark_tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    expected: list[dict],
):
    # With AMX vLLM routes bf16 linears through sgl-kernel; the gate stays F.linear.
    _check_bf16(run_llm(spark_tiny_dir, "compiled-bf16", tmp_path), expected)


@pytest.mark.slow  # two worker processes
def test_llm_two_tensor_parallel_ranks_equal_reference(
    spark_tiny_dir: Path,  # noqa: F811
    tmp_path: Path,
    ref: Reference,
    expected: list[dict],
):
    """Each rank holds the gate rows of its own heads, and the two ranks decode as the reference
    (with both ranks loading the first heads' rows, the greedy tokens differ)."""
    result = run_llm(spark_tiny_dir, "eager-tp2", tmp_path)
    heads = ref.cfg["num_attention_heads"]
    gate = ref.w["model.layers.0.self_attn.g_proj.weight"][:, :4]
    assert result["gate_rows"] == [gate[: heads // 2].tolist(), gate[heads // 2 :].tolist()]
    _check_fp32(result, expected, ranks=2)
