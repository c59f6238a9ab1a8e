"""The code predictor as the talker builds it for serving (``talker.build_served_predictor``).

Built under vLLM's loader state (``set_default_torch_dtype(model dtype)``, as ``load_weights``
runs), then called as requests call it (default dtype float32, batches of 1 to 8 rows). With
``VLLM_OMNI_PREDICTOR_COMPILE=step``:

- every bucket the runner can reach is compiled at load, once (no float-then-int8 double compile:
  Dynamo's own graph counter and the predictor's count agree);
- no request compiles anything again (Dynamo's ``error_on_recompile`` is on while serving, and
  the compiled-frame counter does not move);
- every batch size, padded up to its bucket (3 -> 4, 5/6/7 -> 8), gives the codes of the eager
  predictor built the same way (tiny fp32: bit-equal, seeded; otherwise, where a sub-step sees
  eager's inputs, its logits to the dtype's rounding and nearly always its code: at 0.6B width
  the compiled GEMMs sum in another order than eager's, in fp32 too).

Tiny dimensions in fp32 (bit-equal); the released 0.6B dimensions in bf16 (bounded), both slow tests.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch._dynamo

from omni_cpu_fastpath.qwen3_tts import talker
from omni_cpu_fastpath.testing.stock import build_stock_predictor, layer0_embedding

BATCHES = (1, 2, 3, 4, 5, 6, 7, 8)


def _inputs(model_dir, bsz: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    code = torch.randint(0, 2048, (bsz, 1), generator=g)
    return {
        "layer0_code": code,
        "layer0_embed": layer0_embedding(model_dir, code),
        "last_talker_hidden": torch.randn(bsz, 1, width, generator=g),
    }


def _gens(bsz: int, seed: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed * 100 + i) for i in range(bsz)]


def _build(stock, dtype: torch.dtype, compile: str, int8: str, monkeypatch, max_batch: int = 8):
    from vllm.utils.torch_utils import set_default_torch_dtype

    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_COMPILE", compile)
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INT8", int8)
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_INCREMENTAL", "1")
    monkeypatch.setenv("VLLM_OMNI_PREDICTOR_PARITY_CHECK", "0")
    with set_default_torch_dtype(dtype):  # what vLLM's loader holds while load_weights runs
        return talker.build_served_predictor(copy.deepcopy(stock), max_batch)


def _frames_compiled() -> int:
    """Graphs Dynamo has compiled in this process (its own counter, not the predictor's)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _check_served_compile(
    model_dir, dtype: torch.dtype, int8: str, monkeypatch, batches=BATCHES, exact: bool = False
) -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    stock = build_stock_predictor(model_dir, dtype)
    width = stock.model.codec_embedding[0].weight.shape[1]
    before = _frames_compiled()
    compiled, _, served = _build(stock, dtype, "step", int8, monkeypatch)
    eager, _, _ = _build(stock, dtype, "off", int8, monkeypatch)
    pred = compiled
    buckets = (1, 2, 4, 8)
    assert pred.buckets == buckets
    assert pred.compile_counts == {b: 1 for b in buckets}, pred.compile_counts
    # The int8 linears run the few-row kernel, so bucket 1 has its graphs and the buckets above it
    # share theirs (batch dimension dynamic): two graphs each (the 2-token prefill and the 1-token
    # sub-step), each compiled once.
    assert _frames_compiled() - before == 2 * 2
    assert served["predictor.compile"].startswith("step (buckets 1,2,4,8, compiled at load"), served
    assert served["predictor.compile"].endswith("; few-row kernel in the graph)"), served
    assert served["predictor.int8"] == int8
    status = pred.compile_status

    at_load = _frames_compiled()
    same_codes: list[bool] = []  # per sub-step with eager's inputs: the same code as eager
    with torch._dynamo.config.patch(error_on_recompile=True):
        for bsz in batches:
            for seed in (1, 2):
                inp = _inputs(model_dir, bsz, width, seed)
                got, logits = pred.forward_cached(**inp, generators=_gens(bsz, seed), return_logits=True)
                want, want_logits = eager.forward_cached(
                    **inp, generators=_gens(bsz, seed), return_logits=True
                )
                if exact:
                    assert torch.equal(got, want), f"batch {bsz}: compiled codes differ from eager"
                    continue
                # The compiled GEMMs accumulate in another order than eager's (bf16 also rounds
                # in other places), so where two candidates nearly tie a code can differ, and
                # every later sub-step of that row then sees other inputs. Up to there the
                # logits agree to the dtype's rounding.
                agree = (got[:, 1:] == want[:, 1:]).long().cumprod(dim=1)
                same_inputs = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], dim=1).bool()
                diff = (logits - want_logits).abs().amax(dim=-1)[same_inputs]
                # Relative to the largest logit: bf16 throughout; fp32 with the int8 head, which
                # takes bf16 activations (logits rounded to bf16); fp32 float weights.
                tol = 0.05 if dtype == torch.bfloat16 else 0.01 if int8 != "off" else 1e-3
                assert float(diff.max()) <= tol * float(want_logits.abs().max()), (bsz, float(diff.max()))
                same_codes += (got[:, 1:] == want[:, 1:])[same_inputs].tolist()
    if same_codes:
        # Of the sub-steps that saw the same inputs, nearly all drew the same code.
        assert sum(same_codes) / len(same_codes) >= 0.95, sum(same_codes) / len(same_codes)
    assert _frames_compiled() == at_load, "a request compiled the step again"
    assert pred.compile_status == status and pred.compile_mode == "step"


