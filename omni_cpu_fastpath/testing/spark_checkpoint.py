"""Random Spark-X2.5 checkpoints in the released on-disk layout (no download needed).

``make_model(out_dir, dims, seed)`` writes ``config.json`` (with the released ``auto_map`` and
``transformers_version``), ``model.safetensors`` with the official tensor names
(``model.embedding.weight``, ``model.layers.N.self_attn.{q_k_v_proj,g_proj,out_proj}.weight``,
``model.layers.N.mlp.{gate,up,down}_proj.weight``, the norms; no ``lm_head``: the head is tied),
``generation_config.json`` and an offline byte-level BPE tokenizer whose special tokens hold the
released ids (bos 0, eos 1, pad 2) and whose chat template writes the released role and tool-call
tags.

Dims: ``tiny`` (64 wide, 4 heads of 32 so q dim 128 != hidden like the 4B, 4 layers: three sliding
with a window of 8 and one full; a 512-entry vocabulary), ``1.7b`` and ``4b`` (released
dimensions). Values: embeddings normal(0, 1) so the tied logits are O(1) and top-k orders are
well separated; matrices normal(0, 1/sqrt(fan_in)), out_proj and down_proj 5x that (so greedy
tokens depend on the context rather than repeat the last one); norm weights 1 + normal(0, 0.1). Each tensor
has its own generator seeded by (seed, name). ``dtype`` is float32 for tiny, bfloat16 otherwise.
"""

from __future__ import annotations

import argparse
import json
import zlib
from pathlib import Path
from typing import Any

DIMS = ("tiny", "1.7b", "4b")

_RELEASED_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


def _pattern(n: int) -> list[str]:
    return ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(n)]


_DIMS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=8,
                 max_position_embeddings=8192),
    "1.7b": dict(vocab_size=131072, hidden_size=2048, intermediate_size=6656, num_hidden_layers=28,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, sliding_window=512,
                 max_position_embeddings=1048576),
    "4b": dict(vocab_size=131072, hidden_size=2560, intermediate_size=10240, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256, sliding_window=512,
               max_position_embeddings=1048576),
}  # fmt: skip

BOS, EOS, PAD = 0, 1, 2
SPECIAL_TOKENS = {
    "<|begin_of_text|>": BOS,
    "<|end_of_text|>": EOS,
    "<|pad|>": PAD,
    "<|System|>": 3,
    "<|User|>": 4,
    "<|Bot|>": 5,
    "<tool_call>": 6,
    "</tool_call>": 7,
    "<arg_key>": 8,
    "</arg_key>": 9,
    "<arg_value>": 10,
    "</arg_value>": 11,
    "<think>": 12,
    "</think>": 13,
    "<tool_response>": 14,
    "</tool_response>": 15,
}
_FIRST_BYTE_ID = 16

# Roles, tools and tool calls as the released template writes them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}<|System|>You may call these tools:\n"
    "{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{%- endfor %}\n"
    "Call one as <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call>.\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}<|System|>{{ m.content }}\n"
    "{%- elif m.role == 'user' %}<|User|>{{ m.content }}\n"
    "{%- elif m.role == 'tool' %}<|User|><tool_response>{{ m.content }}</tool_response>\n"
    "{%- elif m.role == 'assistant' %}<|Bot|>{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}<tool_call>{{ tc.function.name }}"
    "{%- if tc.function.arguments is mapping %}{%- for k, v in tc.function.arguments.items() %}"
    "<arg_key>{{ k }}</arg_key><arg_value>{{ v if v is string else v | tojson }}</arg_value>"
    "{%- endfor %}{%- endif %}</tool_call>{%- endfor %}{{ eos_token }}\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|Bot|>{%- endif %}"
)


class SparkCheckpointError(ValueError):
    """make_model was asked for something it cannot write."""


