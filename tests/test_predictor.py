"""The KV-cached code predictor against vllm-omni's stock predictor and the qwen-tts reference.

References: vllm-omni's own ``Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM`` (its eager
forward and its sampling), a teacher-forced re-prefill through the stock ``model`` /
``lm_head`` modules, qwen-tts's ``generate`` (subprocess in ``.venv-ref``) and float64 sampling
computations written here. Only the tiny model is compiled (one bucket), to keep CI time sane.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.qwen3_tts.parity import teacher_forced_logits
from omni_cpu_fastpath.qwen3_tts.predictor import (
    INDUCTOR_OPTIONS,
    CachedCodePredictor,
    bucket_compile_options,
    cached_attention,
    sample_codes,
    stacked_linear,
)

STEPS = 15


# ------------------------------------------------------------------------------------------------
# helpers


def _stock(model_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from omni_cpu_fastpath.testing.stock import build_stock_predictor

    return build_stock_predictor(model_dir, dtype)


def _inputs(model_dir: Path, rows: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Talker hidden ``[B, 1, Ht]``, layer-0 codes ``[B, 1]`` and their talker embeddings."""
    from omni_cpu_fastpath.testing.reference import random_inputs
    from omni_cpu_fastpath.testing.stock import layer0_embedding

    r = random_inputs(model_dir, rows, seed)
    return {
        "layer0_code": r["layer0_codes"].reshape(rows, 1),
        "layer0_embed": layer0_embedding(model_dir, r["layer0_codes"], dtype),
        "last_talker_hidden": r["talker_hidden"].to(dtype).unsqueeze(1),
    }


def _row(inp: dict, i: int) -> dict:
    return {k: v[i : i + 1] for k, v in inp.items()}


