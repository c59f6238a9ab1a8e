"""A plain-PyTorch Spark-X2.5, written from the released model's semantics, and mlx-lm's.

``Reference(model_dir)`` reads the safetensors checkpoint and computes logits for whole
sequences (no cache: every position recomputed, so nothing is shared with vLLM's paged path):
an fp32 residual stream (the embedding cast to float), each norm ``w * x / rms`` in fp32 and cast
to the weight dtype before the projections, NeoX RoPE on the first ``rotary_dim`` dims with
``inv_freq = theta^(-2i/rotary_dim)``, a causal mask that on sliding layers keeps ``k > q - window``,
each head scaled by ``sigmoid(g_proj(x_norm))`` in fp32 before the heads are merged, an exact-erf
GELU MLP, the final norm cast to the weight dtype before the tied head.

``variant`` switches in one deliberate error, to show that the parity bound is discriminating:
``window+1`` (a query sees one extra position), ``rope-head-dim`` (frequency denominator head_dim
instead of the rotary dim), ``tanh-gelu``, ``gate-after-merge`` (the per-head gate applied to the
merged [tokens, heads*head_dim] tensor with the head index varying fastest, the layout mistake).

``mlx_logits`` runs mlx-lm's in-tree ``spark2_5`` model (an independent implementation) in the
interpreter that has it (``.venv``, or ``OMNI_SPARK_MLX_PYTHON``), in a subprocess.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

VARIANTS = ("exact", "window+1", "rope-head-dim", "tanh-gelu", "gate-after-merge")


class Reference:
    def __init__(
        self, model_dir: str | Path, dtype: torch.dtype = torch.float32, variant: str = "exact"
    ) -> None:
        from safetensors.torch import load_file

        if variant not in VARIANTS:
            raise ValueError(f"spark reference: unknown variant {variant!r}; accepted: {list(VARIANTS)}")
        self.dir = Path(model_dir)
        self.cfg: dict[str, Any] = json.loads((self.dir / "config.json").read_text())
        self.variant = variant
        self.dtype = dtype
        self.w = {k: v.to(dtype) for k, v in load_file(str(self.dir / "model.safetensors")).items()}

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg["rms_norm_eps"])
        return (weight.float() * x).to(self.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor, layer_type: str) -> torch.Tensor:
        # x: [heads, T, head_dim]
        params = self.cfg["rope_parameters"][layer_type]
        head_dim = self.cfg["head_dim"]
        rot = int(head_dim * float(params.get("partial_rotary_factor", 1.0)))
        denom = head_dim if self.variant == "rope-head-dim" else rot
        inv_freq = float(params["rope_theta"]) ** (-torch.arange(0, rot, 2, dtype=torch.float64) / denom)
        ang = positions.to(torch.float64)[:, None] * inv_freq[None, :]
        cos, sin = torch.cos(ang).float(), torch.sin(ang).float()
        xr, xp = x[..., :rot].float(), x[..., rot:]
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([out, xp], dim=-1)

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg, f"model.layers.{i}.self_attn."
        n_h, n_kv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        layer_type = c["layer_types"][i]
        t = x.shape[0]
        qkv = x @ self.w[p + "q_k_v_proj.weight"].T
        q, k, v = qkv.split([n_h * hd, n_kv * hd, n_kv * hd], dim=-1)
        q = self._rope(q.view(t, n_h, hd).transpose(0, 1), positions, layer_type)
        k = self._rope(k.view(t, n_kv, hd).transpose(0, 1), positions, layer_type)
        v = v.view(t, n_kv, hd).transpose(0, 1)
        k = k.repeat_interleave(n_h // n_kv, dim=0)
        v = v.repeat_interleave(n_h // n_kv, dim=0)
        scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(hd)
        qpos, kpos = positions[:, None], positions[None, :]
        allowed = kpos <= qpos
        if layer_type == "sliding_attention":
            window = c["sliding_window"] + (1 if self.variant == "window+1" else 0)
            allowed &= kpos > qpos - window
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = (scores.softmax(-1) @ v.float()).to(self.dtype)  # [heads, T, hd]
        gate = torch.sigmoid((x @ self.w[p + "g_proj.weight"].T).float()).to(self.dtype)  # [T, heads]
        if self.variant == "gate-after-merge":
            merged = out.transpose(0, 1).reshape(t, n_h * hd)
            merged = merged * gate.repeat(1, hd)
        else:
            out = out * gate.T[:, :, None]
            merged = out.transpose(0, 1).reshape(t, n_h * hd)
        return merged @ self.w[p + "out_proj.weight"].T

    def _mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp."
        approximate = "tanh" if self.variant == "tanh-gelu" else "none"
        g = F.gelu(x @ self.w[p + "gate_proj.weight"].T, approximate=approximate)
        return (g * (x @ self.w[p + "up_proj.weight"].T)) @ self.w[p + "down_proj.weight"].T

    @torch.no_grad()
    def logits(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        """[T, vocab] float32 logits of every position of one sequence."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        positions = torch.arange(ids.shape[0])
        h = self.w["model.embedding.weight"][ids].float()
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            h = h + self._attention(i, self._norm(h, self.w[p + "input_layernorm.weight"]), positions).float()
            h = h + self._mlp(i, self._norm(h, self.w[p + "post_attention_layernorm.weight"])).float()
        x = self._norm(h, self.w["model.norm.weight"])
        return (x @ self.w["model.embedding.weight"].T).float()

    def greedy(self, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy continuation and each step's log-probabilities (recomputed from scratch)."""
        ids, out, logprobs = list(prompt), [], []
        for _ in range(steps):
            lp = self.logits(ids)[-1].double().log_softmax(-1)
            nxt = int(lp.argmax())
            out.append(nxt)
            logprobs.append(lp)
            ids.append(nxt)
        return out, logprobs


def snr_db(ref: torch.Tensor, test: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |ref - test|^2), in float64."""
    ref, test = ref.double(), test.double()
    noise = (ref - test).pow(2).sum().item()
    return float("inf") if noise == 0 else 10 * math.log10(ref.pow(2).sum().item() / noise)


def vllm_model_probe(model: Any) -> dict[str, Any]:
    """What a test reads off vLLM's Spark model inside a worker (``LLM.apply_model``; a module
    function, so that tensor-parallel workers can unpickle it): the rows of each layer's RoPE
    cos/sin cache, the first columns of this rank's head-gate rows of layer 0, and the linear
    method of each of layer 0's linears (with whether it took the few-row kernel)."""
    from vllm.model_executor.layers.linear import LinearBase

    layer0 = model.model.layers[0]
    return {
        "rope_rows": [layer.self_attn.rotary_emb.cos_sin_cache.shape[0] for layer in model.model.layers],
        "gate_rows": layer0.self_attn.g_proj.weight[:, :4].tolist(),
        "linear_methods": {
            name: [type(m.quant_method).__name__, bool(getattr(m, "cpu_gemv", False))]
            for name, m in layer0.named_modules()
            if isinstance(m, LinearBase)
        },
    }


