"""``noise.predictor_uniforms`` consumes generators exactly as vllm-omni's eager predictor loop.

The reference is the stock ``CodePredictorWrapper._sample_codes_gumbel``, called once per sub-step
as ``CodePredictorWrapper.forward`` calls it. Two independent checks per case: the Gumbel-max codes
of random logits agree at every sub-step (``argmax(logits - log(-log(u)))`` with our uniforms), and
every generator involved - per-row, shared, the batch one and torch's default one - ends in the same
state, so the same number of values was drawn in the same order.
"""

from __future__ import annotations

import pytest
import torch

from omni_cpu_fastpath.qwen3_tts.noise import predictor_uniforms

STEPS = 15


def _stock_sampler():
    from vllm_omni.model_executor.models.common.qwen3_code_predictor import CodePredictorWrapper

    return CodePredictorWrapper._sample_codes_gumbel


def _generators(spec: str) -> list[torch.Generator | None] | None:
    """``spec``: one letter per row; equal letters share one generator, ``-`` is a None row."""
    if spec == "":
        return None
    made: dict[str, torch.Generator] = {}
    out: list[torch.Generator | None] = []
    for ch in spec:
        if ch == "-":
            out.append(None)
        else:
            out.append(made.setdefault(ch, torch.Generator().manual_seed(1000 + ord(ch))))
    return out


def _run(
    batch: int, vocab: int, spec: str, batch_gen: bool, ours: bool
) -> tuple[torch.Tensor, list, torch.Tensor]:
    """Codes [batch, STEPS] and the final generator states of one run (stock loop or ours)."""
    torch.manual_seed(7)
    logits = torch.randn(STEPS, batch, vocab, generator=torch.Generator().manual_seed(3))
    gens = _generators(spec)
    gen = torch.Generator().manual_seed(99) if batch_gen else None
    if ours:
        u = predictor_uniforms(batch, STEPS, vocab, generator=gen, generators=gens)
        assert u.shape == (batch, STEPS, vocab) and u.dtype == torch.float32
        codes = torch.stack(
            [(logits[s] - torch.log(-torch.log(u[:, s]))).argmax(dim=-1) for s in range(STEPS)], dim=1
        )
    else:
        sample = _stock_sampler()
        stock_gen = gens if gens is not None else gen
        codes = torch.stack(
            [sample(logits[s], generator=stock_gen).reshape(batch) for s in range(STEPS)], dim=1
        )
    states = [g.get_state() for g in (gens or []) if g is not None] + (
        [gen.get_state()] if gen is not None else []
    )
    return codes, states, torch.get_rng_state()


@pytest.mark.parametrize(
    "batch,spec,batch_gen",
    [
        (1, "", False),  # default generator
        (3, "", True),  # one batch generator
        (4, "abcd", False),  # one generator per row
        (4, "abab", False),  # rows sharing generators
        (3, "a-b", False),  # a None row draws from the default generator
        (2, "--", False),  # all rows None
        (3, "aaa", False),  # one generator passed for every row
    ],
)
@pytest.mark.parametrize("vocab", [2048, 100])  # 100: not a multiple of any vector width
def test_predictor_uniforms_consume_like_stock_loop(
    batch: int, spec: str, batch_gen: bool, vocab: int
) -> None:
    stock_codes, stock_states, stock_default = _run(batch, vocab, spec, batch_gen, ours=False)
    our_codes, our_states, our_default = _run(batch, vocab, spec, batch_gen, ours=True)
    assert torch.equal(our_codes, stock_codes)
    assert len(our_states) == len(stock_states)
    for a, b in zip(our_states, stock_states, strict=True):
        assert torch.equal(a, b), "a generator was advanced differently"
    assert torch.equal(our_default, stock_default), "torch's default generator was advanced differently"


def test_predictor_uniforms_values_in_open_interval() -> None:
    u = predictor_uniforms(2, STEPS, 4096, generator=torch.Generator().manual_seed(0))
    assert bool((u > 0).all()) and bool((u < 1).all())
    assert torch.isfinite(torch.log(-torch.log(u))).all()


def test_predictor_uniforms_rejects_wrong_generator_count() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        predictor_uniforms(3, STEPS, 16, generators=[torch.Generator()])
