"""Compile-free CPU sampler for the talker's first codebook: ``CpuSampler``.

vLLM 0.30's :class:`vllm.v1.sample.sampler.Sampler` on CPU samples rows without a per-request
generator through ``compiled_random_sample`` (``torch.compile(dynamic=True)``): seconds to tens of
seconds of compile on first use, then an OpenMP region per step that on a busy CPU waits
milliseconds for its threads (``omni-cpu-fastpath bench sampler`` measures it). Its logprob ranks
go through another compiled kernel (``batched_count_greater_than``). Everything else is eager.

``CpuSampler`` keeps vLLM's contract and semantics, step for step, replaces the compiled parts
with eager PyTorch, re-does the slow eager parts with fewer tensor ops (bit-equal, tested against
vLLM's functions), and samples a small batch with one torch thread (``max_threads``):

1. raw logprobs / raw logits when logprobs are asked (``logprobs_mode``);
2. float32 logits; allowed-token-ids mask; bad words; non-argmax-invariant logits processors
   (min tokens, logit bias, custom ones) - vLLM's own code;
3. repetition / frequency / presence penalties - :func:`apply_penalties`, vLLM's
   ``apply_all_penalties`` arithmetic in fewer passes; the thinking budget when tracked;
4. greedy argmax (unless ``all_random``; ``all_greedy`` returns here), temperature (greedy rows
   divide by 1), argmax-invariant processors (min-p), top-k / top-p - :func:`top_k_top_p`
   (vLLM's eager CPU ``apply_top_k_top_p_pytorch``, with a shortcut for one top-k for all rows);
5. softmax, then, when some row has a generator, exponential noise from
   :func:`omni_cpu_fastpath.qwen3_tts.noise.sampler_exponentials` (the default generator for the whole
   batch, then each seeded row from its own generator, as ``TopKTopPSampler.forward_cpu``) and
   ``argmax(probs / q)``; when none has, vLLM's compiled draw is replaced by an inverse-CDF draw
   (:func:`sample_inverse_cdf`, one uniform per row); greedy rows (temperature < 1e-5) take the
   greedy token;
6. logprobs of the top ``max_num_logprobs`` and the sampled token, or of ``logprob_token_ids``.

A talker-like step (no logprobs, allowed-ids mask, bad words, top-p, thinking budget or fp64
noise: :meth:`CpuSampler.path`) takes a shorter road, because at batch 1 the per-call costs of
~20 tensor/numpy ops are the whole step:

- "kernel": one call into the C kernel (``_sampler_kernel.c``, built by ``setup.py``) does the
  penalties (all three), greedy argmax, temperature, per-row top-k and, for rows without a
  generator, an inverse-CDF draw over the kept entries (one uniform per row from torch's default
  generator). With generators it masks below the k-th value instead; the rows then draw vLLM's
  ``argmax(probs / q)`` with ``q`` taken from the generators' own mt19937 streams as ATen's
  ``exponential_`` takes them (:func:`_exponential_race`: bit-equal tokens and generator states,
  the log computed only where ``probs > 0``; checked against torch once per process, torch's own
  draw otherwise; every seeded draw of CpuSampler goes this way). Needs min-p off (it sits
  between temperature and top-k). ``VLLM_OMNI_CPU_SAMPLER_KERNEL=0`` turns the kernel off; where
  it was not built CpuSampler logs why and takes the numpy road.
- "numpy": the same arithmetic in numpy on the logits' memory, for at most a repetition penalty
  and one top-k for all sampling rows; unseeded rows draw by inverse CDF over the top-k entries.

Both do vLLM's float32 operations on the same values, so everything up to the draw is bit-equal.

Results equal vLLM's Sampler bit for bit whenever vLLM draws eagerly, i.e. when some row has a
per-request generator or with fp64 noise (and every generator is left in the same state). With no
generator at all vLLM draws inside its compiled kernel with inductor's own random stream: there
the numbers differ but the distribution is the same (``tests/test_sampler.py`` checks both).

How vllm-omni calls it. ``OmniGPUARModelRunner._sample`` (``vllm_omni/worker/gpu_ar_model_runner.py``),
when the model has ``prefer_model_sampler = True`` and a callable ``sample``, and the step has no
speculative decoding, calls::

    model.sample(logits, sampling_metadata)   # logits [num_reqs, vocab]; returns SamplerOutput

(``call_model_sampler``; with ``model_sampler_wants_extra_args`` a third keyword
``per_req_extra_args`` is added). Before that the runner has clamped ``prompt_token_ids`` to the
logits vocabulary, dropped min-tokens stop ids the head cannot emit and rebuilt
``output_token_ids`` from the input batch. ``None`` from ``sample`` makes the runner fall back to
its own Sampler. So the talker (``omni_cpu_fastpath.qwen3_tts.talker``, with ``VLLM_OMNI_CPU_FAST_SAMPLER``
on) does::

    self.cpu_sampler = CpuSampler(logprobs_mode=model_config.logprobs_mode,
                                  use_fp64_gumbel=model_config.use_fp64_gumbel)
    self.prefer_model_sampler = True
    def sample(self, logits, sampling_metadata):
        return self.cpu_sampler(logits, sampling_metadata)

Declining (returning None) is only safe before any logits processing: the sampler works in place,
as vLLM's does, so a half-processed tensor must never go on to the stock Sampler.

The sampling metadata itself is built by the runner (``InputBatch.refresh_metadata``), not by
the model; :func:`timed_refresh_metadata` is the call a runner can use to time it as
``sampler.metadata_ms``.

Step timers (``omni_cpu_fastpath.step_stats``): ``model.sample_ms`` (the whole call),
``sampler.processors_ms`` (allowed ids, bad words, non-argmax-invariant processors),
``sampler.penalties_ms`` (penalties, thinking budget), ``sampler.topk_topp_ms`` (temperature,
argmax-invariant processors, top-k / top-p, processed logprobs), ``sampler.draw_ms`` (softmax,
noise and argmax, or the inverse-CDF draw); on the kernel road the kernel times its own phases.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import logging
import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn
from vllm.config.model import LogprobsMode
from vllm.v1.outputs import LogprobsTensors, SamplerOutput
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.bad_words import apply_bad_words
from vllm.v1.sample.ops.penalties import _convert_to_tensors
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch, sample_with_exponential_noise
from vllm.v1.sample.sampler import Sampler

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.qwen3_tts import noise

try:  # CpuSampler's C kernel (setup.py builds it; optional where no C compiler was found)
    from . import _sampler_kernel
except ImportError as _exc:
    _sampler_kernel = None
    KERNEL_MISSING = f"the C kernel is not built ({type(_exc).__name__}: {_exc})"
else:
    KERNEL_MISSING = ""

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

# vLLM's threshold below which a temperature means greedy (vllm/v1/sample/sampler.py).
SAMPLING_EPS = 1e-5

SAMPLE = step_stats.MODEL_SAMPLE
PROCESSORS = "sampler.processors_ms"
PENALTIES = "sampler.penalties_ms"
TOPK_TOPP = "sampler.topk_topp_ms"
DRAW = "sampler.draw_ms"
# One count per step and road taken ("kernel", "numpy", "general"): which road served.
ROAD = {road: f"sampler.road.{road}" for road in ("kernel", "numpy", "general")}
METADATA = "sampler.metadata_ms"

# Largest batch x vocab sampled under the thread cap (85 rows of the talker's 3072 entries).
SMALL_STEP = 1 << 18

_PENALTY_VECTORS = ("repetition_penalties", "frequency_penalties", "presence_penalties")
_LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


def count_at_least(x: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per row, how many entries of ``x`` are >= ``values[row]`` (the rank of a token, 1-based).

    Eager twin of vLLM's compiled ``batched_count_greater_than``: one boolean temporary of the
    logits' size is nothing next to a compile on the first logprobs request.
    """
    return (x >= values).sum(-1)


