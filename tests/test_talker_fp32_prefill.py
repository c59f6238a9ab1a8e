"""The talker's bf16 decoder linears with prefills in fp32 (``VLLM_OMNI_TALKER_FP32_PREFILL``,
``quant/talker_fp32_prefill.py``), and with only their decode rows through the few-row kernel
(``VLLM_OMNI_TALKER_DECODE_GEMV``).

References: float64 arithmetic (the linear method), vLLM's own ``UnquantizedLinearMethod`` (fewer
rows than the threshold, and float32 weights, must be it, bit for bit), this CPU's flags as
``/proc/cpuinfo`` lists them (``auto``), vLLM's own model construction (which layers get the
method), and the fp32 talker (teacher-forced codec logits of a prefill: no further from fp32 than
the plain bf16 talker).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from cpu_helpers import decode_gemv_rows_by_cpuinfo, native_bf16_by_cpuinfo, widest_simd_by_cpuinfo

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.serving import deploy_config, stage_settings

METHOD = stage_settings.TALKER_FP32_PREFILL_METHOD
DECODE_METHOD = stage_settings.TALKER_DECODE_GEMV_METHOD


def _method_layer(weight, stock: bool = False, fp32_rows: int | None = 16, gemv_rows: int = 8):
    """A module with ``Fp32PrefillLinearMethod``'s weight (``stock``: vLLM's
    ``UnquantizedLinearMethod``'s), loaded and processed as vLLM's loader does."""
    from torch import nn
    from vllm.config import VllmConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from omni_cpu_fastpath.qwen3_tts.quant.talker_fp32_prefill import Fp32PrefillLinearMethod
    from omni_cpu_fastpath.testing.stock import ensure_single_process_world

    with set_current_vllm_config(VllmConfig()):
        ensure_single_process_world()
        method = UnquantizedLinearMethod() if stock else Fp32PrefillLinearMethod(fp32_rows, gemv_rows)
    layer = nn.Module()
    n, k = weight.shape
    method.create_weights(layer, k, [n], k, n, weight.dtype, weight_loader=lambda p, w: p.data.copy_(w))
    layer.weight.weight_loader(layer.weight, weight)
    method.process_weights_after_loading(layer)
    return method, layer


def _bias_as_vllm_keeps_it(bias, n: int, k: int):
    """Where vLLM's CPU linear takes sgl-kernel's packed product (AMX, small layers), it keeps a
    layer's bias in fp32 and that product refuses a bf16 one: the same values in fp32 there."""
    import torch
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel

    return bias.float() if check_cpu_sgl_kernel(n, k, torch.bfloat16) else bias


