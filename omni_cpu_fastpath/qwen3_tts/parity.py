"""Parity of a served code predictor against a higher-precision one: teacher-forced logits, the
metrics (top-1, top-5, KL, max logit difference), the in-situ checker and the offline table.

In situ (``VLLM_OMNI_PREDICTOR_PARITY_CHECK=1``): :class:`ParityChecker` keeps a higher-precision
copy of the predictor, runs it teacher-forced on the codes the served predictor produced, and
records per sub-step top-1 agreement, top-5 overlap, KL(reference || served) and the largest logit
difference into ``step_stats`` (``predictor.parity.top1`` ...). Offline: ``omni-cpu-fastpath
parity MODEL`` (:func:`cli_parity`) runs the same for every int8 variant, with ``bf16`` as a
control. ``parity MODEL --talker`` does the same for the talker's int8 decoder linears
(``qwen3_tts/talker_parity.py``).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.qwen3_tts.predictor import CachedCodePredictor
from omni_cpu_fastpath.qwen3_tts.quant import QuantError, config_for, quantize_predictor
from omni_cpu_fastpath.serving.stage_settings import QWEN3_TTS_STAGES

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

# Variants of the offline parity table: the int8 ones plus a bf16 control (fp32 is the reference).
PARITY_VARIANTS = ("bf16", "ao-dynamic", "ao-nohead", "torchao-w8", "w8-channel", "w8-bf16head")
PARITY_PREFIX = "predictor.parity"

# The rule for the CPU default, relative to the bf16 control of the same parity table (README, int8
# fidelity): top-1 at most 2 points below bf16's, KL at most 3x bf16's.
DEFAULT_TOP1_SLACK = 0.02
DEFAULT_KL_FACTOR = 3.0
# Rows of a served decode step at most: the talker stage's max_num_seqs in the CPU deploy config.
SERVED_ROWS = QWEN3_TTS_STAGES[0].max_num_seqs


@torch.inference_mode()
def teacher_forced_logits(
    predictor: nn.Module,
    layer0_code: torch.Tensor,
    layer0_embed: torch.Tensor,
    last_talker_hidden: torch.Tensor,
    codes: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[B, 15, V]`` fp32 of every sub-step with the inputs fixed to ``codes`` ``[B, 16]``.

    For a :class:`CachedCodePredictor`: its own static step, KV-cached as served (eager); ``codes``
    may also be the ``[B, 15]`` residual codes. For vllm-omni's stock wrapper: one causal
    re-prefill over the 16 positions (what its loop does).
    """
    if isinstance(predictor, CachedCodePredictor):
        return _cached_teacher_forced(predictor, layer0_code, layer0_embed, last_talker_hidden, codes)
    bsz = int(codes.shape[0])
    steps = len(predictor.lm_head)
    if codes.shape != (bsz, steps + 1):
        raise ValueError(f"codes must be [B, {steps + 1}], got {tuple(codes.shape)}")
    dtype = next(predictor.model.parameters()).dtype
    proj = predictor.small_to_mtp_projection
    embeds = predictor.model.codec_embedding
    xs = [last_talker_hidden.reshape(bsz, 1, -1).to(dtype), layer0_embed.reshape(bsz, 1, -1).to(dtype)]
    xs += [embeds[s](codes[:, s + 1 : s + 2].long()).to(dtype) for s in range(steps - 1)]
    x = proj(torch.cat(xs, dim=1))
    pos = torch.arange(x.shape[1]).unsqueeze(0).expand(bsz, -1)
    hidden = predictor.model(x, pos)
    return torch.stack([predictor.lm_head[s](hidden[:, s + 1]).float() for s in range(steps)], dim=1)