def apply_penalties(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """vLLM's ``apply_all_penalties``, bit for bit, in place, with fewer full-vocabulary passes.

    vLLM's CPU path spends ~0.1-0.2 ms per step here at batch 1 (``repeat`` of the penalties over
    the vocabulary, two bin counts, unconditional frequency / presence passes), as much as the
    rest of the sampler. Same arithmetic: the repetition factor is ``1 / p`` for positive logits
    and ``p`` otherwise, applied by one multiply where the token was seen (elsewhere vLLM
    multiplies by exactly 1.0); frequency and presence passes that subtract exact zeros are
    skipped.
    """
    batch, vocab = logits.shape
    rep_on = _any(repetition_penalties, 1.0)
    freq_on, pres_on = _any(frequency_penalties, 0.0), _any(presence_penalties, 0.0)
    if not (rep_on or freq_on or pres_on):
        return logits
    if rep_on and not (freq_on or pres_on) and logits.device.type == "cpu" and logits.is_contiguous():
        return _repetition_penalty_sparse(logits, prompt_token_ids, repetition_penalties, output_token_ids)
    # vLLM's own padding (vocab as pad id, -1 async placeholders mapped to the pad).
    out = _convert_to_tensors(output_token_ids, vocab, logits.device)
    out.masked_fill_(out == -1, vocab)
    counts: torch.Tensor | None = None
    if freq_on:
        counts = torch.zeros(batch, vocab + 1, dtype=torch.long, device=logits.device)
        counts.scatter_add_(1, out, torch.ones_like(out))
        out_seen = counts > 0
    else:
        out_seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=logits.device)
        out_seen.scatter_(1, out, True)
    if rep_on:
        seen = out_seen.clone() if pres_on else out_seen
        seen.scatter_(1, prompt_token_ids, True)
        rep = repetition_penalties.unsqueeze(1)
        scaling = torch.where(logits > 0, 1.0 / rep, rep)
        logits.mul_(scaling.masked_fill_(~seen[:, :vocab], 1.0))
    if counts is not None:
        logits -= frequency_penalties.unsqueeze(1) * counts[:, :vocab]
    if pres_on:
        logits -= presence_penalties.unsqueeze(1) * out_seen[:, :vocab]
    return logits