@pytest.mark.slow
def test_served_compile_tiny_fp32(tiny_model_dir, monkeypatch) -> None:
    # The served int8 default (w8-channel): at tiny width in fp32 the compiled step reproduces
    # eager's codes bit for bit (bf16 is bounded at 0.6B below). The float compiled step (int8
    # off) is served and compared bit for bit in test_served_equals_stock.py.
    _check_served_compile(tiny_model_dir, torch.float32, "w8-channel", monkeypatch, exact=True)


@pytest.mark.slow
def test_served_compile_0p6b(model_0p6b_dir, monkeypatch) -> None:
    # The served default (int8 w8-channel, bf16) at the released dimensions; every bucket
    # compiles, a few batch sizes run (each one costs seconds here).
    _check_served_compile(model_0p6b_dir, torch.bfloat16, "w8-channel", monkeypatch, batches=(1, 3, 8))


def test_buckets_follow_max_num_seqs() -> None:
    from omni_cpu_fastpath.qwen3_tts.predictor import buckets_for

    assert buckets_for(1) == (1,)
    assert buckets_for(3) == (1, 2, 3)
    assert buckets_for(8) == (1, 2, 4, 8)
    assert buckets_for(12) == (1, 2, 4, 8, 12)
    with pytest.raises(ValueError, match="max_batch"):
        buckets_for(0)


def test_float_predictor_then_int8_compiles_once(tiny_model_dir, monkeypatch) -> None:
    """The served build quantizes before compiling: the int8 weights are the only ones compiled."""
    from omni_cpu_fastpath.qwen3_tts import quant

    stock = build_stock_predictor(tiny_model_dir, torch.float32)
    pred, _, _ = _build(stock, torch.float32, "off", "w8-channel", monkeypatch, max_batch=1)
    assert isinstance(pred.model.layers[0].mlp.down_proj, quant.Int8Linear)
    assert pred.compile_counts == {} and pred.compile_status == "off"


@pytest.mark.slow
def test_served_compile_follows_the_thread_count_sub_step_by_sub_step(model_0p6b_dir, monkeypatch) -> None:
    """Where code2wav shares the talker's cores, the runner has the predictor run each sub-step at
    the count it sets (one thread while code2wav decodes: ``follow_threads``). At the released
    width in bf16 the compiled step then serves one and two threads without compiling at a
    request, and gives the codes and logits of a call at a fixed count, bit for bit: Inductor's
    own loops run on one thread and the kernel sums each output whole, where a 1024-wide RMSNorm
    sum split between two threads would round by the count."""
    from omni_cpu_fastpath.cpu_threads import set_torch_threads

    prev = torch.get_num_threads()
    set_torch_threads(2)
    try:
        stock = build_stock_predictor(model_0p6b_dir, torch.bfloat16)
        width = stock.model.codec_embedding[0].weight.shape[1]
        pred, _, served = _build(stock, torch.bfloat16, "step", "w8-channel", monkeypatch, max_batch=4)
        assert served["predictor.compile"].endswith("; few-row kernel in the graph)"), served
        plan = itertools.cycle((1, 2, 2, 1, 1, 1, 2))
        ran_at: list[int] = []  # torch's count when each sub-step asked (the previous one's)

        def threads_now() -> int:
            ran_at.append(torch.get_num_threads())
            return next(plan)

        assert pred.follow_threads(threads_now, (1, 2)) is None
        assert pred.compiler.thread_counts == (1, 2) or pred.compiler.thread_counts == (2, 1)
        at_traced = _frames_compiled()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for bsz in (1, 3):
                for seed in range(4):
                    inp = _inputs(model_0p6b_dir, bsz, width, seed)
                    followed = pred.forward_cached(**inp, generators=_gens(bsz, seed), return_logits=True)
                    assert torch.get_num_threads() == 2, "the call's count is restored after it"
                    pred.follow_threads(None)
                    for fixed in (2, 1):
                        set_torch_threads(fixed)
                        got = pred.forward_cached(**inp, generators=_gens(bsz, seed), return_logits=True)
                        assert torch.equal(got[0], followed[0]), (bsz, seed, fixed)
                        assert torch.equal(got[1], followed[1]), (bsz, seed, fixed)
                    set_torch_threads(2)
                    assert pred.follow_threads(threads_now, (1, 2)) is None
        assert _frames_compiled() == at_traced, "a call compiled the step again"
        assert {1, 2} <= set(ran_at[1:]), ran_at
        assert pred.compile_mode == "step" and "dropped" not in pred.compile_status, pred.compile_status
    finally:
        set_torch_threads(prev)