def _cached_teacher_forced(
    pred: CachedCodePredictor,
    layer0_code: torch.Tensor,
    layer0_embed: torch.Tensor,
    last_talker_hidden: torch.Tensor,
    codes: torch.Tensor,
) -> torch.Tensor:
    # Sub-step s sees the embeddings of codes 1..s-1 whatever it would have sampled.
    bsz = int(layer0_code.shape[0])
    steps, groups = pred.num_steps, pred.num_code_groups
    if codes.dim() != 2 or codes.shape[0] != bsz or codes.shape[1] not in (steps, groups):
        raise ValueError(
            f"codes must be [B, {groups}] or [B, {steps}] with B={bsz}, got {tuple(codes.shape)}"
        )
    residual = codes[:, -steps:].long()
    if bool(((residual < 0) | (residual >= pred.vocab_size)).any()):
        raise ValueError(f"codes must lie in [0, {pred.vocab_size})")
    dtype = pred.dtype
    out = []
    with pred.compiler.thread_cap():
        x = pred.prefill_inputs(last_talker_hidden, layer0_embed)
        caches = pred.new_caches(bsz, dtype)
        for s in range(steps):
            pos, mask, head_idx = pred.step_inputs(s)
            hidden = pred.forward_static_step(x, pos, mask, caches)[:, -1]
            out.append(pred.heads(hidden, head_idx).float())
            x = pred.embed_code(residual[:, s], head_idx, dtype)
    return torch.stack(out, dim=1)