def _repetition_penalty_sparse(
    logits: torch.Tensor,
    prompt_token_ids: torch.Tensor,
    repetition_penalties: torch.Tensor,
    output_token_ids: list[list[int]],
) -> torch.Tensor:
    """Repetition penalty alone (the talker's case), touching only the seen tokens, in numpy.

    The seen set is built in numpy (prompt pad ids and -1 placeholders land in a spare column);
    the seen logits are then rescaled in place through a numpy view of ``logits``: the same
    float32 products (``logit * (1 / p)`` or ``logit * p``) as vLLM's dense pass, with no tensor op.
    """
    batch, vocab = logits.shape
    seen = np.zeros((batch, vocab + 1), dtype=bool)
    seen[np.arange(batch)[:, None], prompt_token_ids.numpy()] = True
    for r, out in enumerate(output_token_ids[:batch]):
        if out:
            seen[r, out] = True  # -1 hits the spare column
    flat = np.flatnonzero(seen[:, :vocab])  # row * vocab + token
    if flat.size == 0:
        return logits
    rep = repetition_penalties.numpy().astype(np.float32, copy=False)
    rep = rep[flat // vocab] if batch > 1 else np.broadcast_to(rep, flat.shape)
    flat_logits = logits.numpy().reshape(-1)
    vals = flat_logits[flat]
    # np.float32(1) / rep is IEEE float32 division, as torch's reciprocal.
    flat_logits[flat] = np.where(vals > 0, vals * (np.float32(1.0) / rep), vals * rep)
    return logits


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM's CPU top-k / top-p (``apply_top_k_top_p_pytorch`` with ``allow_cpu_sync``), in place.

    When every row has the same top-k and no top-p (the talker's case) the k-th largest logit is
    read straight from ``topk`` and the rest masked: the same threshold and comparison as vLLM's
    ``apply_top_k_only`` with a third of its tensor ops. Anything else goes to vLLM's function.
    """
    if p is None and k is not None and k.device.type == "cpu" and k.numel() > 0:
        ks = k.numpy()
        k0 = int(ks[0])
        if 0 < k0 < logits.shape[1] and bool((ks == k0).all()):
            kth = logits.topk(k0, dim=1).values[:, -1:]
            return logits.masked_fill_(logits < kth, float("-inf"))
    return apply_top_k_top_p_pytorch(logits, k, p, allow_cpu_sync=True)


def sample_inverse_cdf(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row with probability ``probs[row, i] / probs[row].sum()``, by inverse CDF.

    One uniform per row instead of a vocabulary of exponentials: ATen's ``exponential_`` is a
    serial loop (~45 ns an entry) and ``-log(u)`` goes through a VML ``log`` that opens an OpenMP
    region above 2048 entries, costly on a busy CPU. ``u`` lies in ``(0, total]`` and a token is
    taken iff ``cdf[i-1] < u <= cdf[i]``, so a zero-probability token is never taken.
    """
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, generator=generator, device=probs.device)
    u = (1.0 - u).mul_(cdf[:, -1:])
    return torch.searchsorted(cdf, u).clamp_(max=probs.shape[1] - 1).view(-1)


def _inverse_cdf_rows(logits: np.ndarray) -> np.ndarray:
    """Per row, an index drawn with probability ``softmax(logits[row])`` (one uniform per row).

    float64 exp and cumsum; ``u`` in ``(0, total]`` from torch's default generator, so an entry
    is taken iff ``cdf[i-1] < u <= cdf[i]`` and an ``-inf`` logit (probability 0) never is.
    One short row (the talker's top-k at batch 1) is cheaper in plain Python floats.
    """
    if logits.shape[0] == 1 and logits.shape[1] <= 256:
        row = logits[0].tolist()
        top = max(row)
        cdf = list(itertools.accumulate(math.exp(v - top) for v in row))
        u = (1.0 - torch.rand(1, dtype=torch.float64).item()) * cdf[-1]
        return np.array([min(bisect.bisect_left(cdf, u), len(cdf) - 1)])
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    cdf = np.cumsum(np.exp(x, out=x), axis=1, out=x)
    u = 1.0 - torch.rand(cdf.shape[0], 1, dtype=torch.float64).numpy()
    pick = (cdf < u * cdf[:, -1:]).sum(axis=1)
    return np.minimum(pick, cdf.shape[1] - 1)


def _uniform_top_k(md: SamplingMetadata) -> int | None:
    """The top-k all sampling rows share (greedy rows, whose draw is discarded, may differ)."""
    if md.top_k is None or md.top_k.device.type != "cpu" or md.temperature is None:
        return None
    ks = md.top_k.numpy()
    if not md.all_random:
        ks = ks[md.temperature.numpy() >= SAMPLING_EPS]
    if ks.size == 0 or not bool((ks == ks[0]).all()):
        return None
    return int(ks[0])


def _sampler_output(tokens: np.ndarray) -> SamplerOutput:
    ids = torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int32)).unsqueeze(-1)
    return SamplerOutput(sampled_token_ids=ids, logprobs_tensors=None)


