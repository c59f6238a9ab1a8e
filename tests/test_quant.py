"""int8 predictor variants: flags, refusals, numerics against float64, parity on an outlier checkpoint.

Parity is measured teacher-forced against the fp32 predictor on ``make_model(dims="tiny",
outliers=True)`` (64 frames; the 0.6b table is in README / ``omni-cpu-fastpath parity``), with a
bf16 control in the same run: the faithful variants must meet the default's rule relative to bf16,
and the per-tensor torch.ao variant must fail it (the test can tell).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.qwen3_tts import parity, quant
from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor
from omni_cpu_fastpath.testing.stock import build_stock_predictor

FAITHFUL = ("w8-channel", "w8-bf16head")  # meet the default's rule relative to bf16
PER_TENSOR = ("ao-dynamic", "ao-nohead")
# The documented bounds against fp32 (README, int8 fidelity), stated here, not read from the code.
# The default's rule is relative to the bf16 control: top-1 at most 2 points below, KL at most 3x.
TOP1_SLACK, KL_FACTOR = 0.02, 3.0
# Absolute floors (top-1 at least, KL at most) for the variants the relative rule does not cover:
# the bf16 control; torchao-w8, whose outlier-channel columns are rounded like the rest; and the
# per-tensor torch.ao variants, kept for comparison, which must still not be broken outright.
PARITY_BOUNDS: dict[str, dict[str, float]] = {
    "bf16": {"top1": 0.95, "kl": 0.005},
    "torchao-w8": {"top1": 0.93, "kl": 0.008},
    "ao-dynamic": {"top1": 0.6, "kl": 0.3},
    "ao-nohead": {"top1": 0.6, "kl": 0.3},
}
PARITY_VARIANTS = ["bf16", "ao-dynamic", "ao-nohead", "torchao-w8", "w8-channel", "w8-bf16head"]


def _meets_rule(table: dict[str, dict], variant: str) -> bool:
    row, bf16 = table[variant], table["bf16"]
    return row["top1"] >= bf16["top1"] - TOP1_SLACK and row["kl"] <= KL_FACTOR * bf16["kl"]


@pytest.fixture(autouse=True)
def _threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(min(2, prev))
    yield
    torch.set_num_threads(prev)


# ------------------------------------------------------------------------------------ flags


def test_variants_are_the_flag_choices():
    assert set(quant.CONFIGS) == set(envs.INT8_VARIANTS)
    assert envs.FLAGS["VLLM_OMNI_PREDICTOR_INT8"].choices == envs.INT8_VARIANTS
    for name in envs.INT8_VARIANTS:
        assert quant.config_for(name).name == name
    assert quant.CPU_DEFAULT_VARIANT == "w8-channel" == envs.FLAGS["VLLM_OMNI_PREDICTOR_INT8"].default


def test_unknown_variant_is_named():
    with pytest.raises(quant.QuantError, match=r"'w4-magic'.*VLLM_OMNI_PREDICTOR_INT8.*w8-channel"):
        quant.config_for("w4-magic")


def test_bad_flag_value_fails_before_quantizing(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INT8", "int4")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_PREDICTOR_INT8='int4'"):
        quant.quantize_from_flags(nn.Module())


@pytest.mark.parametrize("variant", PER_TENSOR)
def test_refused_under_compiled_step(variant, monkeypatch):
    with pytest.raises(quant.QuantError) as err:
        quant.quantize_predictor(nn.Module(), variant, compile="step")
    assert f"VLLM_OMNI_PREDICTOR_INT8={variant}" in str(err.value)
    assert "VLLM_OMNI_PREDICTOR_COMPILE=step" in str(err.value)
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INT8", variant)
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", "step")
    with pytest.raises(quant.QuantError, match=variant):
        quant.quantize_from_flags(nn.Module())


@pytest.mark.parametrize("variant", ("off", "torchao-w8") + FAITHFUL)
def test_allowed_under_compiled_step(variant):
    quant.check_compile_combination(variant, "step")
    quant.check_compile_combination(variant, "off")


def test_ao_dynamic_cannot_be_traced_whole():
    # The reason for the refusal: Dynamo cannot put fbgemm's packed-weight object in a full graph.
    lin = quant.AoDynamicConfig().linear(nn.Linear(16, 8))
    fn = torch.compile(lin, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="(?i)script|proxy|unsupported"):
        fn(torch.randn(2, 16))


# ------------------------------------------------------------------------------- numerics


def test_per_channel_rounding_is_within_half_a_step():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g, dtype=torch.float64)
    w[3] = 0.0
    w[5, 7] = 40.0  # one large entry only coarsens its own row
    q, s = quant.quantize_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (64,)
    err = (q.double() * s.double()[:, None] - w).abs()
    assert bool((err <= s.double()[:, None] / 2 + 1e-6).all())
    assert float(err[3].max()) == 0.0
    assert float(s[5]) > 10 * float(s[4])


def _outlier_input(rows: int, k: int, cols: list[int], g: torch.Generator) -> torch.Tensor:
    x = torch.randn(rows, k, generator=g)
    x[:, cols] *= 30.0
    return x


def test_int8_linear_matches_float64_and_outlier_columns_help():
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(256, 192, bias=True).requires_grad_(False)
    with torch.no_grad():
        lin.weight.copy_(0.02 * torch.randn(192, 256, generator=g))
        lin.bias.copy_(0.02 * torch.randn(192, generator=g))
    cols = [3, 77, 200]
    x = _outlier_input(5, 256, cols, g)
    exact = x.double() @ lin.weight.double().t() + lin.bias.double()

    plain = quant.Int8Linear.from_linear(lin)
    split = quant.Int8Linear.from_linear(lin, torch.tensor(cols))
    # Independent float64 model of each module: its own dequantized weight, bf16 activations.
    for mod, kept in ((plain, []), (split, cols)):
        w = mod.qweight.double() * mod.scales.double()[:, None]
        if kept:
            w[:, kept] = lin.weight.double()[:, kept]
        model = x.bfloat16().double() @ w.t() + lin.bias.double()
        if kept:
            model += (x.double()[:, kept] - x.bfloat16().double()[:, kept]) @ w[:, kept].t()
        got = mod(x).double()
        assert got.shape == (5, 192)
        torch.testing.assert_close(got, model, rtol=2e-2, atol=2e-2 * float(model.abs().max()))
    err_plain = float((plain(x).double() - exact).norm())
    err_split = float((split(x).double() - exact).norm())
    assert err_split < 0.7 * err_plain


def test_outlier_channels_from_norm_weight():
    g = torch.ones(512) + 0.05 * torch.randn(512, generator=torch.Generator().manual_seed(2))
    g[[10, 300]] *= 30
    assert quant.outlier_channels(g).tolist() == [10, 300]
    assert quant.outlier_channels(torch.ones(512)).numel() == 0


def test_parity_metrics_against_independent_formulas():
    g = torch.Generator().manual_seed(3)
    ref = 3 * torch.randn(6, 4, 50, generator=g)
    cand = ref + 0.5 * torch.randn(6, 4, 50, generator=g)
    m = parity.parity_metrics(ref, cand)
    for s in range(4):
        r, c = ref[:, s].double(), cand[:, s].double()
        top1 = sum(int(r[b].argmax() == c[b].argmax()) for b in range(6)) / 6
        top5 = sum(
            len(set(r[b].topk(5).indices.tolist()) & set(c[b].topk(5).indices.tolist())) for b in range(6)
        )
        kl = F.kl_div(F.log_softmax(c, -1), F.log_softmax(r, -1), log_target=True, reduction="batchmean")
        assert math.isclose(float(m["top1"][s]), top1)
        assert math.isclose(float(m["top5"][s]), top5 / 30)
        assert math.isclose(float(m["kl"][s]), float(kl), rel_tol=1e-9)
        assert math.isclose(float(m["max_logit_diff"][s]), float((r - c).abs().max()), rel_tol=1e-9)
    same = parity.parity_metrics(ref, ref.clone())
    assert same["top1"].min() == 1 and same["top5"].min() == 1 and float(same["kl"].max()) < 1e-12


def test_parity_metrics_shape_error():
    with pytest.raises(ValueError, match="logits must both be"):
        parity.parity_metrics(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5))


# ------------------------------------------------------------------- predictor integration


@pytest.fixture(scope="module")
def tiny_stock(tiny_outlier_model_dir: Path) -> nn.Module:
    return build_stock_predictor(tiny_outlier_model_dir, torch.float32)


@pytest.fixture(scope="module")
def tiny_inputs(tiny_outlier_model_dir: Path, tiny_stock: nn.Module) -> parity.ParityInputs:
    ref = parity.build_variant(tiny_stock, "fp32")
    return parity.make_inputs(tiny_outlier_model_dir, ref, 8, seed=1)


def _tf_args(inp: parity.ParityInputs) -> tuple[torch.Tensor, ...]:
    return inp.layer0_code, inp.layer0_embed, inp.last_talker_hidden, inp.codes


@pytest.mark.parametrize("variant", ["off", "w8-channel", "w8-bf16head", "torchao-w8", "ao-dynamic"])
def test_stock_and_cached_quantize_alike(tiny_stock, tiny_inputs, variant):
    # Stock wrapper (lm_head list, re-prefill) and cached predictor (stacked heads, KV cache) are
    # independent implementations; quantized the same way they must give the same logits.
    import copy

    stock = quant.quantize_predictor(copy.deepcopy(tiny_stock), variant, compile="off")
    cached = parity.build_variant(tiny_stock, variant)
    a = parity.teacher_forced_logits(stock, *_tf_args(tiny_inputs))
    b = parity.teacher_forced_logits(cached, *_tf_args(tiny_inputs))
    tol = 1e-4 if variant == "off" else 3e-2
    if variant == "ao-dynamic":  # per-tensor scales span 16 positions vs 1: only roughly equal
        tol = 0.5
    torch.testing.assert_close(a, b, rtol=0, atol=tol * float(a.abs().max()))


def test_offline_parity_runs_the_candidate_in_served_batches(tiny_outlier_model_dir, tiny_stock, monkeypatch):
    """A served decode step holds at most the talker stage's max_num_seqs rows, where the few-row
    kernel multiplies them: the offline table must measure those products, not the many-row GEMM
    of all frames at once. 20 frames go as 8 + 8 + 4, each batch the candidate's own logits."""
    from omni_cpu_fastpath.serving.stage_settings import QWEN3_TTS_STAGES

    assert parity.SERVED_ROWS == QWEN3_TTS_STAGES[0].max_num_seqs == 8
    reference = parity.build_variant(tiny_stock, "fp32")
    candidate = parity.build_variant(tiny_stock, "w8-channel")
    inputs = parity.make_inputs(tiny_outlier_model_dir, reference, 20, seed=2)
    seen: list[int] = []
    step = candidate.forward_static_step

    def counted(x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        seen.append(x.shape[0])
        return step(x, *rest)

    monkeypatch.setattr(candidate, "forward_static_step", counted)
    row = parity.measure_parity(reference, candidate, inputs)
    assert row["frames"] == 20 and set(seen) == {8, 4} and seen.count(4) == candidate.num_steps
    monkeypatch.undo()
    args = _tf_args(inputs)
    batched = torch.cat([parity.teacher_forced_logits(candidate, *(a[b] for a in args)) for b in
                         (slice(0, 8), slice(8, 16), slice(16, 20))])  # fmt: skip
    ref = parity.teacher_forced_logits(reference, *args)
    want = parity.summarize_metrics(parity.parity_metrics(ref, batched))
    assert {k: row[k] for k in want} == want


def test_quantizing_twice_is_an_error(tiny_stock):
    cached = parity.build_variant(tiny_stock, "w8-channel")
    with pytest.raises(quant.QuantError, match="not nn.Linear"):
        quant.quantize_predictor(cached, "w8-channel", compile="off")


def test_parity_checker_records_substeps(tiny_stock, tiny_inputs, tmp_path):
    served = parity.build_variant(tiny_stock, "w8-channel")
    reference = parity.build_variant(tiny_stock, "fp32")
    args = (tiny_inputs.layer0_code, tiny_inputs.layer0_embed, tiny_inputs.last_talker_hidden)
    g = torch.Generator().manual_seed(5)
    codes, logits = served.forward_cached(*args, do_sample=True, generator=g, return_logits=True)
    step_stats.configure(tmp_path)
    try:
        checker = parity.ParityChecker(reference, candidate=served)
        res = checker.check(*args, codes, served_logits=logits)
        res2 = checker.check(*args, codes)  # served logits recomputed teacher-forced
        step_stats.end_step()
    finally:
        step_stats.configure("")
    # The served run and its teacher-forced replay on its own codes agree.
    for k in ("top1", "top5"):
        torch.testing.assert_close(res.per_substep[k], res2.per_substep[k])
    torch.testing.assert_close(res.per_substep["kl"], res2.per_substep["kl"], rtol=1e-3, atol=1e-7)
    ref_logits = parity.teacher_forced_logits(reference, *args, codes)
    expected = parity.parity_metrics(ref_logits, logits)
    lines = [json.loads(x) for x in next(tmp_path.glob("*.jsonl")).read_text().splitlines()]
    values = lines[0]["values"]
    for name in ("top1", "top5", "kl", "max_logit_diff"):
        recorded = values[f"predictor.parity.{name}"]
        assert len(recorded) == 2 * 15
        torch.testing.assert_close(torch.tensor(recorded[:15], dtype=torch.float64), expected[name])
    assert 0.8 <= res.summary["top1"] <= 1.0


def test_parity_checker_identical_predictor(tiny_stock, tiny_inputs):
    ref = parity.build_variant(tiny_stock, "fp32")
    same = parity.reference_copy(ref)
    res = parity.ParityChecker(ref, candidate=same).check(*_tf_args(tiny_inputs)[:3], tiny_inputs.codes)
    assert res.summary["top1"] == 1.0 and res.summary["kl"] < 1e-10


def test_reference_copy_keeps_float_weights(tiny_stock):
    served = CachedCodePredictor(__import__("copy").deepcopy(tiny_stock), compile="off", warmup=False)
    reference = parity.reference_copy(served)
    quant.quantize_predictor(served, "w8-channel", compile="off")
    assert isinstance(reference.model.layers[0].self_attn.qkv_proj, nn.Linear)
    assert isinstance(served.model.layers[0].self_attn.qkv_proj, quant.Int8Linear)


# ---------------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def tiny_table(tiny_outlier_model_dir: Path) -> dict[str, dict]:
    rows = parity.parity_table(tiny_outlier_model_dir, frames=64)
    return {r["variant"]: r for r in rows}


@pytest.mark.parametrize("variant", ["bf16", "torchao-w8"])
def test_absolute_bounds(tiny_table, variant):
    row = tiny_table[variant]
    assert row["frames"] == 64
    assert row["top1"] >= PARITY_BOUNDS[variant]["top1"], row
    assert row["kl"] <= PARITY_BOUNDS[variant]["kl"], row


@pytest.mark.parametrize("variant", FAITHFUL)
def test_faithful_variants_meet_the_default_rule(tiny_table, variant):
    assert _meets_rule(tiny_table, variant), (variant, tiny_table[variant], tiny_table["bf16"])
    # The CLI's "ok"/"outside" column says the same.
    assert parity.default_rule(list(tiny_table.values()))[variant]


@pytest.mark.parametrize("variant", PER_TENSOR)
def test_per_tensor_variants_fall_outside_the_default_rule(tiny_table, variant):
    assert not _meets_rule(tiny_table, variant), (variant, tiny_table[variant], tiny_table["bf16"])
    assert not parity.default_rule(list(tiny_table.values()))[variant]
    bound = PARITY_BOUNDS[variant]
    assert tiny_table[variant]["top1"] >= bound["top1"] and tiny_table[variant]["kl"] <= bound["kl"]


def test_cli_parity_json(tiny_outlier_model_dir, capsys):
    from omni_cpu_fastpath.cli import main

    assert main(["parity", str(tiny_outlier_model_dir), "--frames", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in rows] == PARITY_VARIANTS
    for r in rows:
        assert set(r) == {"variant", "top1", "top5", "kl", "max_logit_diff", "frames"}
        assert r["frames"] == 2 and 0.0 <= r["top1"] <= 1.0


# ------------------------------------------------------------------------ compiled vs eager


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["w8-channel", "torchao-w8"])
def test_compiled_step_matches_eager(tiny_stock, tiny_inputs, variant, monkeypatch):
    from omni_cpu_fastpath.qwen3_tts import predictor

    if variant != "w8-channel":
        # Autotuning costs minutes on 2 busy cores: only the default gets the full serving options
        # (torchao-w8 with them matched eager to 6e-6 of 16 in a one-off run).
        monkeypatch.setitem(predictor.INDUCTOR_OPTIONS, "max_autotune", False)
    eager = parity.build_variant(tiny_stock, variant)
    compiled = parity.build_variant(tiny_stock, variant, compile="step", buckets=(1,))
    args = (tiny_inputs.layer0_code[:1], tiny_inputs.layer0_embed[:1], tiny_inputs.last_talker_hidden[:1])
    ce, le = eager.forward_cached(*args, do_sample=False, return_logits=True)
    cc, lc = compiled.forward_cached(*args, do_sample=False, return_logits=True)
    assert compiled.compiler.steps is not None
    torch.testing.assert_close(lc, le, rtol=0, atol=1e-2 * float(le.abs().max()))
    assert torch.equal(cc, ce)


def test_quantizing_drops_a_compiled_step_that_froze_float_weights(tiny_stock):
    cached = parity.build_variant(tiny_stock, "fp32")
    cached.compiler.steps = {1: object()}  # stands in for a compiled step built around the float weights
    quant.quantize_predictor(cached, "w8-channel", compile="off")
    assert cached.compiler.steps is None


def test_prepare_served_predictor_from_flags(tiny_stock, tiny_inputs, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INT8", "w8-channel")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", "off")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_PARITY_CHECK", "1")
    pred, checker, int8 = quant.prepare_served_predictor(parity.build_variant(tiny_stock, "fp32"))
    assert isinstance(pred.model.layers[0].mlp.down_proj, quant.Int8Linear)
    assert isinstance(checker.reference.model.layers[0].mlp.down_proj, nn.Linear)
    assert int8 == "w8-channel"
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_PARITY_CHECK", "0")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INT8", "off")
    same, none, off = quant.prepare_served_predictor(pred)
    assert same is pred and none is None and off == "off"


