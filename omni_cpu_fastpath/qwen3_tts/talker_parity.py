"""Teacher-forced parity and decode timing of the talker's decoder with int8 linears.

The talker is vllm-omni's own (``testing.stock.build_stock_talker``), built and loaded as a worker
builds it, with or without the int8 quantization method of ``quant/talker_int8.py``. Its layers run
here with vLLM's own modules (RMSNorms, the quantized or float linears, RoPE, the MLP) and a plain
causal SDPA in place of vLLM's paged attention, which needs a runner's KV cache; the attention is
the same float code for every variant, so the differences measured are the linears'.

Parity: one forward over ``positions`` random codec-0 embeddings per sequence (teacher forcing:
every position sees the same inputs whatever it would have sampled), codec logits restricted to the
ids the talker may sample (codes ``[1, codebook)`` and codec EOS), against the fp32 talker; bf16
is the control, as for the predictor (``parity.default_rule``).

In situ (``VLLM_OMNI_TALKER_PARITY_CHECK=1`` with ``VLLM_OMNI_TALKER_INT8`` or
``VLLM_OMNI_TALKER_COMPILE`` on): :class:`TalkerParityChecker` runs the served talker's decoder
once more per forward, before the served run, eager (not through vLLM's compiled graph) and with
every int8 layer serving its float weight as loaded (the bf16 eager reference of the same layers, on
the same inputs and the same KV history), and records codec-0 parity of every position of the
forward into ``step_stats`` as ``talker.parity.{top1,top5,kl,max_logit_diff}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omni_cpu_fastpath import step_stats

from .parity import parity_metrics, summarize_metrics

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

# Variant -> (model dtype, talker int8 scheme or None). fp32 is the reference.
TALKER_VARIANTS: dict[str, tuple[torch.dtype, str | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "w8-plain": (torch.bfloat16, "w8-plain"),
    "w8-channel": (torch.bfloat16, "w8-channel"),
    "w8-group": (torch.bfloat16, "w8-group"),
    "w8-group-a8": (torch.bfloat16, "w8-group-a8"),
}
TALKER_PARITY_VARIANTS = ("bf16", "w8-plain", "w8-channel", "w8-group", "w8-group-a8")
TALKER_PARITY_PREFIX = "talker.parity"


def build_talker(model_dir: str | Path, variant: str) -> tuple[nn.Module, Any]:
    """vllm-omni's talker for ``model_dir`` in ``variant`` (``fp32``/``bf16``/an int8 scheme)."""
    from omni_cpu_fastpath.serving.stage_settings import TALKER_INT8_METHODS
    from omni_cpu_fastpath.testing.stock import build_stock_talker

    dtype, scheme = TALKER_VARIANTS[variant]
    if scheme is None:
        return build_stock_talker(model_dir, dtype)
    from .quant.talker_int8 import hand_input_gains

    # As FastQwen3TTSTalker.load_weights does: the int8 linears get their RMSNorm gains.
    return build_stock_talker(
        model_dir, dtype, quantization=TALKER_INT8_METHODS[scheme], after_load=hand_input_gains
    )


class KVCache:
    """Per-layer K/V ``[B, kv_heads, S, head_dim]`` for :func:`decoder_forward` (decode timing)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def append(self, i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if i in self.k:
            k = torch.cat([self.k[i], k], dim=2)
            v = torch.cat([self.v[i], v], dim=2)
        self.k[i], self.v[i] = k, v
        return k, v


def _attention(
    attn: nn.Module, i: int, pos: torch.Tensor, h: torch.Tensor, cache: KVCache | None
) -> torch.Tensor:
    bsz, t, _ = h.shape
    hd = attn.head_dim
    qkv, _ = attn.qkv_proj(h)
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = attn.q_norm(q.reshape(bsz * t, -1, hd)).reshape(bsz * t, -1)
    k = attn.k_norm(k.reshape(bsz * t, -1, hd)).reshape(bsz * t, -1)
    q, k = attn.rotary_emb(pos.repeat(bsz), q, k)
    q = q.reshape(bsz, t, -1, hd).transpose(1, 2)
    k = k.reshape(bsz, t, -1, hd).transpose(1, 2)
    v = v.reshape(bsz, t, -1, hd).transpose(1, 2)
    past = 0
    if cache is not None:
        past = int(cache.k[i].shape[2]) if i in cache.k else 0
        k, v = cache.append(i, k, v)
    groups = attn.num_heads // attn.num_kv_heads
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    # Causal with a prefix: query j (absolute past + j) sees keys 0 .. past + j.
    mask = torch.ones(t, past + t, dtype=torch.bool).tril(diagonal=past)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
    out, _ = attn.o_proj(o.transpose(1, 2).reshape(bsz, t, -1))
    return out


@torch.inference_mode()
def decoder_forward(
    talker: nn.Module, embeds: torch.Tensor, cache: KVCache | None = None, start: int = 0
) -> torch.Tensor:
    """Final-norm hidden states ``[B, T, H]`` of the talker's decoder for input embeddings ``[B, T, H]``."""
    model = talker.model
    dtype = next(p.dtype for p in model.norm.parameters())
    x = embeds.to(dtype)
    pos = torch.arange(start, start + x.shape[1])
    for i, layer in enumerate(model.layers):
        x = x + _attention(layer.self_attn, i, pos, layer.input_layernorm(x), cache)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def codec_ids(talker: nn.Module) -> torch.Tensor:
    """The ids the talker may sample: codes ``[1, codebook)`` and codec EOS (its logit mask)."""
    return torch.nonzero(~talker._codec_disallowed_mask).flatten()