def _exponential_race(
    kernel: Any, probs: torch.Tensor, generators: dict[int, torch.Generator], tokens: torch.Tensor
) -> torch.Tensor:
    """``argmax(probs / q)`` into the rows of ``tokens`` ([rows, 1] int32) that hold -1, with
    ``q`` drawn as :func:`noise.sampler_exponentials` draws it (vLLM's CPU path: the default
    generator over the whole batch, then each seeded row from its own generator), by the C
    kernel on copies of the generators' states, which are then set back. Rows already decided
    (greedy: a token >= 0) keep it, their noise still consumed. Bit-equal tokens and states;
    the log of the noise is only computed where ``probs > 0`` (~50 of 3072 entries after top-k)."""
    rows, vocab = probs.shape
    probs = probs.contiguous()
    base, row_bytes, out = probs.data_ptr(), vocab * probs.element_size(), tokens.data_ptr()
    open_rows = tokens.numpy()[:, 0] < 0
    # Rows with their own generator only advance the default one (their values are overwritten).
    score = np.fromiter((r not in generators for r in range(rows)), dtype=np.uint8, count=rows)
    score &= open_rows
    state = torch.get_rng_state()
    kernel.exponential_race(base, rows, vocab, state.data_ptr(), state.numel(), score.ctypes.data, out)
    torch.set_rng_state(state)
    for i, g in generators.items():
        state = g.get_state()
        skip = None if open_rows[i] else _NO_ROW.ctypes.data
        kernel.exponential_race(
            base + i * row_bytes, 1, vocab, state.data_ptr(), state.numel(), skip, out + 4 * i
        )
        g.set_state(state)
    return tokens


_NO_ROW = np.zeros(1, dtype=np.uint8)  # a score mask of one row, not scored


@functools.cache
def _race_matches_torch(kernel: Any) -> bool:
    """Whether :func:`_exponential_race` gives vLLM's tokens and generator states here (ATen's
    CPU exponential_ and generator layout, checked once per process against torch itself)."""
    saved = torch.get_rng_state()
    try:
        rows, vocab = 3, 700  # 1400 words a row: crosses the mt19937 refill several times
        probs = torch.rand(rows, vocab, generator=torch.Generator().manual_seed(5)).pow_(4)
        probs[probs < 0.3] = 0.0
        probs /= probs.sum(dim=-1, keepdim=True)
        outcomes = []
        for draw in ("torch", "kernel"):
            torch.default_generator.manual_seed(20261130)  # the CPU one only, restored below
            gens = {2: torch.Generator().manual_seed(7), 0: torch.Generator().manual_seed(8)}
            if draw == "torch":
                q = noise.sampler_exponentials(rows, vocab, gens)
                tokens = sample_with_exponential_noise(probs.clone(), q).view(-1, 1).to(torch.int32)
            else:
                tokens = _exponential_race(kernel, probs, gens, torch.full((rows, 1), -1, dtype=torch.int32))
            states = [torch.get_rng_state()] + [g.get_state() for g in gens.values()]
            outcomes.append((tokens, states, torch.empty(9).exponential_()))
        (t_a, s_a, n_a), (t_b, s_b, n_b) = outcomes
        same = torch.equal(t_a, t_b) and torch.equal(n_a, n_b)
        same = same and all(torch.equal(a, b) for a, b in zip(s_a, s_b, strict=True))
    except (RuntimeError, ValueError) as exc:
        logger.warning("CpuSampler: the C kernel's seeded draw cannot run here (%s); using torch's", exc)
        return False
    finally:
        torch.set_rng_state(saved)
    if not same:
        logger.warning("CpuSampler: the C kernel's seeded draw differs from torch's here; using torch's")
    return same