def test_method_rounds_the_float64_product_once_from_16_rows_and_is_bf16_linear_below() -> None:
    import torch

    from omni_cpu_fastpath import cpu_gemv
    from omni_cpu_fastpath.qwen3_tts.quant.talker_fp32_prefill import FP32_ROWS

    torch.manual_seed(0)
    n, k = 192, 256
    w = (torch.randn(n, k) * 0.02).bfloat16()
    bias = _bias_as_vllm_keeps_it((torch.randn(n) * 0.1).bfloat16(), n, k)
    method, layer = _method_layer(w)
    stock, stock_layer = _method_layer(w, stock=True)
    assert layer.weight.dtype == torch.bfloat16 and layer.weight.shape == (n, k)  # kept for widening
    # 9-15 rows: vLLM's bf16 product, bit for bit; 1-8 rows (decode): the few-row kernel, the same
    # products accumulated in fp32 with the bias, rounded once (tests/test_cpu_gemv.py bounds it).
    assert layer.cpu_gemv
    x = torch.randn(FP32_ROWS - 1, k).bfloat16()
    assert torch.equal(method.apply(layer, x, bias), stock.apply(stock_layer, x, bias))
    for rows in (1, 8):
        x = torch.randn(1, rows, k).bfloat16()
        x2 = x.reshape(-1, k)
        want = (cpu_gemv.gemv(x2, w, out_dtype=torch.float32) + bias.float()).bfloat16()
        assert torch.equal(method.apply(layer, x, bias), want.reshape(1, rows, n))
        assert torch.equal(method.apply(layer, x), cpu_gemv.gemv(x2, w).reshape(1, rows, n))
    x = torch.randn(4, FP32_ROWS // 2, k).bfloat16()  # 2 x 8 = 16 rows, as a batch of prompts
    y = method.apply(layer, x, bias)
    assert y.shape == (4, FP32_ROWS // 2, n) and y.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + bias.double()
    # One rounding of an fp32-accumulated sum: within one bf16 step of the float64 value, and
    # most outputs equal to its correct rounding.
    ulp = exact.abs().float().bfloat16().float().abs() * 2.0**-7
    err = (y.double() - exact).abs()
    assert bool((err <= ulp.double() + 1e-6).all())
    assert (y == exact.bfloat16()).float().mean() > 0.95
    # vLLM's bf16 product is the same arithmetic in another order: no closer to float64.
    stock_err = (stock.apply(stock_layer, x, bias).double() - exact).abs()
    assert err.mean() <= stock_err.mean() * 1.05 + 1e-9
    # float32 weights: vLLM's method, whatever the rows.
    method32, layer32 = _method_layer(w.float())
    stock32, stock_layer32 = _method_layer(w.float(), stock=True)
    x32 = torch.randn(FP32_ROWS * 2, k)
    assert torch.equal(method32.apply(layer32, x32), stock32.apply(stock_layer32, x32))


def test_decode_rows_are_vllms_product_with_the_kernel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    monkeypatch.setenv("VLLM_OMNI_CPU_GEMV", "0")
    torch.manual_seed(1)
    w = (torch.randn(96, 128) * 0.02).bfloat16()
    method, layer = _method_layer(w)
    stock, stock_layer = _method_layer(w, stock=True)
    assert not layer.cpu_gemv
    for rows in (1, 8):
        x = torch.randn(rows, 128).bfloat16()
        assert torch.equal(method.apply(layer, x), stock.apply(stock_layer, x))


def test_auto_follows_this_cpus_native_bf16_and_flag_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.delenv("VLLM_OMNI_TALKER_FP32_PREFILL", raising=False)
    assert envs.get("VLLM_OMNI_TALKER_FP32_PREFILL") == "auto"
    want = None if native_bf16_by_cpuinfo() else METHOD
    rows = [stage_settings.stage_quantization(s) for s in stage_settings.QWEN3_TTS_STAGES]
    assert rows == [want, None]
    by_id = {s["stage_id"]: s for s in deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"]}
    assert by_id[0].get("quantization") == want and "quantization" not in by_id[1]
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "on")
    assert stage_settings.stage_quantization(stage_settings.QWEN3_TTS_STAGES[0]) == METHOD
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "off")
    assert stage_settings.stage_quantization(stage_settings.QWEN3_TTS_STAGES[0]) is None
    # int8 takes the talker's linears whatever this flag says.
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "on")
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "w8-channel")
    assert stage_settings.stage_quantization(stage_settings.QWEN3_TTS_STAGES[0]) == "omni_cpu_talker_w8"
    # Stock is stock: the fast path off serves no method, and "on" beside it is refused by name.
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
    refused = r"VLLM_OMNI_TALKER_FP32_PREFILL='on'.*VLLM_OMNI_CPU_FASTPATH='0'"
    with pytest.raises(envs.FlagError, match=refused):
        stage_settings.stage_quantization(stage_settings.QWEN3_TTS_STAGES[0])
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "auto")
    assert stage_settings.stage_quantization(stage_settings.QWEN3_TTS_STAGES[0]) is None
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "yes")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_FP32_PREFILL='yes'.*auto\|on\|off"):
        envs.validate_all()