@torch.inference_mode()
def codec_logits(talker: nn.Module, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """fp32 logits of the codec head over ``ids`` (``[..., len(ids)]``)."""
    w = talker.lm_head.weight.index_select(0, ids)
    return F.linear(hidden.to(w.dtype), w).float()


def make_embeds(talker: nn.Module, seqs: int, positions: int, seed: int = 0) -> torch.Tensor:
    """``[seqs, positions, H]`` fp32 rows of the talker's codec-0 embedding for random codes."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(1, int(talker._codebook_vocab_size), (seqs, positions), generator=g)
    with torch.inference_mode():
        return talker.model.embed_tokens(codes).float()


def teacher_forced_logits(talker: nn.Module, vllm_config: Any, embeds: torch.Tensor) -> torch.Tensor:
    """Codec logits ``[B, T, V']`` of every position, one causal forward (teacher forcing)."""
    from vllm.config.vllm import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        hidden = decoder_forward(talker, embeds)
        return codec_logits(talker, hidden, codec_ids(talker))


def talker_parity_table(
    model_dir: str | Path,
    positions: int = 64,
    seqs: int = 2,
    variants: Sequence[str] = TALKER_PARITY_VARIANTS,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Teacher-forced parity of each talker variant against fp32 over ``seqs x positions`` positions.

    Rows: ``variant``, ``top1``, ``top5``, ``kl``, ``max_logit_diff``, ``positions``; an int8 row
    also carries ``vs_bf16`` (the same metrics against the bf16 talker, what serves without int8).
    """
    ref, cfg = build_talker(model_dir, "fp32")
    embeds = make_embeds(ref, seqs, positions, seed)
    logits = {"fp32": teacher_forced_logits(ref, cfg, embeds)}
    del ref
    rows = []
    for variant in variants:
        t0 = time.perf_counter()
        model, cfg = build_talker(model_dir, variant)
        logits[variant] = teacher_forced_logits(model, cfg, embeds)
        del model
        gc.collect()
        row: dict[str, Any] = {"variant": variant, **_summary(logits["fp32"], logits[variant])}
        if variant != "bf16" and "bf16" in logits:
            row["vs_bf16"] = _summary(logits["bf16"], logits[variant])
        row["positions"] = int(embeds.shape[0] * embeds.shape[1])
        logger.info("talker parity %s: %s (%.1f s)", variant, row, time.perf_counter() - t0)
        rows.append(row)
    return rows


def _summary(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    v = reference.shape[-1]
    # Every position is one row of one "sub-step": means over all positions.
    return summarize_metrics(parity_metrics(reference.reshape(-1, 1, v), candidate.reshape(-1, 1, v)))


def decode_ms(
    model_dir: str | Path, variant: str, context: int = 64, steps: int = 16, batch: int = 1
) -> dict[str, Any]:
    """Median (and best) ms of one talker decode step (the decoder's 28 layers, final norm, codec head) at
    ``batch`` rows after ``context`` cached positions, and the bytes of weights each step reads."""
    from vllm.config.vllm import set_current_vllm_config

    talker, cfg = build_talker(model_dir, variant)
    embeds = make_embeds(talker, batch, context + steps)
    ids = codec_ids(talker)
    times = []
    with set_current_vllm_config(cfg):
        cache = KVCache()
        decoder_forward(talker, embeds[:, :context], cache)
        for s in range(steps):
            t0 = time.perf_counter()
            h = decoder_forward(talker, embeds[:, context + s : context + s + 1], cache, start=context + s)
            codec_logits(talker, h, ids)
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {
        "variant": variant,
        "batch": batch,
        "context": context,
        "ms": times[len(times) // 2],
        "best_ms": times[0],  # on a shared machine the best step is the least disturbed
        "weight_bytes": weight_bytes(talker),
    }


def weight_bytes(talker: nn.Module) -> int:
    """Bytes of weights one decode step reads: the decoder linears as stored (int8 + scales, or the
    float dtype; vLLM's CPU method may have moved a float weight into a packed handle) and the
    codec head."""
    from vllm.model_executor.layers.linear import LinearBase

    from .quant.talker_int8 import TalkerW8LinearMethod

    total = 0
    for module in talker.model.layers.modules():
        if not isinstance(module, LinearBase):
            continue
        n, k = module.output_size_per_partition, module.input_size_per_partition
        if isinstance(module.quant_method, TalkerW8LinearMethod):
            total += n * k + n * module.scales.element_size()
            if module.float_weight is not None:
                total += module.float_weight.numel() * module.float_weight.element_size()
        else:
            # The model's dtype (the layer's params_dtype is the dtype it was constructed in).
            total += n * k * talker.lm_head.weight.element_size()
    head = talker.lm_head.weight
    return int(total + head.numel() * head.element_size())


class TalkerParityChecker:
    """In-situ codec-0 parity of the served talker (int8, compiled) against its eager float self
    (module docstring).

    ``run(forward, *args, **kwargs)``: ``forward`` is the talker's decoder forward; it runs first
    inside ``talker_int8.reference_linears()`` and :func:`eager_decoder` on copies of the tensor
    arguments (vLLM's fused residual RMSNorm may add into the input embeddings in place), writing its
    K/V for this step's positions, then as served on the originals, which overwrites those K/V, so
    the cache keeps the served history. The served output is returned and the parity of every
    position recorded.
    """

    def __init__(self, talker: nn.Module, prefix: str = TALKER_PARITY_PREFIX) -> None:
        self.talker = talker
        self.prefix = prefix
        self.ids: torch.Tensor | None = None  # codec_ids, once the talker is built

    def run(self, forward: Any, *args: Any, timer: str | None = None, **kwargs: Any) -> Any:
        from .quant.talker_int8 import reference_linears

        def copied(v: Any) -> Any:
            return v.clone() if isinstance(v, torch.Tensor) else v

        t0 = time.perf_counter()
        with reference_linears(), eager_decoder(self.talker):
            reference = forward(*map(copied, args), **{k: copied(v) for k, v in kwargs.items()})
        spent = time.perf_counter() - t0
        with step_stats.timer(timer, sync=True) if timer else contextlib.nullcontext():
            served = forward(*args, **kwargs)
        if isinstance(served, torch.Tensor) and isinstance(reference, torch.Tensor):
            t0 = time.perf_counter()
            self.check(reference, served)
            spent += time.perf_counter() - t0
        step_stats.record(f"{self.prefix}.check_ms", spent * 1e3)
        return served

    @torch.inference_mode()
    def check(self, reference_hidden: torch.Tensor, served_hidden: torch.Tensor) -> dict[str, torch.Tensor]:
        """Record the metrics of every row (position) of two ``[..., H]`` final hidden states."""
        if self.ids is None:
            self.ids = codec_ids(self.talker)
        ref = codec_logits(self.talker, reference_hidden, self.ids)
        served = codec_logits(self.talker, served_hidden, self.ids)
        v = ref.shape[-1]
        # One "sub-step" per position: a value per position, as the offline table pools them.
        metrics = parity_metrics(ref.reshape(1, -1, v), served.reshape(1, -1, v))
        for name, values in metrics.items():
            for x in values.tolist():
                step_stats.record(f"{self.prefix}.{name}", x)
        return metrics


@contextlib.contextmanager
def eager_decoder(talker: nn.Module) -> Iterator[None]:
    """Inside: the talker's decoder (vLLM's ``Qwen3Model``, which ``support_torch_compile`` wraps)
    runs its Python forward, not vLLM's compiled graph; a decoder that does not compile is unchanged.
    ``do_not_compile`` is the attribute vLLM's wrapper reads at every call, set per instance."""
    model = talker.model
    before = getattr(model, "do_not_compile", None)
    if before is None:
        yield
        return
    model.do_not_compile = True
    try:
        yield
    finally:
        model.do_not_compile = before


def cli_talker_parity(args: argparse.Namespace) -> int:
    """``omni-cpu-fastpath parity MODEL --talker [--positions N] [--json]``."""
    from .parity import print_parity_rows

    rows = talker_parity_table(args.model, positions=args.positions)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print_parity_rows(rows, "talker")
    print(f"({rows[0]['positions']} positions teacher-forced against the fp32 talker, codec-0 logits)")
    return 0