def fidelity(ref: torch.Tensor, test: torch.Tensor) -> dict[str, float]:
    """How far ``test`` logits [positions, vocab] are from ``ref``: top-1 agreement over the
    positions, KL(ref || test) per position (mean and max, in nats), and the SNR in dB."""
    from omni_cpu_fastpath.qwen3_tts.parity import parity_metrics

    m = parity_metrics(ref[None], test[None])  # one batch row, a "sub-step" per position
    return {
        "top1_agreement": float(m["top1"].mean()),
        "kl_mean": float(m["kl"].mean()),
        "kl_max": float(m["kl"].max()),
        "snr_db": snr_db(ref, test),
    }


# ----------------------------------------------------------------------------------------------
# mlx-lm
# ----------------------------------------------------------------------------------------------

_MLX_SCRIPT = r"""
import sys
from pathlib import Path
import numpy as np
import mlx.core as mx
from mlx_lm.utils import load_model
model_dir, ids_path, out_path = sys.argv[1:4]
model, _ = load_model(Path(model_dir))
model.set_dtype(mx.float32)
ids = np.load(ids_path)
logits = model(mx.array(ids)[None])[0].astype(mx.float32)
np.save(out_path, np.array(logits))
"""


def mlx_python() -> str | None:
    """An interpreter that imports mlx_lm with a working backend, or None."""
    root = Path(__file__).resolve().parents[2]
    candidates = [
        os.environ.get("OMNI_SPARK_MLX_PYTHON", ""),
        sys.executable,
        str(root / ".venv-mlx/bin/python"),
    ]
    for py in candidates:
        if not py or not Path(py).exists():
            continue
        probe = subprocess.run(
            [py, "-c", "import mlx.core as mx, mlx_lm.models.spark2_5; mx.eval(mx.ones(2) + 1)"],
            capture_output=True,
        )
        if probe.returncode == 0:
            return py
    return None


def mlx_logits(model_dir: str | Path, ids: list[int], python: str | None = None) -> torch.Tensor:
    """[T, vocab] float32 logits of mlx-lm's ``spark2_5`` model, run in float32."""
    import numpy as np

    py = python or mlx_python()
    if py is None:
        raise RuntimeError("mlx-lm with a CPU backend is not installed: run make setup")
    with tempfile.TemporaryDirectory() as tmp:
        ids_path, out_path = Path(tmp) / "ids.npy", Path(tmp) / "logits.npy"
        np.save(ids_path, np.asarray(ids, dtype=np.int32))
        subprocess.run([py, "-c", _MLX_SCRIPT, str(model_dir), str(ids_path), str(out_path)], check=True)
        return torch.from_numpy(np.load(out_path))
