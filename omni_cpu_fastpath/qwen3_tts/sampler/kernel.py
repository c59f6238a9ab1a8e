"""CpuSampler's C kernel (``_kernel.c``, built by ``setup.py``): loading it, checking it, calling it.

The kernel has two entry points:

- ``sample_rows`` (:func:`sample_rows`): the talker's step 3-5 in one call - the penalties (all
  three), greedy argmax, temperature, per-row top-k and, for rows without a generator, an
  inverse-CDF draw over the kept entries (one uniform per row from torch's default generator).
  With generators it masks below the k-th value instead and leaves the draw to the caller.
- ``exponential_race`` (:func:`exponential_race`): vLLM's ``argmax(probs / q)`` with ``q`` taken
  from the generators' own mt19937 streams as ATen's ``exponential_`` takes them (bit-equal
  tokens and generator states, the log computed only where ``probs > 0``). It is checked against
  torch once per process (:func:`race_matches_torch`); torch's own draw serves otherwise
  (:func:`seeded_draw`). Every seeded draw of CpuSampler goes this way.

The kernel reads raw pointers, so this wrapper checks dtypes, shapes and contiguity first
(:func:`accepts`, and the row counts in :func:`sample_rows`). The extension is optional: where
it was not built ``KERNEL_MISSING`` says why and CpuSampler takes its numpy road.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch
from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.ops.topk_topp_sampler import sample_with_exponential_noise

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.qwen3_tts import noise
from omni_cpu_fastpath.qwen3_tts.sampler.stats import DRAW, PENALTIES, TOPK_TOPP

try:  # optional: setup.py builds it where a C compiler is found
    from . import _kernel as extension
except ImportError as _exc:
    extension = None
    KERNEL_MISSING = f"the C kernel is not built ({type(_exc).__name__}: {_exc})"
else:
    KERNEL_MISSING = ""

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

_PENALTY_VECTORS = ("repetition_penalties", "frequency_penalties", "presence_penalties")
_NO_ROW = np.zeros(1, dtype=np.uint8)  # a score mask of one row, not scored


def load(want: bool) -> tuple[Any, str]:
    """The extension (None when not ``want`` or not built) and what serves the talker's step."""
    if not want:
        return None, "numpy (C kernel off: VLLM_OMNI_CPU_SAMPLER_KERNEL=0)"
    if extension is None:
        logger.warning("CpuSampler: %s; the talker's step takes the numpy path", KERNEL_MISSING)
        return None, f"numpy ({KERNEL_MISSING}; reinstall with a C compiler to build it)"
    race_matches_torch(extension)  # once per process, here rather than in a first step
    return extension, "C kernel"


def accepts(md: SamplingMetadata) -> bool:
    """Whether :func:`sample_rows` takes this step's parameters: any penalties and per-row top-k,
    as CPU vectors of the kernel's dtypes. Argmax-invariant processors run between temperature
    and top-k, so none may be active (vLLM's min-p, off unless asked)."""
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


def sample_rows(kernel: Any, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The kernel's ``sample_rows`` on contiguous float32 ``logits`` (modified in place): tokens
    ([rows, 1] int32), -1 for the rows left to a seeded draw (their logits masked below the
    k-th value). The kernel times its phases as the step timers."""
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
    kernel.sample_rows(
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
    return tokens


def race_applies(kernel: Any, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> bool:
    """Whether :func:`exponential_race` can draw for these probabilities and generators here."""
    return (
        kernel is not None
        and probs.dtype == torch.float32
        and probs.device.type == "cpu"
        and all(g.device.type == "cpu" for g in generators.values())
        and race_matches_torch(kernel)
    )


def seeded_draw(kernel: Any, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """vLLM's ``argmax(probs / q)`` ([rows] int64) with float32 noise consumed as its CPU path
    consumes it: by the C kernel where it runs here, else by torch (``noise``)."""
    if race_applies(kernel, probs, generators):
        tokens = torch.full((probs.shape[0], 1), -1, dtype=torch.int32)
        return exponential_race(kernel, probs, generators, tokens).view(-1).long()
    q = noise.sampler_exponentials(probs.shape[0], probs.shape[1], generators, device=probs.device)
    return sample_with_exponential_noise(probs, q)


def exponential_race(
    kernel: Any, probs: torch.Tensor, generators: dict[int, torch.Generator], tokens: torch.Tensor
) -> torch.Tensor:
    """``argmax(probs / q)`` into the rows of ``tokens`` ([rows, 1] int32) that hold -1, with
    ``q`` drawn as :func:`noise.sampler_exponentials` draws it (vLLM's CPU path: the default
    generator over the whole batch, then each seeded row from its own generator), by the C
    kernel on copies of the generators' states, which are then set back. Rows already decided
    (greedy: a token >= 0) keep it, their noise still consumed. Bit-equal tokens and states;
    the log of the noise is only computed where ``probs > 0`` (few entries after top-k)."""
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


@functools.cache
def race_matches_torch(kernel: Any) -> bool:
    """Whether :func:`exponential_race` gives vLLM's tokens and generator states here (ATen's
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
                tokens = exponential_race(kernel, probs, gens, torch.full((rows, 1), -1, dtype=torch.int32))
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


def _is_cpu_vector(t: torch.Tensor, dtype: torch.dtype) -> bool:
    # Property reads, not t.device.type / t.stride(): served, each step finds the caches cold
    # (the predictor streamed its weights in between), so every distinct call counts.
    return t.dtype is dtype and t.is_cpu and t.ndim == 1 and t.is_contiguous()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