def config_dict(dims: str = "tiny", layers: int | None = None) -> dict[str, Any]:
    """config.json as released (``auto_map`` to the vendor's remote code included); ``layers``
    keeps the widths but takes that many layers of the released pattern (for real-width tests)."""
    if dims not in _DIMS:
        raise SparkCheckpointError(f"spark make-model: unknown dims {dims!r}; accepted: {list(DIMS)}")
    d = dict(_DIMS[dims])
    if layers is not None:
        if layers < 4:
            raise SparkCheckpointError(f"spark make-model: layers {layers} < 4 has no full-attention layer")
        d["num_hidden_layers"] = layers
    return {
        "architectures": ["Spark2_5ForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_spark.Spark2_5Config",
            "AutoModelForCausalLM": "modeling_spark.Spark2_5ForCausalLM",
        },
        "model_type": "spark2_5",
        **d,
        "head_dim": d["head_dim"],
        "hidden_act": "gelu",
        "layer_types": _pattern(d["num_hidden_layers"]),
        "rope_parameters": json.loads(json.dumps(_RELEASED_ROPE)),
        "headwise_attn_output_gate": True,
        "gate_attn_act_mode": "sigmoid",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        "torch_dtype": "float32" if dims == "tiny" else "bfloat16",
        "transformers_version": "4.57.1",
    }


def tensor_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor of the released checkpoint, [out, in] for matrices."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embedding.weight": (cfg["vocab_size"], h),
        "model.norm.weight": (h,),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_k_v_proj.weight"] = (q + 2 * kv, h)
        shapes[p + "self_attn.g_proj.weight"] = (cfg["num_attention_heads"], h)
        shapes[p + "self_attn.out_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    return shapes


def _tensor(name: str, shape: tuple[int, ...], seed: int) -> Any:
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith("norm.weight"):
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if name == "model.embedding.weight":
        return torch.randn(shape, generator=g)
    # The layers' outputs are scaled up so that they, not the token's own (tied) embedding,
    # decide the next token: greedy decoding then depends on the context.
    gain = 5.0 if name.endswith(("out_proj.weight", "down_proj.weight")) else 1.0
    return gain * torch.randn(shape, generator=g) / shape[1] ** 0.5


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable stand-ins for the 256 bytes, as the ByteLevel pre-tokenizer expects.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def tokenizer_json(vocab_size: int) -> dict[str, Any]:
    """Byte-level BPE without merges: special tokens first, then 256 bytes, then unused ids."""
    vocab = dict(SPECIAL_TOKENS)
    for i, ch in enumerate(_bytes_to_unicode().values()):
        vocab[ch] = _FIRST_BYTE_ID + i
    # Every model id decodes to something, so a random model's output is printable.
    for i in range(_FIRST_BYTE_ID + 256, vocab_size):
        vocab[f"<unused_{i}>"] = i
    added = [
        {"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for c, i in SPECIAL_TOKENS.items()
    ]  # fmt: skip
    byte_level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **byte_level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **byte_level},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": False, "vocab": vocab, "merges": [],
        },
    }  # fmt: skip


def tokenizer_config() -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1048576,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "pad_token": "<|pad|>",
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def make_model(out_dir: str | Path, dims: str = "tiny", seed: int = 0, layers: int | None = None) -> Path:
    """Write a random Spark-X2.5 checkpoint to ``out_dir`` and return its path."""
    import torch
    from safetensors.torch import save_file

    cfg = config_dict(dims, layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, cfg["torch_dtype"])
    tensors = {name: _tensor(name, shape, seed).to(dtype) for name, shape in tensor_shapes(cfg).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    (out / "tokenizer.json").write_text(json.dumps(tokenizer_json(cfg["vocab_size"])) + "\n")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")
    (out / "omni_cpu_fastpath.json").write_text(
        json.dumps({"arch": "spark2_5", "dims": dims, "seed": seed, "layers": cfg["num_hidden_layers"]})
        + "\n"
    )
    return out


def cli_make_model(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    if args.dims not in DIMS:
        raise SystemExit(f"omni-cpu-fastpath make-model --arch spark2_5: --dims must be one of {list(DIMS)}")
    path = make_model(out, dims=args.dims, seed=args.seed)
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(
        json.dumps(
            {"dir": str(path), "arch": "spark2_5", "dims": args.dims, "seed": args.seed, "bytes": size}
        )
    )
    return 0