def _float32_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` as contiguous float32 rows, copied only when they are not already."""
    if logits.dtype is torch.float32 and logits.is_contiguous():
        return logits
    return logits.to(torch.float32).contiguous()


def _is_cpu_vector(t: torch.Tensor, dtype: torch.dtype) -> bool:
    # Property reads, not t.device.type / t.stride(): served, each step finds the caches cold
    # (the predictor streamed its weights in between) and every distinct call costs ~10-90 us.
    return t.dtype is dtype and t.is_cpu and t.ndim == 1 and t.is_contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _any(values: torch.Tensor, neutral: float) -> bool:
    # A per-row parameter differing from its no-op value; numpy avoids two tensor ops per check.
    if values.device.type == "cpu":
        return bool((values.numpy() != neutral).any())
    return bool((values != neutral).any())


class CpuSampler(nn.Module):
    """vLLM 0.30's ``Sampler`` without ``torch.compile``: same ``forward`` and ``SamplerOutput``."""

    def __init__(
        self,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        use_fp64_gumbel: bool = False,
        max_threads: int | None = 1,
        kernel: bool | None = None,
    ) -> None:
        super().__init__()
        if logprobs_mode not in _LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode={logprobs_mode!r} is not one of {', '.join(_LOGPROBS_MODES)}")
        if max_threads is not None and max_threads < 1:
            raise ValueError(f"max_threads must be >= 1 or None, got {max_threads}")
        self.logprobs_mode = logprobs_mode
        self.use_fp64_gumbel = bool(use_fp64_gumbel)
        # Torch threads while sampling a small batch (None: leave them). A [batch, vocab] step is
        # microseconds of work; an OpenMP region over it (softmax opens one from 2 rows up) costs
        # more, and on a busy CPU a worker thread waiting for its core costs milliseconds.
        self.max_threads = max_threads
        # The talker's step through the C kernel (None: VLLM_OMNI_CPU_SAMPLER_KERNEL decides).
        want = envs.get("VLLM_OMNI_CPU_SAMPLER_KERNEL") if kernel is None else bool(kernel)
        self.kernel = _sampler_kernel if want else None
        if not want:
            self.kernel_status = "numpy (C kernel off: VLLM_OMNI_CPU_SAMPLER_KERNEL=0)"
        elif self.kernel is None:
            self.kernel_status = f"numpy ({KERNEL_MISSING}; reinstall with a C compiler to build it)"
            logger.warning("CpuSampler: %s; the talker's step takes the numpy path", KERNEL_MISSING)
        else:
            self.kernel_status = "C kernel"
            _race_matches_torch(self.kernel)  # once per process, here rather than in a first step

    def forward(
        self,
        logits: torch.Tensor,
        sampling_metadata: SamplingMetadata,
        predict_bonus_token: bool = False,
        logprobs_mode_override: LogprobsMode | None = None,
    ) -> SamplerOutput:
        with step_stats.timer(SAMPLE, sync=True):
            if logits.dim() != 2:
                raise ValueError(f"logits must be [num_reqs, vocab], got shape {tuple(logits.shape)}")
            md = sampling_metadata
            road = "general" if predict_bonus_token else self.path(logits, md)
            step_stats.record(ROAD[road], 1.0)
            if road == "kernel":  # no torch thread pool to cap
                return self._forward_kernel(logits, md)
            threads = torch.get_num_threads()
            if self.max_threads is None or threads <= self.max_threads or logits.numel() > SMALL_STEP:
                return self._forward(logits, md, road, predict_bonus_token, logprobs_mode_override)
            torch.set_num_threads(self.max_threads)
            try:
                return self._forward(logits, md, road, predict_bonus_token, logprobs_mode_override)
            finally:
                torch.set_num_threads(threads)

    def _forward(
        self,
        logits: torch.Tensor,
        md: SamplingMetadata,
        road: str,
        predict_bonus_token: bool,
        logprobs_mode_override: LogprobsMode | None,
    ) -> SamplerOutput:
        if road == "numpy":
            return self._forward_fast(logits, md)
        logprobs_mode = logprobs_mode_override or self.logprobs_mode
        num_logprobs = md.max_num_logprobs
        # As vLLM: top-k logprobs come from the logits before any processing.
        raw_logprobs: torch.Tensor | None = None
        if num_logprobs is not None or md.logprob_token_ids:
            if logprobs_mode == "raw_logprobs":
                raw_logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)
            elif logprobs_mode == "raw_logits":
                raw_logprobs = logits.clone() if logits.dtype == torch.float32 else logits.to(torch.float32)

        logits = logits.to(torch.float32)
        logits = self.apply_logits_processors(logits, md, predict_bonus_token)
        sampled, processed_logprobs = self.sample(logits, md)
        if processed_logprobs is not None:
            raw_logprobs = processed_logprobs
        sampled = sampled.long()

        token_ids_tensors = None
        if md.logprob_token_ids:
            assert raw_logprobs is not None
            token_ids_tensors = self.gather_specific_token_logprobs(
                raw_logprobs, md.logprob_token_ids, sampled
            )
        if num_logprobs is None:
            logprobs_tensors = token_ids_tensors
        elif num_logprobs == -1:
            logprobs_tensors = LogprobsTensors(torch.empty(0), raw_logprobs, torch.empty(0))
        else:
            assert raw_logprobs is not None
            logprobs_tensors = self.gather_logprobs(raw_logprobs, num_logprobs, sampled)
        # vLLM prefers the explicit token ids when both are asked.
        if token_ids_tensors is not None and num_logprobs is not None:
            logprobs_tensors = token_ids_tensors

        return SamplerOutput(
            sampled_token_ids=sampled.to(torch.int32).unsqueeze(-1), logprobs_tensors=logprobs_tensors
        )

    def _race_applies(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> bool:
        return (
            self.kernel is not None
            and probs.dtype == torch.float32
            and probs.device.type == "cpu"
            and all(g.device.type == "cpu" for g in generators.values())
            and _race_matches_torch(self.kernel)
        )

    def _seeded_draw(self, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """vLLM's ``argmax(probs / q)`` ([rows] int64) with float32 noise consumed as its CPU path
        consumes it: by the C kernel where it runs here, else by torch (``noise``)."""
        if self._race_applies(probs, generators):
            tokens = torch.full((probs.shape[0], 1), -1, dtype=torch.int32)
            return _exponential_race(self.kernel, probs, generators, tokens).view(-1).long()
        q = noise.sampler_exponentials(probs.shape[0], probs.shape[1], generators, device=probs.device)
        return sample_with_exponential_noise(probs, q)

    # ------------------------------------------------------------------ the talker's fast path

    def path(self, logits: torch.Tensor, md: SamplingMetadata) -> str:
        """Which road a step takes: "kernel", "numpy" (the talker's step) or "general"."""
        if self._fast_path_applies(logits, md):
            if self.kernel is not None and self._kernel_applies(md):
                return "kernel"
            if self._numpy_path_applies(md):
                return "numpy"
        return "general"

    def _fast_path_applies(self, logits: torch.Tensor, md: SamplingMetadata) -> bool:
        """A talker-like step: no logprobs, masks, bad words, top-p, thinking budget or fp64
        noise; floating-point logits on CPU."""
        if (
            not logits.is_cpu
            or not logits.is_floating_point()
            or self.use_fp64_gumbel
            or md.max_num_logprobs is not None
            or md.logprob_token_ids
            or md.allowed_token_ids_mask is not None
            or md.bad_words_token_ids
            or md.top_p is not None
        ):
            return False
        holder = md.thinking_budget_state_holder
        return holder is None or not holder.has_tracked_requests()

    @staticmethod
    def _kernel_applies(md: SamplingMetadata) -> bool:
        """The C kernel takes any penalties and per-row top-k; argmax-invariant processors run
        between temperature and top-k, so none may be active (vLLM's min-p, off unless asked)."""
        for processor in md.logitsprocs.argmax_invariant:
            if type(processor) is not MinPLogitsProcessor or processor.min_p_count:
                return False
        if md.temperature is not None and not _is_cpu_vector(md.temperature, torch.float32):
            return False
        if md.top_k is not None and not _is_cpu_vector(md.top_k, torch.int32):
            return False
        if md.no_penalties:
            return True
        prompt = md.prompt_token_ids
        return (
            prompt is not None
            and prompt.dtype is torch.int64
            and prompt.is_cpu
            and prompt.ndim == 2
            and prompt.stride(1) == 1
            and all(
                _is_cpu_vector(t, torch.float32)
                for t in (md.repetition_penalties, md.frequency_penalties, md.presence_penalties)
            )
        )

    @staticmethod
    def _numpy_path_applies(md: SamplingMetadata) -> bool:
        """The numpy path: at most a repetition penalty, one top-k for all sampling rows."""
        if not md.no_penalties and (
            md.prompt_token_ids is None
            or _any(md.frequency_penalties, 0.0)
            or _any(md.presence_penalties, 0.0)
        ):
            return False
        return md.all_greedy or md.top_k is None or _uniform_top_k(md) is not None

    def _forward_kernel(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Steps 2-5 for a talker-like step in one C call (``_sampler_kernel.c``): penalties,
        greedy argmax, temperature, top-k and, for rows without a generator, the inverse-CDF
        draw (one uniform per row from torch's default generator). With generators the kernel
        masks below the k-th value and the rows draw vLLM's argmax(softmax / noise), the noise
        from their generators (:func:`_exponential_race`)."""
        with step_stats.timer(PROCESSORS):
            logits = _float32_rows(logits)  # as vLLM: a float32 copy of bf16 logits
            for processor in md.logitsprocs.non_argmax_invariant:
                logits = processor.apply(logits)
            logits = _float32_rows(logits)  # the kernel reads raw float32 rows
        rows, vocab = logits.shape
        if md.temperature is None and not md.all_greedy:
            raise ValueError("sampling_metadata has random rows but no temperature")
        penalties = not md.no_penalties
        prompt = md.prompt_token_ids if penalties else None
        if prompt is not None and (prompt.shape[0] < rows or len(md.output_token_ids) < rows):
            raise ValueError(
                f"sampling_metadata has {prompt.shape[0]} prompt rows and {len(md.output_token_ids)} "
                f"output rows for {rows} rows of logits"
            )
        vectors = ("temperature", "top_k") + (_PENALTY_VECTORS if penalties else ())
        for name in vectors:
            t = getattr(md, name)
            if t is not None and t.shape[0] < rows:
                raise ValueError(f"sampling_metadata.{name} has {t.shape[0]} entries for {rows} rows")
        seeded = bool(md.generators) and not md.all_greedy
        uniforms = None if seeded or md.all_greedy else torch.rand(rows, dtype=torch.float64)
        tokens = torch.empty((rows, 1), dtype=torch.int32)
        phase_ns = np.zeros(3, dtype=np.int64) if step_stats.enabled() else None
        self.kernel.sample_rows(
            logits.data_ptr(),
            rows,
            vocab,
            _ptr(prompt),
            0 if prompt is None else prompt.stride(0),
            0 if prompt is None else prompt.shape[1],
            md.output_token_ids if penalties else None,
            _ptr(md.repetition_penalties) if penalties else None,
            _ptr(md.frequency_penalties) if penalties else None,
            _ptr(md.presence_penalties) if penalties else None,
            None if md.all_greedy else _ptr(md.temperature),
            _ptr(md.top_k),
            _ptr(uniforms),
            tokens.data_ptr(),
            None if phase_ns is None else phase_ns.ctypes.data,
        )
        if phase_ns is not None:
            for name, ns in zip((PENALTIES, TOPK_TOPP, DRAW), phase_ns.tolist(), strict=True):
                step_stats.record(name, ns / 1e6)
        if seeded:
            with step_stats.timer(DRAW):
                # The kernel gave greedy rows their token and the others -1.
                probs = logits.softmax(dim=-1, dtype=torch.float32)
                if self._race_applies(probs, md.generators):
                    tokens = _exponential_race(self.kernel, probs, md.generators, tokens)
                else:
                    q = noise.sampler_exponentials(rows, vocab, md.generators)
                    random = sample_with_exponential_noise(probs, q).view(-1, 1).to(torch.int32)
                    tokens = torch.where(tokens >= 0, tokens, random)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)

    def _forward_fast(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """Steps 2-5 for the talker's parameters with numpy on the logits' memory (a numpy op on
        one 3072-entry row costs ~1 us, a tensor op ~5 us). Same float32 arithmetic as vLLM
        (IEEE products and quotients), so everything up to the draw is bit-equal; seeded rows
        then draw exactly as vLLM does, unseeded rows by inverse CDF over the top-k entries."""
        with step_stats.timer(PROCESSORS):
            logits = _float32_rows(logits)  # as vLLM: a float32 copy of bf16 logits
            for processor in md.logitsprocs.non_argmax_invariant:
                logits = processor.apply(logits)
            logits = _float32_rows(logits)
        if not md.no_penalties:
            with step_stats.timer(PENALTIES):
                logits = _repetition_penalty_sparse(
                    logits, md.prompt_token_ids, md.repetition_penalties, md.output_token_ids
                )
        arr = logits.numpy()
        greedy = None if md.all_random else arr.argmax(axis=1)
        if md.all_greedy:
            return _sampler_output(greedy)
        if md.temperature is None:
            raise ValueError("sampling_metadata has random rows but no temperature")
        with step_stats.timer(TOPK_TOPP):
            temp = md.temperature.numpy()
            if not md.all_random:
                temp = np.where(temp < SAMPLING_EPS, np.float32(1.0), temp)
            np.divide(arr, temp.astype(np.float32, copy=False)[:, None], out=arr)
            for processor in md.logitsprocs.argmax_invariant:
                logits = processor.apply(logits)
            top: tuple[np.ndarray, np.ndarray] | None = None
            arr = logits.numpy()
            vocab = arr.shape[1]
            k = vocab if md.top_k is None else int(_uniform_top_k(md))  # type: ignore[arg-type]
            if 0 < k < vocab:
                # k + 1 entries: the (k+1)-th equal to the k-th means a tie at the threshold.
                values, indices = (t.numpy() for t in logits.topk(k + 1, dim=1))
                kth = values[:, k - 1 : k]
                if md.generators or (values[:, k : k + 1] == kth).any():
                    # Seeded rows need the full masked row; ties at the k-th value keep them all.
                    arr[arr < kth] = -np.inf
                else:
                    top = values[:, :k], indices[:, :k]
        with step_stats.timer(DRAW):
            if md.generators:
                random = self._seeded_draw(logits.softmax(dim=-1, dtype=torch.float32), md.generators).numpy()
            elif top is not None:
                values, indices = top
                random = indices[np.arange(indices.shape[0]), _inverse_cdf_rows(values)]
            else:
                random = _inverse_cdf_rows(arr)
        if greedy is not None:
            random = np.where(md.temperature.numpy() < SAMPLING_EPS, greedy, random)
        return _sampler_output(random)

    def apply_logits_processors(
        self, logits: torch.Tensor, md: SamplingMetadata, predict_bonus_token: bool = False
    ) -> torch.Tensor:
        """Steps 2-3, vLLM's order: allowed ids, bad words, non-invariant processors, penalties."""
        output_token_ids = md.output_token_ids
        if predict_bonus_token and (md.bad_words_token_ids or not md.no_penalties):
            output_token_ids = Sampler._combine_outputs_with_spec_tokens(output_token_ids, md.spec_token_ids)

        with step_stats.timer(PROCESSORS):
            if md.allowed_token_ids_mask is not None:
                logits.masked_fill_(md.allowed_token_ids_mask, float("-inf"))
            if md.bad_words_token_ids:
                apply_bad_words(logits, md.bad_words_token_ids, output_token_ids)
            for processor in md.logitsprocs.non_argmax_invariant:
                logits = processor.apply(logits)

        holder = md.thinking_budget_state_holder
        if md.no_penalties and (holder is None or not holder.has_tracked_requests()):
            return logits
        with step_stats.timer(PENALTIES):
            if not md.no_penalties:
                if md.prompt_token_ids is None:
                    raise ValueError("sampling_metadata has penalties but no prompt_token_ids")
                logits = apply_penalties(
                    logits,
                    md.prompt_token_ids,
                    md.presence_penalties,
                    md.frequency_penalties,
                    md.repetition_penalties,
                    output_token_ids,
                )
            if holder is not None and holder.has_tracked_requests():
                holder.update_state(md.output_token_ids, md.spec_token_ids, repeat_indices=None)
                logits = holder.apply_to_logits(logits, predict_bonus_token, md.spec_token_ids)
        return logits

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Step 4-5: greedy and random tokens from processed logits (may update them in place)."""
        if md.all_greedy and md.all_random:
            raise ValueError("sampling_metadata is both all_greedy and all_random")
        mode = self.logprobs_mode
        if md.all_random:
            greedy = None
        else:
            greedy = logits.argmax(dim=-1).view(-1)
            if md.all_greedy:
                processed = None
                if md.max_num_logprobs is not None or md.logprob_token_ids:
                    if mode == "processed_logits":
                        processed = logits
                    elif mode == "processed_logprobs":
                        processed = logits.log_softmax(dim=-1, dtype=torch.float32)
                return greedy, processed

        if md.temperature is None:
            raise ValueError("sampling_metadata has random rows but no temperature")
        with step_stats.timer(TOPK_TOPP):
            logits = Sampler.apply_temperature(logits, md.temperature, md.all_random)
            for processor in md.logitsprocs.argmax_invariant:
                logits = processor.apply(logits)
            logits = top_k_top_p(logits, md.top_k, md.top_p)
            processed = None
            if mode == "processed_logits":
                processed = logits
            elif mode == "processed_logprobs":
                processed = logits.log_softmax(dim=-1, dtype=torch.float32)

        with step_stats.timer(DRAW):
            probs = logits.softmax(dim=-1, dtype=torch.float32)
            if not md.generators and not self.use_fp64_gumbel:
                # vLLM draws these rows in compiled code whose random stream nothing eager
                # reproduces: any exact sampler of the same distribution is as faithful.
                random = sample_inverse_cdf(probs)
            elif self.use_fp64_gumbel:
                q = noise.sampler_exponentials(
                    probs.shape[0], probs.shape[1], md.generators, dtype=torch.float64, device=probs.device
                )
                random = sample_with_exponential_noise(probs, q)
            else:
                random = self._seeded_draw(probs, md.generators)

        if greedy is None:
            return random, processed
        return torch.where(md.temperature < SAMPLING_EPS, greedy, random, out=greedy), processed

    @staticmethod
    def gather_logprobs(
        logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor
    ) -> LogprobsTensors:
        """Top ``num_logprobs`` logprobs and the sampled token's logprob and rank (as vLLM)."""
        if token_ids.dtype != torch.int64:
            raise ValueError(f"token_ids must be int64, got {token_ids.dtype}")
        topk_logprobs, topk_indices = torch.topk(logprobs, num_logprobs, dim=-1)
        token_ids = token_ids.unsqueeze(-1)
        token_logprobs = logprobs.gather(-1, token_ids)
        ranks = count_at_least(logprobs, token_logprobs)
        indices = torch.cat((token_ids, topk_indices), dim=1).to(torch.int32)
        return LogprobsTensors(indices, torch.cat((token_logprobs, topk_logprobs), dim=1), ranks)

    @staticmethod
    def gather_specific_token_logprobs(
        logprobs: torch.Tensor, logprob_token_ids: dict[int, list[int]], sampled: torch.Tensor
    ) -> LogprobsTensors | None:
        """Logprobs of the sampled token (column 0) and of each row's requested ids, -inf padded."""
        if not logprob_token_ids:
            return None
        batch = logprobs.shape[0]
        width = max(len(t) for t in logprob_token_ids.values()) + 1
        token_ids = torch.zeros(batch, width, dtype=torch.int64)
        valid = torch.zeros(batch, width, dtype=torch.bool)
        valid[:, 0] = True
        for row, ids in logprob_token_ids.items():
            token_ids[row, 1 : len(ids) + 1] = torch.as_tensor(ids, dtype=torch.int64)
            valid[row, 1 : len(ids) + 1] = True
        token_ids = token_ids.to(logprobs.device)
        valid = valid.to(logprobs.device)
        token_ids[:, 0] = sampled
        gathered = logprobs.gather(-1, token_ids).masked_fill(~valid, float("-inf"))
        ranks = count_at_least(logprobs, logprobs.gather(-1, sampled.unsqueeze(-1)))
        return LogprobsTensors(
            logprob_token_ids=token_ids.to(torch.int32), logprobs=gathered, selected_token_ranks=ranks
        )


def timed_refresh_metadata(input_batch: Any) -> SamplingMetadata:
    """``input_batch.refresh_metadata()`` timed as ``sampler.metadata_ms``; returns the metadata.

    Building ``SamplingMetadata`` is the runner's job (``InputBatch.refresh_metadata`` in
    ``_update_states``); a CPU runner calls this instead to see that cost beside the sampler's.
    """
    with step_stats.timer(METADATA):
        input_batch.refresh_metadata()
    return input_batch.sampling_metadata
