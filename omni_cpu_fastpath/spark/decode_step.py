"""One Spark-X2.5 decode step as a plain ``nn.Module`` with explicit caches, for export.

``SparkDecodeStep`` computes the logits of ONE token of ONE sequence from the past keys and values,
passed in as tensors; it holds only the weights, so ``torch.export.export`` gives a program with
static shapes (AOTInductor, ExecuTorch) and no state of its own.

Inputs, in order (``INPUT_NAMES``); ``S`` / ``F`` sliding / full layers, ``W`` the window (512),
``C`` the full layers' context capacity, fixed per export:

| name | shape | dtype |
|---|---|---|
| ``tokens`` | [1] | int64 |
| ``cos_full``, ``sin_full`` | [rotary_dim_full / 2] (32: 64 dims at theta 5e6) | fp32 |
| ``cos_sliding``, ``sin_sliding`` | [rotary_dim_sliding / 2] (128: 256 dims at theta 1e4) | fp32 |
| ``mask_full`` | [C], additive (0 or -inf) over the full caches' slots | fp32 |
| ``mask_sliding`` | [W], additive over the ring's slots | fp32 |
| ``k_full``, ``v_full`` | [F, kv_heads, C, head_dim] | weight dtype |
| ``k_sliding``, ``v_sliding`` | [S, kv_heads, W, head_dim], a ring: position p in slot p % W | weight dtype |

Outputs (``OUTPUT_NAMES``): ``logits`` [vocab] fp32, then the step's OWN keys and values per
layer type, ``new_k_full`` / ``new_v_full`` [F, kv_heads, head_dim] and ``new_k_sliding`` /
``new_v_sliding`` [S, kv_heads, head_dim]. Returning the new entries, not updated caches, keeps
the program free of input mutation (which exports and lowers unevenly) and the outputs small; the
host writes them (``DecodeState``). The current token always attends to itself, so the masks
cover only the past slots. Keys are stored after RoPE.

``DecodeState`` is the host side: it owns the caches, builds the angles (float64, as the
reference) and the masks, writes each step's entries (ring slot ``pos % W``, full slot ``pos``),
prefills by stepping, and moves to the next context bucket (a re-export) when ``C`` is full.

Numerics follow ``testing/spark_reference.py``: fp32 residual stream, RMSNorm variance in fp32
cast to the weight dtype, RoPE in fp32, attention scores and softmax in fp32, the head gate
sigmoid in fp32.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(f"vllm.{__name__}")

FULL, SLIDING = "full_attention", "sliding_attention"
INPUT_NAMES = (
    "tokens",
    "cos_full",
    "sin_full",
    "cos_sliding",
    "sin_sliding",
    "mask_full",
    "mask_sliding",
    "k_full",
    "v_full",
    "k_sliding",
    "v_sliding",
)
OUTPUT_NAMES = ("logits", "new_k_full", "new_v_full", "new_k_sliding", "new_v_sliding")
# Context capacities the full layers' caches grow through (one export each).
CONTEXT_BUCKETS = (1024, 4096, 16384, 65536, 262144, 1048576)


def rotary_dim(cfg: dict[str, Any], layer_type: str) -> int:
    params = cfg["rope_parameters"][layer_type]
    return int(cfg["head_dim"] * float(params.get("partial_rotary_factor", 1.0)))


def inv_freq(cfg: dict[str, Any], layer_type: str) -> torch.Tensor:
    """theta^(-2i / rotary_dim) in float64: the denominator is the rotary dim, not head_dim."""
    rot = rotary_dim(cfg, layer_type)
    theta = float(cfg["rope_parameters"][layer_type]["rope_theta"])
    return theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(self.weight.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half on the first 2 * len(cos) dims of x [..., head_dim]; the rest pass through."""
    rot = 2 * cos.shape[-1]
    xr, xp = x[..., :rot].float(), x[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([out, xp], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
        )
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        hidden = cfg["hidden_size"]
        self.q_k_v_proj = nn.Linear(hidden, q_dim + 2 * kv_dim, bias=False)
        self.g_proj = nn.Linear(hidden, self.n_heads, bias=False)
        self.out_proj = nn.Linear(q_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [1, hidden], normed, weight dtype
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: torch.Tensor,  # [L] additive over the past slots
        k_past: torch.Tensor,  # [kv_heads, L, head_dim]
        v_past: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n_h, n_kv, hd = self.n_heads, self.n_kv, self.head_dim
        group = n_h // n_kv
        q, k, v = self.q_k_v_proj(x).split([n_h * hd, n_kv * hd, n_kv * hd], dim=-1)
        # Query heads grouped by the kv head they share: head h reads kv head h // group.
        q = apply_rope(q.view(n_kv, group, hd), cos, sin)
        k = apply_rope(k.view(n_kv, 1, hd), cos, sin)
        v = v.view(n_kv, 1, hd)
        # The past and this token are scored separately: concatenating them would copy the
        # whole cache every step.
        qf = q.float()
        scores = torch.cat(
            [qf @ k_past.float().transpose(-1, -2), (qf * k.float()).sum(-1, keepdim=True)], dim=-1
        ) / math.sqrt(hd)  # [kv, group, L + 1]
        probs = (scores + torch.cat([mask, mask.new_zeros(1)])).softmax(-1)
        out = (probs[..., :-1] @ v_past.float() + probs[..., -1:] * v.float()).to(x.dtype)  # [kv, group, hd]
        gate = torch.sigmoid(self.g_proj(x).float()).to(x.dtype)  # [1, heads]
        out = out * gate.view(n_kv, group, 1)
        return self.out_proj(out.reshape(1, n_h * hd)), k[:, 0], v[:, 0]


class MLP(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))  # exact-erf GELU


class Layer(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.embedding = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])