@torch.inference_mode()
def _stock_teacher_forced(stock: torch.nn.Module, inp: dict, codes: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, 15, V]`` of the stock modules, one causal re-prefill over the whole frame."""
    bsz = codes.shape[0]
    dtype = next(stock.model.parameters()).dtype
    proj = stock.small_to_mtp_projection
    parts = [inp["last_talker_hidden"].to(dtype), inp["layer0_embed"].to(dtype)]
    parts += [stock.model.codec_embedding[s](codes[:, s + 1]).unsqueeze(1) for s in range(STEPS - 1)]
    x = proj(torch.cat(parts, dim=1))
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand(bsz, -1)
    hidden = stock.model(x, pos)
    return torch.stack([stock.lm_head[s](hidden[:, s + 1]).float() for s in range(STEPS)], dim=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


def _gens(n: int, base: int = 100) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(base + i) for i in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> dict:
    stock = _stock(tiny_model_dir)
    return {
        "dir": tiny_model_dir,
        "stock": stock,
        "cached": CachedCodePredictor.from_stock(stock, compile="off", threads=0),
        "inp": _inputs(tiny_model_dir, 4, seed=1),
    }


# ------------------------------------------------------------------------------------------------
# parity with the stock predictor and the reference


def test_greedy_codes_equal_stock_tiny(tiny: dict) -> None:
    ref = tiny["stock"](**tiny["inp"], do_sample=False)
    got = tiny["cached"](**tiny["inp"], do_sample=False)
    assert got.shape == (4, 16) and got.dtype == torch.long
    assert torch.equal(got, ref)


def test_teacher_forced_logits_match_stock_tiny(tiny: dict) -> None:
    codes = torch.randint(0, 2048, (4, 16), generator=torch.Generator().manual_seed(5))
    ref = _stock_teacher_forced(tiny["stock"], tiny["inp"], codes)
    got = teacher_forced_logits(tiny["cached"], **tiny["inp"], codes=codes)
    assert got.shape == ref.shape == (4, STEPS, 2048)
    assert _rel(got, ref) < 1e-4


def test_greedy_and_teacher_forced_match_qwen_tts_reference_tiny(tiny: dict, qwen_tts_reference) -> None:
    reference = qwen_tts_reference
    inp = tiny["inp"]
    out = reference.run_reference(tiny["dir"], inp["last_talker_hidden"][:, 0], inp["layer0_code"][:, 0])
    got = tiny["cached"](**inp, do_sample=False)
    assert torch.equal(got, out["codes"].long())
    tf = teacher_forced_logits(tiny["cached"], **inp, codes=out["teacher_codes"].long())
    assert _rel(tf, out["teacher_logits"]) < 1e-4


def test_projection_layout_tiny_proj(make_checkpoint, qwen_tts_reference) -> None:
    """The 1.7B layout: talker wider than the predictor, a projection in front of it."""
    reference = qwen_tts_reference

    model_dir = make_checkpoint(dims="tiny-proj", seed=3)
    stock = _stock(model_dir)
    assert isinstance(stock.small_to_mtp_projection, torch.nn.Linear)
    cached = CachedCodePredictor.from_stock(stock, compile="off")
    assert cached.small_to_mtp_projection is stock.small_to_mtp_projection
    inp = _inputs(model_dir, 3, seed=2)
    greedy = cached(**inp, do_sample=False)
    assert torch.equal(greedy, stock(**inp, do_sample=False))
    assert torch.equal(cached(**inp, generators=_gens(3)), stock(**inp, generators=_gens(3)))
    codes = torch.randint(0, 2048, (3, 16), generator=torch.Generator().manual_seed(9))
    assert (
        _rel(teacher_forced_logits(cached, **inp, codes=codes), _stock_teacher_forced(stock, inp, codes))
        < 1e-4
    )
    out = reference.run_reference(model_dir, inp["last_talker_hidden"][:, 0], inp["layer0_code"][:, 0])
    assert torch.equal(greedy, out["codes"].long())


@pytest.mark.slow
def test_greedy_and_teacher_forced_0p6b(model_0p6b_dir: Path, qwen_tts_reference) -> None:
    reference = qwen_tts_reference

    torch.set_num_threads(min(2, torch.get_num_threads()))
    stock = _stock(model_0p6b_dir)
    cached = CachedCodePredictor.from_stock(stock, compile="off")
    inp = _inputs(model_0p6b_dir, 2, seed=4)
    greedy, logits = cached.forward_cached(**inp, do_sample=False, return_logits=True)
    assert torch.equal(greedy, stock(**inp, do_sample=False))
    # The loop's own logits are the teacher-forced logits of its greedy codes.
    assert _rel(logits, _stock_teacher_forced(stock, inp, greedy)) < 1e-4
    out = reference.run_reference(model_0p6b_dir, inp["last_talker_hidden"][:, 0], inp["layer0_code"][:, 0])
    assert torch.equal(greedy, out["codes"].long())
    tf = teacher_forced_logits(cached, **inp, codes=out["teacher_codes"].long())
    assert _rel(tf, out["teacher_logits"]) < 1e-4


# ------------------------------------------------------------------------------------------------
# seeded sampling


@pytest.mark.parametrize("top_k", [50, 0])
def test_seeded_sampling_per_row_generators_equal_stock(tiny: dict, top_k: int) -> None:
    kw = {"do_sample": True, "temperature": 0.9, "top_k": top_k}
    ref = tiny["stock"](**tiny["inp"], **kw, generators=_gens(4))
    got = tiny["cached"](**tiny["inp"], **kw, generators=_gens(4))
    assert torch.equal(got, ref)
    # Seeds matter: another seed gives other codes (so the equality above is not vacuous).
    assert not torch.equal(tiny["cached"](**tiny["inp"], **kw, generators=_gens(4, base=7)), ref)


def test_seeded_sampling_shared_and_none_generators_equal_stock(tiny: dict) -> None:
    def gens() -> list:
        g = torch.Generator().manual_seed(11)
        return [g, None, g, torch.Generator().manual_seed(12)]

    torch.manual_seed(0)
    ref = tiny["stock"](**tiny["inp"], generators=gens())
    state_ref = torch.get_rng_state()
    torch.manual_seed(0)
    got = tiny["cached"](**tiny["inp"], generators=gens())
    assert torch.equal(got, ref)
    assert torch.equal(torch.get_rng_state(), state_ref)


def test_seeded_sampling_batch_generator_equal_stock(tiny: dict) -> None:
    ref = tiny["stock"](**tiny["inp"], temperature=0.7, generator=torch.Generator().manual_seed(3))
    got = tiny["cached"](**tiny["inp"], temperature=0.7, generator=torch.Generator().manual_seed(3))
    assert torch.equal(got, ref)


def test_sample_uniforms_used_as_given(tiny: dict) -> None:
    u = torch.rand(4, STEPS, 2048, generator=torch.Generator().manual_seed(8)).clamp_(1e-6, 1 - 1e-6)
    ref = tiny["stock"](**tiny["inp"], top_k=20, sample_uniforms=u)
    got = tiny["cached"](**tiny["inp"], top_k=20, sample_uniforms=u)
    assert torch.equal(got, ref)


def test_bf16_matches_stock(tiny_model_dir: Path) -> None:
    """bf16 weights and activations, as the stock path: as faithful to the fp32 model as stock's own
    bf16 run. Codes are not compared: oneDNN accumulates a [B, H] GEMM differently from the stock
    [B*17, H] one, so on this random model's flat logits one bf16 rounding step flips a greedy
    near-tie in about half of these frames (served, both run the same shapes: there the codes are
    compared, test_served_equals_stock.py)."""
    stock = _stock(tiny_model_dir, torch.bfloat16)
    stock_fp32 = _stock(tiny_model_dir)
    cached = CachedCodePredictor.from_stock(stock, compile="off")
    assert cached.dtype == torch.bfloat16
    for seed in (6, 7):
        inp = _inputs(tiny_model_dir, 3, seed=seed, dtype=torch.bfloat16)
        greedy, logits = cached.forward_cached(**inp, do_sample=False, return_logits=True)
        assert torch.equal(greedy[:, 1:], logits.argmax(-1))
        # Every model teacher-forced on these codes, from the same bf16 inputs.
        inp_fp32 = {k: v.float() if v.is_floating_point() else v for k, v in inp.items()}
        exact = _stock_teacher_forced(stock_fp32, inp_fp32, greedy)
        stock_bf16 = _stock_teacher_forced(stock, inp, greedy)
        assert _rel(logits, stock_bf16) < 2e-2
        assert _rel(logits, exact) < 1.5 * _rel(stock_bf16, exact)


def test_rows_are_independent(tiny: dict) -> None:
    inp, cached = tiny["inp"], tiny["cached"]
    greedy = cached(**inp, do_sample=False)
    sampled = cached(**inp, top_p=0.8, generators=_gens(4))
    for i in range(4):
        assert torch.equal(cached(**_row(inp, i), do_sample=False), greedy[i : i + 1])
        assert torch.equal(cached(**_row(inp, i), top_p=0.8, generators=[_gens(4)[i]]), sampled[i : i + 1])


# ------------------------------------------------------------------------------------------------
# top-p against float64


def _f64_sample(
    logits: torch.Tensor, u: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Reference: temperature, top-k, then the smallest set with cumulative prob >= p, Gumbel-max."""
    out = []
    for row, urow in zip(logits.double(), u.double(), strict=True):
        scaled = row / temperature
        order = scaled.argsort(descending=True)
        keep = torch.zeros_like(scaled, dtype=torch.bool)
        kk = order[:top_k] if top_k > 0 else order
        probs = torch.softmax(scaled[kk], dim=0)
        cum = torch.cumsum(probs, dim=0)
        n = int((cum < top_p).sum()) + 1  # smallest prefix reaching p
        keep[kk[: min(n, len(kk))]] = True
        noisy = torch.where(
            keep, scaled - torch.log(-torch.log(urow)), torch.tensor(float("-inf"), dtype=torch.float64)
        )
        out.append(int(noisy.argmax()))
    return torch.tensor(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_attention_against_float64(dtype: torch.dtype) -> None:
    """The step's attention over the static cache: grouped heads, the prefill's two rows and one
    row per later position, each masked to its prefix (the cache beyond it holds junk)."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, positions, dim = 8, 2, 17, 32
    k = torch.randn(2, kv_heads, positions, dim, generator=g)
    v = torch.randn(2, kv_heads, positions, dim, generator=g)
    table = torch.ones(positions, positions, dtype=torch.bool).tril()
    for rows in (slice(0, 2), slice(5, 6), slice(16, 17)):
        q = torch.randn(2, heads, rows.stop - rows.start, dim, generator=g)
        mask = table[rows]
        got = cached_attention(q.to(dtype), k.to(dtype), v.to(dtype), mask, dim**-0.5)
        qd, kd, vd = (t.to(dtype).double() for t in (q, k, v))
        ref = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
        assert got.dtype == dtype and got.shape == ref.shape
        # fp32: summation order only; bf16: the output's own rounding (8 bits) and nothing more
        tol = 1e-5 if dtype == torch.float32 else 2.0**-8 * float(ref.abs().max())
        assert float((got.double() - ref).abs().max()) < tol, rows


@pytest.mark.parametrize("top_p,top_k", [(0.5, 50), (0.9, 0), (0.2, 10), (1.0, 30)])
def test_sample_codes_top_p_against_float64(top_p: float, top_k: int) -> None:
    g = torch.Generator().manual_seed(int(top_p * 100) + top_k)
    logits = torch.randn(64, 2048, generator=g) * 3
    u = torch.rand(64, 2048, generator=g).clamp_(1e-12, 1 - 1e-7)
    temperature = 0.8
    k = 2048 if top_k <= 0 else top_k
    sampling = torch.tensor([1 / temperature, 2048 - k, top_p])
    got = sample_codes(logits, u, sampling, torch.tensor(False))
    assert torch.equal(got, _f64_sample(logits, u, temperature, top_k, top_p))


def test_predictor_top_p_against_float64(tiny: dict) -> None:
    """End to end: the codes of a top-p call are the float64 samples of the stock model's logits."""
    inp = tiny["inp"]
    u = torch.rand(4, STEPS, 2048, generator=torch.Generator().manual_seed(21)).clamp_(1e-12, 1 - 1e-7)
    codes = tiny["cached"](**inp, temperature=0.9, top_k=50, top_p=0.6, sample_uniforms=u)
    logits = _stock_teacher_forced(tiny["stock"], inp, codes)
    for s in range(STEPS):
        assert torch.equal(codes[:, s + 1], _f64_sample(logits[:, s], u[:, s], 0.9, 50, 0.6)), f"sub-step {s}"
    # top-p really restricts: with p small every code is the row's argmax
    narrow = tiny["cached"](**inp, temperature=0.9, top_k=50, top_p=1e-6, sample_uniforms=u)
    assert torch.equal(narrow, tiny["cached"](**inp, do_sample=False))


# ------------------------------------------------------------------------------------------------
# compiled step (tiny only)


@pytest.fixture(scope="module")
def compiled(tiny: dict) -> CachedCodePredictor:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    # Bucket 1 compiles with the CPP GEMM template alone, bucket 4 autotunes (bucket_compile_options).
    pred = CachedCodePredictor.from_stock(tiny["stock"], compile="step", buckets=(1, 4))
    assert pred.compile_mode == "step", "compiling the tiny step failed (see the warning log)"
    return pred


@pytest.mark.slow
def test_compiled_equals_eager(tiny: dict, compiled: CachedCodePredictor) -> None:
    inp = {k: v[:3] for k, v in tiny["inp"].items()}  # 3 rows, padded to the bucket of 4
    eager = tiny["cached"]
    g_e, l_e = eager.forward_cached(**inp, do_sample=False, return_logits=True)
    g_c, l_c = compiled.forward_cached(**inp, do_sample=False, return_logits=True)
    assert torch.equal(g_c, g_e)
    assert float((l_c - l_e).abs().max()) < 1e-5
    seeded = compiled(**inp, generators=_gens(3))  # fresh generators for every call
    assert torch.equal(seeded, eager(**inp, generators=_gens(3)))
    assert torch.equal(seeded, tiny["stock"](**inp, generators=_gens(3)))
    top_p = compiled(**inp, top_p=0.7, top_k=0, generators=_gens(3))
    assert torch.equal(top_p, eager(**inp, top_p=0.7, top_k=0, generators=_gens(3)))
    assert not torch.equal(top_p, seeded)
    one = {k: v[1:2] for k, v in tiny["inp"].items()}  # the batch-1 bucket
    g1_e, l1_e = eager.forward_cached(**one, do_sample=False, return_logits=True)
    g1_c, l1_c = compiled.forward_cached(**one, do_sample=False, return_logits=True)
    assert torch.equal(g1_c, g1_e) and torch.equal(g1_c, g_e[1:2])
    assert float((l1_c - l1_e).abs().max()) < 1e-5
    assert torch.equal(compiled(**one, generators=_gens(1)), eager(**one, generators=_gens(1)))
    # one graph per shape: no recompilation on later calls
    assert compiled.compile_mode == "step"


@pytest.mark.slow
def test_compiled_step_serves_under_another_thread_count(tiny: dict, compiled: CachedCodePredictor) -> None:
    """The talker's step-down (VLLM_OMNI_CORE_SHARING) calls the predictor with one torch thread
    while code2wav decodes. Dynamo guards the thread count a step was compiled at: the call runs at
    that count (restored after) and the step stays compiled, rather than failing its guards and
    dropping every bucket to eager."""
    from omni_cpu_fastpath.cpu_threads import set_torch_threads

    warmed = compiled.compiler.thread_counts[0]
    assert warmed >= 1
    other = 1 if warmed > 1 else 2
    one = {k: v[1:2] for k, v in tiny["inp"].items()}
    want, want_logits = tiny["cached"].forward_cached(**one, do_sample=False, return_logits=True)
    prev = torch.get_num_threads()
    set_torch_threads(other)
    try:
        got, logits = compiled.forward_cached(**one, do_sample=False, return_logits=True)
        assert torch.get_num_threads() == other
    finally:
        set_torch_threads(prev)
    assert compiled.compile_mode == "step", compiled.compile_status
    assert "dropped" not in compiled.compile_status, compiled.compile_status
    assert torch.equal(got, want)
    assert float((logits - want_logits).abs().max()) < 1e-5


@pytest.mark.slow
def test_compiled_gemm_templates_do_not_follow_the_thread_count(compiled: CachedCodePredictor) -> None:
    """A step compiled around Inductor's GEMMs on frozen weights is built for one thread count:
    asked to follow the runner's count sub-step by sub-step, it says why not and keeps the call's."""
    why = compiled.follow_threads(lambda: 1, (1, 2))
    assert why is not None and "frozen weights" in why, why
    assert compiled._follow_threads is None
    assert compiled.compiler.thread_counts == compiled.compiler.thread_counts[:1]


@pytest.mark.slow
def test_compiled_beyond_largest_bucket_runs_eager(tiny: dict, compiled: CachedCodePredictor) -> None:
    inp = _inputs(tiny["dir"], 5, seed=9)
    assert torch.equal(compiled(**inp, do_sample=False), tiny["stock"](**inp, do_sample=False))


def test_compile_failure_falls_back_to_eager(tiny: dict, vllm_caplog: pytest.LogCaptureFixture) -> None:
    with vllm_caplog.at_level(logging.WARNING, logger="vllm.omni_cpu_fastpath.qwen3_tts.predictor"):
        pred = CachedCodePredictor.from_stock(
            tiny["stock"], compile="step", buckets=(1,), compile_options={"no_such_inductor_option": 1}
        )
    assert pred.compile_mode == "off"
    assert "torch.compile of the step failed" in vllm_caplog.text
    assert "retrying" not in vllm_caplog.text  # options without GEMM backends: one attempt


def test_batch1_bucket_tries_the_cpp_template_alone_then_with_aten(
    tiny: dict, vllm_caplog: pytest.LogCaptureFixture
) -> None:
    assert [o["max_autotune_gemm_backends"] for o in bucket_compile_options(INDUCTOR_OPTIONS, 1)] == [
        "CPP",
        "CPP,ATEN",
    ]
    assert bucket_compile_options(INDUCTOR_OPTIONS, 8) == [INDUCTOR_OPTIONS]
    custom = {"max_autotune_gemm_backends": "ATEN"}
    assert bucket_compile_options(custom, 1) == [custom]
    # Both attempts fail here (an unknown option): the retry is logged, then the eager fallback.
    options = {"max_autotune_gemm_backends": "CPP,ATEN", "no_such_inductor_option": 1}
    with vllm_caplog.at_level(logging.WARNING, logger="vllm.omni_cpu_fastpath.qwen3_tts.predictor"):
        pred = CachedCodePredictor.from_stock(
            tiny["stock"], compile="step", buckets=(1,), compile_options=options
        )
    text = vllm_caplog.text
    assert "retrying with CPP,ATEN" in text and "torch.compile of the step failed" in text
    assert text.index("retrying with CPP,ATEN") < text.index("torch.compile of the step failed")
    assert pred.compile_mode == "off"


# ------------------------------------------------------------------------------------------------
# weights, flags, stats, bad input


def test_shares_stock_weights_and_names(tiny: dict) -> None:
    stock, cached = tiny["stock"], tiny["cached"]
    assert set(cached.state_dict()) == set(stock.state_dict())
    for name, p in cached.named_parameters():
        assert p is dict(stock.named_parameters())[name]
    # The stacked tables are the head / embedding storage, not copies.
    for s in range(STEPS):
        assert cached.heads.weight[s].data_ptr() == stock.lm_head[s].weight.data_ptr()
        assert cached.embeddings.weight[s].data_ptr() == stock.model.codec_embedding[s].weight.data_ptr()


def test_load_weights_through_stock_mapping(tiny_model_dir: Path, make_checkpoint) -> None:
    from omni_cpu_fastpath.testing.stock import PREDICTOR_PREFIX, iter_checkpoint

    other = make_checkpoint(dims="tiny", seed=11)
    cached = CachedCodePredictor.from_stock(_stock(tiny_model_dir), compile="off")
    loaded = cached.load_weights(
        (n[len(PREDICTOR_PREFIX) :], t) for n, t in iter_checkpoint(other, PREDICTOR_PREFIX)
    )
    assert loaded == {n for n, _ in cached.named_parameters()}
    fresh = _stock(other)
    inp = _inputs(other, 2, seed=3)
    assert torch.equal(cached(**inp, do_sample=False), fresh(**inp, do_sample=False))


def test_dtype_conversion_keeps_tables_shared(tiny_model_dir: Path) -> None:
    stock = _stock(tiny_model_dir)
    cached = CachedCodePredictor.from_stock(stock, compile="off").to(torch.bfloat16)
    assert cached.heads.weight.dtype == torch.bfloat16
    assert cached.heads.weight[3].data_ptr() == cached.lm_head[3].weight.data_ptr()
    assert cached.rope_cos.dtype == torch.float32  # RoPE stays fp32 whatever the weights


def test_flags_set_compile_and_threads(tiny: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", "off")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_THREADS", "1")
    pred = CachedCodePredictor.from_stock(tiny["stock"])
    assert pred.compile_mode == "off" and pred.threads == 1
    seen: list[int] = []
    hook = pred.model.layers[0].self_attn.qkv_proj.register_forward_hook(
        lambda *_: seen.append(torch.get_num_threads())
    )
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        pred(**tiny["inp"], do_sample=False)
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2, "thread count not restored after the call"
    finally:
        hook.remove()
        torch.set_num_threads(before)
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", "graph")
    with pytest.raises(envs.FlagError, match="VLLM_OMNI_PREDICTOR_COMPILE"):
        CachedCodePredictor.from_stock(tiny["stock"])


def test_step_stats_timers(tiny: dict, tmp_path: Path) -> None:
    step_stats.configure(tmp_path)
    try:
        tiny["cached"](**tiny["inp"], do_sample=False)
        step_stats.end_step()
    finally:
        step_stats.configure("")
    summary = step_stats.summarize_dir(tmp_path)
    assert summary[step_stats.PREDICTOR_SUBSTEP]["count"] == STEPS
    assert summary[step_stats.PREDICTOR_LOOP]["count"] == 1
    assert summary[step_stats.PREDICTOR_LOOP]["mean"] >= summary[step_stats.PREDICTOR_SUBSTEP]["max"]


def test_bad_arguments_raise_clearly(tiny: dict) -> None:
    cached, inp = tiny["cached"], tiny["inp"]
    with pytest.raises(ValueError, match="generators must have one entry per row: got 2 for batch 4"):
        cached(**inp, generators=_gens(2))
    with pytest.raises(ValueError, match=r"sample_uniforms must have shape \(4, 15, 2048\)"):
        cached(**inp, sample_uniforms=torch.rand(4, 14, 2048))
    with pytest.raises(ValueError, match="top_p"):
        cached(**inp, top_p=0.0)
    with pytest.raises(ValueError, match="codes must be"):
        teacher_forced_logits(cached, **inp, codes=torch.zeros(4, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="compile must be 'off' or 'step'"):
        CachedCodePredictor.from_stock(tiny["stock"], compile="full")
    with pytest.raises(ValueError, match="threads"):
        CachedCodePredictor.from_stock(tiny["stock"], threads=-1)


def test_stacked_linear_reads_the_indexed_head() -> None:
    # The op the compiled step calls for its head: x @ table[i].T against a float64 product, and
    # a well-formed custom op (schema, fake tensor, compile) by torch.library's own checker.
    g = torch.Generator().manual_seed(0)
    table = torch.randn(15, 64, 32, generator=g)
    x = torch.randn(3, 32, generator=g)
    for i in (0, 7, 14):
        want = (x.double() @ table[i].double().T).float()
        torch.testing.assert_close(stacked_linear(x, table, torch.tensor(i)), want, rtol=1e-5, atol=1e-5)
    torch.library.opcheck(stacked_linear, (x, table, torch.tensor(3)))