def parity_metrics(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per sub-step metrics of ``candidate`` logits against ``reference`` logits (``[B, S, V]``).

    ``top1``: fraction of rows with the same argmax; ``top5``: mean |top5 ∩ top5| / 5; ``kl``: mean
    KL(softmax(reference) || softmax(candidate)) in nats, computed in float64; ``max_logit_diff``:
    max |reference - candidate|. Each is a ``[S]`` float64 tensor.
    """
    if reference.shape != candidate.shape or reference.dim() != 3:
        raise ValueError(
            f"logits must both be [B, S, V]; got {tuple(reference.shape)} and {tuple(candidate.shape)}"
        )
    ref = reference.to(torch.float64)
    cand = candidate.to(torch.float64)
    top1 = (ref.argmax(-1) == cand.argmax(-1)).to(torch.float64).mean(0)
    k = min(5, ref.shape[-1])
    r5 = ref.topk(k, dim=-1).indices
    c5 = cand.topk(k, dim=-1).indices
    overlap = (r5[..., :, None] == c5[..., None, :]).any(-1).to(torch.float64).sum(-1) / k
    top5 = overlap.mean(0)
    logp = ref.log_softmax(-1)
    logq = cand.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).clamp_min(0.0).mean(0)
    diff = (ref - cand).abs().amax(dim=(0, 2))
    return {"top1": top1, "top5": top5, "kl": kl, "max_logit_diff": diff}


def summarize_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Means over sub-steps (max for ``max_logit_diff``)."""
    out = {k: float(v.mean()) for k, v in metrics.items() if k != "max_logit_diff"}
    out["max_logit_diff"] = float(metrics["max_logit_diff"].max())
    return out


@dataclass
class ParityResult:
    per_substep: dict[str, torch.Tensor]

    @property
    def summary(self) -> dict[str, float]:
        return summarize_metrics(self.per_substep)


class ParityChecker:
    """Teacher-forced parity of the served predictor against a higher-precision copy.

    ``ParityChecker(reference)``: ``reference`` is a predictor that keeps the higher-precision
    weights (make it with :func:`reference_copy` *before* quantizing the served one). ``check``
    re-runs it on the inputs and served codes of one talker step and records, per sub-step, the
    metrics of :func:`parity_metrics` into ``step_stats`` as ``predictor.parity.{top1,top5,kl,
    max_logit_diff}`` (15 values per call). Served logits are those the served predictor computed
    (``CachedCodePredictor.forward_cached(return_logits=True)``); without them ``candidate`` (the
    served module) is run teacher-forced too.
    """

    def __init__(self, reference: nn.Module, candidate: nn.Module | None = None, prefix: str = PARITY_PREFIX):
        self.reference = reference
        self.candidate = candidate
        self.prefix = prefix

    @torch.inference_mode()
    def check(
        self,
        layer0_code: torch.Tensor,
        layer0_embed: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        served_codes: torch.Tensor,
        served_logits: torch.Tensor | None = None,
    ) -> ParityResult:
        if served_logits is None:
            if self.candidate is None:
                raise ValueError("ParityChecker.check needs served_logits or a candidate predictor")
            served_logits = teacher_forced_logits(
                self.candidate, layer0_code, layer0_embed, last_talker_hidden, served_codes
            )
        with step_stats.timer(f"{self.prefix}.check_ms"):
            ref = teacher_forced_logits(
                self.reference, layer0_code, layer0_embed, last_talker_hidden, served_codes
            )
            metrics = parity_metrics(ref, served_logits.float())
        for name, values in metrics.items():
            for v in values.tolist():
                step_stats.record(f"{self.prefix}.{name}", v)
        return ParityResult(metrics)


def reference_copy(predictor: nn.Module, dtype: torch.dtype = torch.float32) -> nn.Module:
    """An eager, higher-precision copy of a (not yet quantized) predictor for :class:`ParityChecker`.

    A :class:`CachedCodePredictor` is rebuilt around a copy of its stock module (compile off); the
    stock wrapper is deep-copied. Either way the copy shares nothing with ``predictor``.
    """
    if isinstance(predictor, CachedCodePredictor):
        stock = copy.deepcopy(predictor.stock).to(dtype)
        return CachedCodePredictor(stock, compile="off", threads=predictor.threads, warmup=False)
    return copy.deepcopy(predictor).to(dtype)


# ---------------------------------------------------------------------------------------------
# Offline parity (omni-cpu-fastpath parity MODEL)
# ---------------------------------------------------------------------------------------------


@dataclass
class ParityInputs:
    layer0_code: torch.Tensor  # [N, 1]
    layer0_embed: torch.Tensor  # [N, 1, Ht]
    last_talker_hidden: torch.Tensor  # [N, 1, Ht]
    codes: torch.Tensor  # [N, 16], sampled by the fp32 reference


def build_variant(
    stock: nn.Module, variant: str, compile: str = "off", buckets: Sequence[int] | None = None
) -> nn.Module:
    """A CachedCodePredictor around a copy of ``stock`` in ``variant`` (``fp32``/``bf16``/int8 name)."""
    stock = copy.deepcopy(stock)
    if variant == "bf16":
        stock = stock.to(torch.bfloat16)
    elif variant != "fp32":
        stock = stock.to(torch.float32)
    kw = {"buckets": tuple(buckets)} if buckets else {}
    cached = CachedCodePredictor(stock, compile="off", warmup=False, **kw)
    if variant not in ("fp32", "bf16"):
        quantize_predictor(cached, variant, compile=compile)
    if compile == "step":
        cached.compiler.mode = "step"
        cached.warmup()
        if cached.compiler.steps is None:
            raise QuantError(f"torch.compile of the {variant} predictor step failed (see log)")
    return cached


def make_inputs(model_dir: str | Path, reference: nn.Module, frames: int, seed: int = 0) -> ParityInputs:
    """Random talker steps for ``frames`` frames; codes sampled by ``reference`` (temp 0.9, top-k 50).

    Layer-0 codes are uniform codebook ids and their embeddings the checkpoint's layer-0 table; the
    talker hidden is Gaussian with unit RMS per channel (the scale of the talker's final RMSNorm
    output) times that norm's weight when the checkpoint has it.
    """
    from omni_cpu_fastpath.testing.stock import iter_checkpoint, layer0_embedding

    g = torch.Generator().manual_seed(seed)
    vocab = int(reference.config.vocab_size)
    code0 = torch.randint(0, vocab, (frames, 1), generator=g)
    embed0 = layer0_embedding(model_dir, code0)
    hidden = torch.randn(frames, 1, embed0.shape[-1], generator=g)
    for name, t in iter_checkpoint(model_dir, "talker.model.norm.weight"):
        if name == "talker.model.norm.weight":
            hidden = hidden * t.float()
    with torch.inference_mode():
        codes = reference(code0, embed0, hidden, do_sample=True, temperature=0.9, top_k=50, generator=g)
    return ParityInputs(code0, embed0, hidden, codes)


def measure_parity(
    reference: nn.Module, candidate: nn.Module, inputs: ParityInputs, per_row: bool = False
) -> dict[str, float]:
    """Teacher-forced parity summary of ``candidate`` against ``reference`` over ``inputs``.

    ``per_row``: run the candidate one frame at a time (activation-quantized variants see batch-1
    per-tensor scales, as in batch-1 serving). Otherwise it runs in batches of at most
    :data:`SERVED_ROWS` frames, as served decode steps do, so that the products are the ones that
    serve them (the few-row kernel where it is on, not the many-row GEMM of one big batch).
    """
    args = (inputs.layer0_code, inputs.layer0_embed, inputs.last_talker_hidden, inputs.codes)
    ref = teacher_forced_logits(reference, *args)
    n, rows = len(inputs.codes), 1 if per_row else SERVED_ROWS
    # One thread for one-row calls: on a busy machine their thread sync costs more than the math.
    prev = torch.get_num_threads()
    torch.set_num_threads(1 if per_row else prev)
    try:
        batches = [slice(i, i + rows) for i in range(0, n, rows)]
        cand = torch.cat([teacher_forced_logits(candidate, *(a[b] for a in args)) for b in batches])
    finally:
        torch.set_num_threads(prev)
    out = summarize_metrics(parity_metrics(ref, cand))
    out["frames"] = n
    return out


def parity_table(
    model_dir: str | Path, frames: int = 64, variants: Sequence[str] = PARITY_VARIANTS, seed: int = 0
) -> list[dict[str, Any]]:
    """Offline parity of each variant against fp32 (rows: variant, top1, top5, kl, max_logit_diff, frames)."""
    from omni_cpu_fastpath.testing.stock import build_stock_predictor

    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    stock = build_stock_predictor(model_dir, torch.float32)
    reference = build_variant(stock, "fp32")
    inputs = make_inputs(model_dir, reference, frames, seed)
    rows = []
    for variant in variants:
        cand = build_variant(stock, variant)
        per_row = variant not in ("fp32", "bf16") and config_for(variant).quantizes_activations
        t0 = time.perf_counter()
        row = {"variant": variant, **measure_parity(reference, cand, inputs, per_row=per_row)}
        logger.info("parity %s: %s (%.1f s)", variant, row, time.perf_counter() - t0)
        rows.append(row)
        del cand
    return rows


def default_rule(rows: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Which int8 rows meet the default's bound relative to the bf16 row of the same table."""
    bf16 = next(r for r in rows if r["variant"] == "bf16")
    return {
        r["variant"]: r["top1"] >= bf16["top1"] - DEFAULT_TOP1_SLACK
        and r["kl"] <= DEFAULT_KL_FACTOR * bf16["kl"]
        for r in rows
        if r["variant"] != "bf16"
    }


def cli_parity(args: argparse.Namespace) -> int:
    """``omni-cpu-fastpath parity MODEL [--frames N] [--json]``; ``--talker``: the talker's table."""
    if getattr(args, "talker", False):
        from .talker_parity import cli_talker_parity

        return cli_talker_parity(args)
    rows = parity_table(args.model, frames=args.frames)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print_parity_rows(rows, "variant")
    print(f"({rows[0]['frames']} frames teacher-forced against fp32, codes sampled by fp32)")
    return 0


def print_parity_rows(rows: list[dict[str, Any]], first_column: str) -> None:
    """A parity table as text, each quantized row marked by the default rule's verdict."""
    ok = default_rule(rows)
    print(f"{first_column:<12} {'top1':>7} {'top5':>7} {'kl':>10} {'max_diff':>9}  bound (vs bf16)")
    for r in rows:
        mark = "" if r["variant"] == "bf16" else ("ok" if ok[r["variant"]] else "outside")
        print(
            f"{r['variant']:<12} {r['top1']:>7.4f} {r['top5']:>7.4f} {r['kl']:>10.3e} "
            f"{r['max_logit_diff']:>9.4f}  {mark}"
        )