class SparkDecodeStep(nn.Module):
    """One decode step; parameter names are the checkpoint's (``model.layers.N.self_attn...``)."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_types: list[str] = list(cfg["layer_types"])
        # Each layer's index within the stacked cache of its type.
        self.slot: list[int] = []
        counts = {FULL: 0, SLIDING: 0}
        for t in self.layer_types:
            self.slot.append(counts[t])
            counts[t] += 1
        self.model = Backbone(cfg)
        # The head is the embedding matrix; a quantized export gives it a module of its own.
        self.lm_head: nn.Linear | None = None

    def untie_head(self) -> None:
        """Give the head its own ``nn.Linear`` (sharing the embedding's tensor), so that a weight
        quantization config applied to linears reaches it while the embedding stays float."""
        weight = self.model.embedding.weight
        with torch.device("meta"):
            self.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.lm_head.weight = weight

    @classmethod
    def from_checkpoint(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        cfg_override: dict[str, Any] | None = None,
    ) -> SparkDecodeStep:
        """The step with a checkpoint folder's weights (``config.json`` + ``model.safetensors``)."""
        from safetensors.torch import load_file

        model_dir = Path(model_dir)
        cfg = {**json.loads((model_dir / "config.json").read_text()), **(cfg_override or {})}
        with torch.device("meta"):
            step = cls(cfg)
        state = load_file(str(model_dir / "model.safetensors"))
        step.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
        return step.eval()

    def forward(
        self,
        tokens: torch.Tensor,
        cos_full: torch.Tensor,
        sin_full: torch.Tensor,
        cos_sliding: torch.Tensor,
        sin_sliding: torch.Tensor,
        mask_full: torch.Tensor,
        mask_sliding: torch.Tensor,
        k_full: torch.Tensor,
        v_full: torch.Tensor,
        k_sliding: torch.Tensor,
        v_sliding: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.model.embedding(tokens).float()  # [1, hidden]: the residual stream is fp32
        new: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {FULL: ([], []), SLIDING: ([], [])}
        for layer, layer_type, j in zip(self.model.layers, self.layer_types, self.slot, strict=True):
            if layer_type == FULL:
                rope, mask, past = (cos_full, sin_full), mask_full, (k_full[j], v_full[j])
            else:
                rope, mask, past = (cos_sliding, sin_sliding), mask_sliding, (k_sliding[j], v_sliding[j])
            attn, k, v = layer.self_attn(layer.input_layernorm(h), *rope, mask, *past)
            new[layer_type][0].append(k)
            new[layer_type][1].append(v)
            h = h + attn.float()
            h = h + layer.mlp(layer.post_attention_layernorm(h)).float()
        x = self.model.norm(h)
        head = self.lm_head(x) if self.lm_head is not None else F.linear(x, self.model.embedding.weight)
        logits = head.float()[0]
        # A layer type with no layers (an all-full variant) still gets its [0, ...] outputs.
        outs: list[torch.Tensor] = []
        for t, ref in ((FULL, k_full), (SLIDING, k_sliding)):
            empty = ref.new_zeros(0, ref.shape[1], ref.shape[3])
            outs += [torch.stack(e) if e else empty for e in new[t]]
        return logits, outs[0], outs[1], outs[2], outs[3]


def cache_shapes(cfg: dict[str, Any], context: int) -> dict[str, tuple[int, ...]]:
    """The explicit cache tensors' shapes for a context capacity (full layers) and the window."""
    n_full = sum(t == FULL for t in cfg["layer_types"])
    n_sliding = len(cfg["layer_types"]) - n_full
    kv, hd = cfg["num_key_value_heads"], cfg["head_dim"]
    return {
        "k_full": (n_full, kv, context, hd),
        "v_full": (n_full, kv, context, hd),
        "k_sliding": (n_sliding, kv, cfg["sliding_window"], hd),
        "v_sliding": (n_sliding, kv, cfg["sliding_window"], hd),
    }


def example_inputs(
    cfg: dict[str, Any], context: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, ...]:
    """Inputs of the step at position 0 (all past masked), in ``INPUT_NAMES`` order."""
    half_full, half_sliding = rotary_dim(cfg, FULL) // 2, rotary_dim(cfg, SLIDING) // 2
    caches = cache_shapes(cfg, context)
    kw = dict(device=device)
    return (
        torch.zeros(1, dtype=torch.long, **kw),
        torch.ones(half_full, **kw),
        torch.zeros(half_full, **kw),
        torch.ones(half_sliding, **kw),
        torch.zeros(half_sliding, **kw),
        torch.full((context,), float("-inf"), **kw),
        torch.full((cfg["sliding_window"],), float("-inf"), **kw),
        *(torch.zeros(caches[n], dtype=dtype, **kw) for n in ("k_full", "v_full", "k_sliding", "v_sliding")),
    )


def export_step(step: SparkDecodeStep, context: int) -> torch.export.ExportedProgram:
    """``torch.export`` of the step at a fixed context capacity (static shapes)."""
    device = step.model.embedding.weight.device
    dtype = step.model.embedding.weight.dtype
    with torch.no_grad():
        return torch.export.export(step, example_inputs(step.cfg, context, dtype, device), strict=False)


def next_bucket(n: int, buckets: Sequence[int] = CONTEXT_BUCKETS) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"spark decode: context {n} is over the largest bucket {buckets[-1]}")


StepFn = Callable[..., Sequence[torch.Tensor]]


class DecodeState:
    """The host side of one sequence: caches, angles, masks, and the program per capacity.

    ``program_for(C)`` returns a callable with the step's signature for full-cache capacity C
    (an eager ``SparkDecodeStep`` works for any C; an exported or AOTInductor program for one).
    When position ``C`` is reached, the full caches are padded to the next bucket and the program
    for that capacity is fetched (a re-export).
    """

    def __init__(
        self,
        cfg: dict[str, Any],
        program_for: Callable[[int], StepFn],
        context: int,
        dtype: torch.dtype = torch.float32,
        buckets: Sequence[int] = CONTEXT_BUCKETS,
    ) -> None:
        self.cfg, self.program_for, self.dtype, self.buckets = cfg, program_for, dtype, tuple(buckets)
        self.window: int = cfg["sliding_window"]
        self.context = context
        self.program = program_for(context)
        shapes = cache_shapes(cfg, context)
        self.caches = {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}
        # The absolute position held by each ring slot (-1: empty).
        self.ring_pos = torch.full((self.window,), -1, dtype=torch.long)
        self.inv_freq = {t: inv_freq(cfg, t) for t in (FULL, SLIDING)}
        self.pos = 0

    def _angles(self, layer_type: str) -> tuple[torch.Tensor, torch.Tensor]:
        # float64 angles, then fp32 cos/sin: as the reference does for its whole sequence.
        ang = torch.tensor(float(self.pos), dtype=torch.float64) * self.inv_freq[layer_type]
        return torch.cos(ang).float(), torch.sin(ang).float()

    def masks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive masks over the past slots at the current position."""
        neg = torch.tensor(float("-inf"))
        full_ok = torch.arange(self.context) < self.pos
        # A query at pos sees keys k > pos - W (W positions including itself): slot pos % W,
        # which still holds pos - W, is masked until this step overwrites it.
        ring_ok = (self.ring_pos >= 0) & (self.ring_pos > self.pos - self.window)
        return torch.where(full_ok, 0.0, neg), torch.where(ring_ok, 0.0, neg)

    def _grow(self) -> None:
        new = next_bucket(self.pos + 1, self.buckets)
        logger.info("spark decode: full-layer context %d -> %d (new program)", self.context, new)
        for name in ("k_full", "v_full"):
            old = self.caches[name]
            grown = old.new_zeros(*old.shape[:2], new, old.shape[3])
            grown[:, :, : self.context] = old
            self.caches[name] = grown
        self.context = new
        self.program = self.program_for(new)

    def inputs(self, token: int) -> tuple[torch.Tensor, ...]:
        """The step's inputs (``INPUT_NAMES`` order) for ``token`` at the current position."""
        c = self.caches
        return (
            torch.tensor([token], dtype=torch.long),
            *self._angles(FULL),
            *self._angles(SLIDING),
            *self.masks(),
            *(c[name] for name in ("k_full", "v_full", "k_sliding", "v_sliding")),
        )

    @torch.no_grad()
    def step(self, token: int) -> torch.Tensor:
        """Logits [vocab] of ``token`` at the current position; its K/V are written."""
        if self.pos >= self.context:
            self._grow()
        logits, nk_f, nv_f, nk_s, nv_s = self.program(*self.inputs(token))
        c = self.caches
        slot = self.pos % self.window
        c["k_full"][:, :, self.pos] = nk_f
        c["v_full"][:, :, self.pos] = nv_f
        c["k_sliding"][:, :, slot] = nk_s
        c["v_sliding"][:, :, slot] = nv_s
        self.ring_pos[slot] = self.pos
        self.pos += 1
        return logits

    def prefill(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [len(ids), vocab] of every prompt position, by stepping."""
        return torch.stack([self.step(int(t)) for t in ids])

    def generate(self, prompt: Sequence[int], steps: int) -> list[int]:
        """Greedy continuation of ``prompt``."""
        logits = self.prefill(prompt)[-1]
        out: list[int] = []
        for _ in range(steps):
            nxt = int(logits.argmax())
            out.append(nxt)
            logits = self.step(nxt)
        return out