def test_prefill_is_no_further_from_fp32_than_the_bf16_talker(
    tiny_outlier_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from omni_cpu_fastpath.qwen3_tts import talker_parity
    from omni_cpu_fastpath.qwen3_tts.quant import talker_fp32_prefill as prefill
    from omni_cpu_fastpath.testing.stock import build_stock_talker

    ref, cfg = talker_parity.build_talker(tiny_outlier_model_dir, "fp32")
    embeds = talker_parity.make_embeds(ref, 2, 64)
    fp32 = talker_parity.teacher_forced_logits(ref, cfg, embeds)
    bf16_model, bf16_cfg = talker_parity.build_talker(tiny_outlier_model_dir, "bf16")
    bf16 = talker_parity.teacher_forced_logits(bf16_model, bf16_cfg, embeds)
    model, mcfg = build_stock_talker(tiny_outlier_model_dir, torch.bfloat16, quantization=METHOD)
    assert isinstance(mcfg.quant_config, prefill.TalkerFp32PrefillConfig)
    methods = {name: type(m.quant_method) for name, m in model.named_modules() if isinstance(m, LinearBase)}
    decoder = {n for n, cls in methods.items() if cls is prefill.Fp32PrefillLinearMethod}
    layers = len(model.model.layers)
    assert len(decoder) == 4 * layers  # qkv, o, gate_up, down of every layer
    assert all(cls is UnquantizedLinearMethod for n, cls in methods.items() if n not in decoder)
    assert prefill.served_status(model, mcfg.quant_config, torch.bfloat16) == (
        f"fp32 from 16 rows ({4 * layers} decoder linears; 1-8 rows: "
        f"C kernel ({widest_simd_by_cpuinfo()}); other rows in bfloat16)"
    )
    calls: list[int] = []

    def counted(x, weight, bias=None):
        calls.append(x.numel() // x.shape[-1])
        return fp32_linear(x, weight, bias)

    from omni_cpu_fastpath import fp32_prefill  # the method's module, where apply looks it up

    fp32_linear = fp32_prefill.fp32_linear
    monkeypatch.setattr(fp32_prefill, "fp32_linear", counted)
    got = talker_parity.teacher_forced_logits(model, mcfg, embeds)
    assert calls == [2 * 64] * (4 * layers)  # every decoder linear of the prefill took the fp32 road
    # (At the tiny width of 64 its outputs rarely differ from the bf16 product's in any bit.)
    ours, theirs = talker_parity._summary(fp32, got), talker_parity._summary(fp32, bf16)
    assert ours["top1"] >= theirs["top1"] - 0.02, (ours, theirs)
    assert ours["kl"] <= theirs["kl"] * 1.25 + 1e-6, (ours, theirs)
    assert ours["max_logit_diff"] <= theirs["max_logit_diff"] * 1.25, (ours, theirs)


def test_decode_gemv_method_is_vllms_product_but_for_decode_rows() -> None:
    import torch

    from omni_cpu_fastpath import cpu_gemv

    torch.manual_seed(2)
    n, k = 160, 256
    w = (torch.randn(n, k) * 0.02).bfloat16()
    bias = _bias_as_vllm_keeps_it((torch.randn(n) * 0.1).bfloat16(), n, k)
    method, layer = _method_layer(w, fp32_rows=None)
    stock, stock_layer = _method_layer(w, stock=True)
    assert layer.cpu_gemv
    for rows in (1, 3, 8):  # decode steps: the few-row kernel, as the fp32-prefill method's
        x = torch.randn(rows, k).bfloat16()
        want = (cpu_gemv.gemv(x, w, out_dtype=torch.float32) + bias.float()).bfloat16()
        assert torch.equal(method.apply(layer, x, bias), want)
    # Every other call, a prompt's prefill included, is vLLM's bf16 product bit for bit.
    for shape in ((9, k), (16, k), (2, 64, k)):
        x = torch.randn(*shape).bfloat16()
        assert torch.equal(method.apply(layer, x, bias), stock.apply(stock_layer, x, bias)), shape
    # Capped at one row (CPUs with native bf16): two rows are vLLM's product again.
    one, one_layer = _method_layer(w, fp32_rows=None, gemv_rows=1)
    x = torch.randn(1, k).bfloat16()
    assert torch.equal(one.apply(one_layer, x), cpu_gemv.gemv(x, w))
    x = torch.randn(2, k).bfloat16()
    assert torch.equal(one.apply(one_layer, x, bias), stock.apply(stock_layer, x, bias))


def test_decode_gemv_flag_selects_its_method_and_is_refused_where_it_cannot_serve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    talker = stage_settings.QWEN3_TTS_STAGES[0]
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "1")
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "off")
    monkeypatch.delenv("VLLM_OMNI_TALKER_DECODE_GEMV", raising=False)
    assert envs.get("VLLM_OMNI_TALKER_DECODE_GEMV") is False  # off by default: bit-equal to stock
    assert stage_settings.stage_quantization(talker) is None
    monkeypatch.setenv("VLLM_OMNI_TALKER_DECODE_GEMV", "1")
    rows = [stage_settings.stage_quantization(s) for s in stage_settings.QWEN3_TTS_STAGES]
    assert rows == [DECODE_METHOD, None]
    by_id = {s["stage_id"]: s for s in deploy_config.cpu_deploy_overlay("base.yaml", cpus=[0, 1])["stages"]}
    assert by_id[0].get("quantization") == DECODE_METHOD and "quantization" not in by_id[1]
    # The fp32 prefill's method already sends decode rows to the kernel; int8 takes the linears.
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "on")
    assert stage_settings.stage_quantization(talker) == METHOD
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "w8-plain")
    assert stage_settings.stage_quantization(talker) == "omni_cpu_talker_w8_plain"
    monkeypatch.setenv("VLLM_OMNI_TALKER_INT8", "off")
    monkeypatch.setenv("VLLM_OMNI_TALKER_FP32_PREFILL", "off")
    # Its method picks a kernel by the row count: refused beside a compiled talker, by name.
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "vllm")
    refused = r"VLLM_OMNI_TALKER_COMPILE='vllm'.*VLLM_OMNI_TALKER_DECODE_GEMV='1'"
    with pytest.raises(envs.FlagError, match=refused):
        stage_settings.stage_quantization(talker)
    monkeypatch.setenv("VLLM_OMNI_TALKER_COMPILE", "off")
    # Stock is stock: beside the fast path's off switch it is refused, naming both.
    monkeypatch.setenv("VLLM_OMNI_CPU_FASTPATH", "0")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_DECODE_GEMV='1'.*VLLM_OMNI_CPU_FASTPATH='0'"):
        stage_settings.stage_quantization(talker)
    monkeypatch.setenv("VLLM_OMNI_TALKER_DECODE_GEMV", "sometimes")
    with pytest.raises(envs.FlagError, match=r"VLLM_OMNI_TALKER_DECODE_GEMV='sometimes'"):
        envs.validate_all()


