"""Sampling noise drawn eagerly from the request generators.

One definition of "consume the request generators like the eager loop does", shared by the
code predictor (uniform noise for Gumbel-max, as vllm-omni's ``CodePredictorWrapper``) and by
``CpuSampler`` (exponential noise, as vLLM's ``random_sample``). Drawing the noise here, before any
compiled region, means the compiled predictor step holds no generator and a seeded run gives the
same codes eager or compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import torch

# vllm-omni's code predictor draws u ~ U(eps, 1 - eps) so that -log(-log(u)) stays finite.
UNIFORM_EPS = 1e-20

RowGenerators = Sequence[torch.Generator | None]


def predictor_uniforms(
    batch: int,
    steps: int,
    vocab: int,
    generator: torch.Generator | None = None,
    generators: RowGenerators | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Uniforms ``[batch, steps, vocab]`` for the predictor's ``steps`` sub-steps.

    Consumes the generators exactly as ``CodePredictorWrapper._sample_codes_gumbel`` does inside
    its sub-step loop: per sub-step, either one ``[batch, vocab]`` draw from ``generator`` (or the
    default generator), or, with per-row ``generators``, one ``[1, vocab]`` draw per row in row
    order (a ``None`` row draws from the default generator).
    """
    u = torch.empty(steps, batch, vocab, dtype=torch.float32, device=device)
    if generators is None:
        for s in range(steps):
            u[s].uniform_(UNIFORM_EPS, 1.0 - UNIFORM_EPS, generator=generator)
    else:
        if len(generators) != batch:
            raise ValueError(
                f"generators must have one entry per row: got {len(generators)} for batch {batch}"
            )
        if _distinct(generators):
            # Each row owns its generator, so a row's sub-steps can be drawn in one call: the
            # generator hands out the same values in the same order (tests/test_noise.py).
            for r, g in enumerate(generators):
                u[:, r].uniform_(UNIFORM_EPS, 1.0 - UNIFORM_EPS, generator=g)
        else:
            for s in range(steps):
                for r, g in enumerate(generators):
                    u[s, r].uniform_(UNIFORM_EPS, 1.0 - UNIFORM_EPS, generator=g)
    return u.transpose(0, 1)


def _distinct(generators: RowGenerators) -> bool:
    ids = [id(g) for g in generators if g is not None]
    return len(ids) == len(generators) and len(set(ids)) == len(ids)


def sampler_exponentials(
    batch: int,
    vocab: int,
    generators: Mapping[int, torch.Generator],
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    always_draw_shared: bool = True,
) -> torch.Tensor:
    """Exponential noise ``[batch, vocab]`` consumed as vLLM 0.30's CPU sampler consumes it.

    Rows without their own generator share one draw from the default generator over the whole
    batch; seeded rows are then overwritten row by row from their own generators, in the
    mapping's order. vLLM's CPU path (``TopKTopPSampler.forward_cpu``) makes the shared draw even
    when every row has a generator, so the default generator advances the same way
    (``always_draw_shared=True``); ``random_sample`` (the native path of other platforms) skips it
    then (``always_draw_shared=False``).

    The stretches of the shared draw that seeded rows overwrite are not computed: on CPU the
    default generator is advanced past them with a draw that consumes the same random words at a
    fifth of the cost (checked once per process, see :func:`_cheap_skip_matches`).
    """
    for i in generators:
        if not 0 <= i < batch:
            raise ValueError(f"generator row {i} is outside the batch of {batch} rows")
    q = torch.empty(batch, vocab, dtype=dtype, device=device)
    if not generators:
        q.exponential_()
        return q
    if always_draw_shared or len(generators) != batch:
        if q.device.type == "cpu" and _cheap_skip_matches():
            _shared_draw_skipping_seeded(q, generators)
        else:
            q.exponential_()
    for i, g in generators.items():
        q[i].exponential_(generator=g)
    return q


def _shared_draw_skipping_seeded(q: torch.Tensor, generators: Mapping[int, torch.Generator]) -> None:
    # The default generator hands out values in row-major order, so drawing each run of unseeded
    # rows separately, and skipping each run of seeded rows, leaves every value and the final state
    # as one whole-batch q.exponential_() would.
    batch, vocab = q.shape
    r = 0
    while r < batch:
        start, seeded = r, r in generators
        while r < batch and (r in generators) == seeded:
            r += 1
        if seeded:
            _skip_exponential_draws((r - start) * vocab)
        else:
            q[start:r].exponential_()


def _skip_exponential_draws(n: int, generator: torch.Generator | None = None) -> None:
    """Advance a CPU generator as ``n`` exponential_ draws would, without computing them."""
    # ATen's CPU exponential_ takes one 64-bit word per element (uniform double, then -log);
    # a float64 uniform_ takes the same words and skips the serial log.
    torch.empty(n, dtype=torch.float64).uniform_(generator=generator)


@functools.cache
def _cheap_skip_matches() -> bool:
    """Whether :func:`_skip_exponential_draws` leaves a generator exactly as exponential_ does."""
    for dtype in (torch.float32, torch.float64):
        a = torch.Generator().manual_seed(20261130)
        b = torch.Generator().manual_seed(20261130)
        torch.empty(61, dtype=dtype).exponential_(generator=a)
        _skip_exponential_draws(61, generator=b)
        if not torch.equal(a.get_state(), b.get_state()):
            return False
        nxt_a, nxt_b = torch.empty(7).exponential_(generator=a), torch.empty(7).exponential_(generator=b)
        if not torch.equal(nxt_a, nxt_b):
            return False
    return True