def test_stacked_int8pack_mm_reads_the_indexed_head() -> None:
    # x @ (q[i] * s[i]).T, computed in float64 from the same bf16 inputs; bf16 output rounding only.
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (15, 64, 128), generator=g, dtype=torch.int8)
    s = (torch.rand(15, 64, generator=g) / 100).to(torch.bfloat16)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16)
    for i in (0, 9, 14):
        want = x.double() @ (q[i].double() * s[i].double()[:, None]).T
        got = quant.stacked_int8pack_mm(x, q, s, torch.tensor([i]))
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)
    torch.library.opcheck(quant.stacked_int8pack_mm, (x, q, s, torch.tensor([2])))


def test_torchao_quantize_applies_an_int8_config(tiny_stock, tiny_inputs):
    """An int8 scheme is a torchao config: torchao's own ``quantize_`` applies it, through the
    handler the package registers, to the same numbers as the flag's road."""
    from torchao.quantization import quantize_

    args = _tf_args(tiny_inputs)
    fp32 = parity.build_variant(tiny_stock, "fp32")
    via_torchao = parity.build_variant(tiny_stock, "fp32")
    quantize_(via_torchao, quant.W8ChannelConfig(), filter_fn=quant.is_code_predictor)
    via_flag = parity.build_variant(tiny_stock, "w8-channel")
    assert isinstance(via_torchao.heads, quant.Int8StackedHeads)
    assert isinstance(via_torchao.model.layers[0].self_attn.qkv_proj, quant.Int8Linear)
    got = parity.teacher_forced_logits(via_torchao, *args)
    torch.testing.assert_close(got, parity.teacher_forced_logits(via_flag, *args), rtol=0, atol=0)
    assert not torch.equal(got, parity.teacher_forced_logits(fp32, *args))