def test_decode_gemv_talker_prefills_as_the_bf16_talker(tiny_outlier_model_dir: Path) -> None:
    """vLLM's own model construction gives every decoder linear the method, and a prefill's codec
    logits are the plain bf16 talker's bit for bit (its many-row calls are vLLM's product)."""
    import torch
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    from omni_cpu_fastpath.fp32_prefill import Fp32PrefillLinearMethod
    from omni_cpu_fastpath.qwen3_tts import talker_parity
    from omni_cpu_fastpath.qwen3_tts.quant import talker_fp32_prefill as prefill
    from omni_cpu_fastpath.testing.stock import build_stock_talker

    bf16_model, bf16_cfg = build_stock_talker(tiny_outlier_model_dir, torch.bfloat16)
    model, mcfg = build_stock_talker(tiny_outlier_model_dir, torch.bfloat16, quantization=DECODE_METHOD)
    assert isinstance(mcfg.quant_config, prefill.TalkerDecodeGemvConfig)
    methods = {name: m.quant_method for name, m in model.named_modules() if isinstance(m, LinearBase)}
    decoder = {n for n, m in methods.items() if isinstance(m, Fp32PrefillLinearMethod)}
    layers = len(model.model.layers)
    assert len(decoder) == 4 * layers and all(methods[n].fp32_rows is None for n in decoder)
    # Where torch emulates bf16 the kernel takes 1-8 rows; where this CPU multiplies bf16
    # natively, 1-2 if the kernel does too (vdpbf16ps), else one.
    rows = decode_gemv_rows_by_cpuinfo()
    assert {methods[n].gemv_rows for n in decoder} == {rows}
    assert all(type(m) is UnquantizedLinearMethod for n, m in methods.items() if n not in decoder)
    assert prefill.served_status(model, mcfg.quant_config, torch.bfloat16) == (
        f"model dtype (bfloat16; {4 * layers} decoder linears; {'1 row' if rows == 1 else f'1-{rows} rows'}: "
        f"C kernel ({widest_simd_by_cpuinfo()}); other rows in bfloat16)"
    )
    embeds = talker_parity.make_embeds(bf16_model, 2, 32)
    want = talker_parity.teacher_forced_logits(bf16_model, bf16_cfg, embeds)
    got = talker_parity.teacher_forced_logits(model, mcfg, embeds)
    assert torch.equal(got, want)
