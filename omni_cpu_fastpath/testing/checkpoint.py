"""Random Qwen3-TTS checkpoints in the released on-disk layout (no download needed).

``make_model(out_dir, dims, kind, seed, outliers)`` writes::

    out_dir/config.json                 model_type qwen3_tts, talker_config + code_predictor_config
    out_dir/model.safetensors           talker.* (and speaker_encoder.* for kind="base")
    out_dir/generation_config.json      the released sampling defaults
    out_dir/tokenizer.json + tokenizer_config.json
                                        a byte-level BPE text tokenizer (256 byte tokens, no merges)
                                        whose special tokens keep the released Qwen ids
                                        (<|im_start|> 151644 ...), so prompts tokenize as upstream
    out_dir/speech_tokenizer/{config.json, preprocessor_config.json, model.safetensors}
                                        a small 12 Hz codec (Mimi encoder + Qwen3-TTS decoder) that
                                        keeps the real 1920-sample frame and 16 quantizers

The JSON files are package data laid out as the checkpoint (``templates/qwen3_tts/``): a string
value ``"$name"`` there is a placeholder that :func:`_fill` replaces with a value computed here
(dimensions, kind, vocabulary sizes, the tokenizer's byte vocabulary).

Weight names are the official ones (what vllm-omni's ``Qwen3TTSTalkerForConditionalGeneration
.load_weights`` maps and qwen-tts's ``Qwen3TTSForConditionalGeneration`` declares):
``talker.model.{codec_embedding,text_embedding,layers.N.*,norm}``, ``talker.text_projection
.linear_fc{1,2}``, ``talker.codec_head``, ``talker.code_predictor.model.{codec_embedding.K,layers.N.*,
norm}``, ``talker.code_predictor.lm_head.K`` and, when the talker is wider than the predictor,
``talker.code_predictor.small_to_mtp_projection``. Each tensor is drawn from its own generator seeded
by (seed, name), so a tensor does not depend on which other tensors are written: the predictor of a
``parts="predictor"`` checkpoint equals the predictor of the full one.

Dims: ``tiny`` (talker 64 wide / 2 layers, predictor 64 wide / 2 layers, real vocabularies and
ids), ``tiny-proj`` (talker 96 wide, so the 1.7B-style projection exists), ``0.6b`` and ``1.7b``
(released dimensions). ``omni_cpu_fastpath.json`` records the arguments and the outlier channels.
The codec and speaker-encoder weights are built by vllm-omni's modules, so ``parts="all"`` imports
vllm-omni; ``parts="predictor"`` (no codec) does not.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import zlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

DIMS = ("tiny", "tiny-proj", "0.6b", "1.7b")
KINDS = ("custom-voice", "base", "voice-design")
PARTS = ("all", "predictor")
_KIND_TO_TTS_TYPE = {"custom-voice": "custom_voice", "base": "base", "voice-design": "voice_design"}

# Outlier recipe (outliers=True): how many hidden channels, and the scales applied.
OUTLIER_CHANNELS = 4
OUTLIER_NORM_SCALE = 30.0  # RMSNorm weight entries of those channels, every predictor layer
OUTLIER_EMBED_SCALE = 10.0  # the same columns of the codec embeddings feeding the predictor
PEAKED_HEAD_LOGIT_STD = 4.0  # target std of the codebook heads' logits, so top-1 is no longer uniform


@dataclass(frozen=True)
class Dims:
    talker_hidden: int
    talker_layers: int
    talker_heads: int
    talker_kv_heads: int
    talker_head_dim: int
    talker_mlp: int
    text_hidden: int
    mrope_section: tuple[int, int, int]
    cp_hidden: int
    cp_layers: int
    cp_heads: int
    cp_kv_heads: int
    cp_head_dim: int
    cp_mlp: int
    size_tag: str  # tts_model_size
    dtype: str  # storage dtype of the safetensors
    tiny_codec: bool
    speaker_channels: tuple[int, ...]


# fmt: off
# talker: hidden layers heads kv head_dim mlp text_hidden mrope; predictor: hidden layers heads kv hd mlp
# The talker's head_dim stays >= 32: vLLM's CPU attention backend supports only 32, 64, 80, ... 512.
_DIMS: dict[str, Dims] = {
    "tiny": Dims(64, 2, 4, 2, 32, 128, 32, (8, 4, 4), 64, 2, 4, 2, 16, 128,
                 "0b6", "float32", True, (32, 32, 32, 32, 96)),
    "tiny-proj": Dims(96, 2, 4, 2, 32, 192, 32, (8, 4, 4), 64, 2, 4, 2, 16, 128,
                      "1b7", "float32", True, (32, 32, 32, 32, 96)),
    "0.6b": Dims(1024, 28, 16, 8, 128, 3072, 2048, (24, 20, 20), 1024, 5, 16, 8, 128, 3072,
                 "0b6", "bfloat16", False, (512, 512, 512, 512, 1536)),
    "1.7b": Dims(2048, 28, 16, 8, 128, 6144, 2048, (24, 20, 20), 1024, 5, 16, 8, 128, 3072,
                 "1b7", "bfloat16", False, (512, 512, 512, 512, 1536)),
}
# The tiny codec keeps everything that fixes the token stream (24 kHz, 1920 samples per frame,
# 16 quantizers of 2048 entries, one semantic quantizer) and shrinks only widths and depths; the
# template holds the released codec.
_TINY_CODEC: dict[str, dict[str, int]] = {
    "encoder_config": {"num_quantizers": 16, "hidden_size": 32, "num_filters": 8, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
                       "intermediate_size": 64, "codebook_dim": 16,
                       "vector_quantization_hidden_dimension": 16, "upsample_groups": 32},
    "decoder_config": {"latent_dim": 32, "codebook_dim": 16, "decoder_dim": 32, "hidden_size": 32,
                       "intermediate_size": 64, "head_dim": 16, "num_attention_heads": 2,
                       "num_key_value_heads": 2, "num_hidden_layers": 1,
                       "vector_quantization_hidden_dimension": 16},
}
# fmt: on
# Released sizes shared by the configs and the weight shapes.
NUM_CODE_GROUPS = 16
CODEBOOK_VOCAB = 2048
TALKER_VOCAB = 3072
TEXT_VOCAB = 151936
LAYER0_EMBEDDING = "talker.model.codec_embedding.weight"


class CheckpointError(ValueError):
    """Bad arguments to :func:`make_model`."""


def _checked(what: str, value: str, accepted: tuple[str, ...]) -> str:
    if value not in accepted:
        raise CheckpointError(f"{what}={value!r} is not valid; accepted values: {', '.join(accepted)}")
    return value


def dims_of(dims: str) -> Dims:
    return _DIMS[_checked("dims", dims, DIMS)]


# --------------------------------------------------------------------------------------------
# JSON files, from the templates
# --------------------------------------------------------------------------------------------


def _template(rel: str) -> Any:
    """``templates/qwen3_tts/<rel>`` as loaded JSON, placeholders still in."""
    path = resources.files(__package__).joinpath("templates", "qwen3_tts", *rel.split("/"))
    return json.loads(path.read_text(encoding="utf-8"))


def _fill(node: Any, values: dict[str, Any]) -> Any:
    """``node`` with every ``"$name"`` string replaced by (a copy of) ``values[name]``."""
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    if isinstance(node, str) and node.startswith("$"):
        if node[1:] not in values:
            raise KeyError(f"template placeholder {node!r} has no value")
        return copy.deepcopy(values[node[1:]])
    return node


_SIZES = {
    "num_code_groups": NUM_CODE_GROUPS,
    "codebook_vocab": CODEBOOK_VOCAB,
    "talker_vocab": TALKER_VOCAB,
    "text_vocab": TEXT_VOCAB,
}
# The released CustomVoice speaker table (name -> codec id), as the template holds it.
SPEAKERS: dict[str, int] = _template("config.json")["talker_config"]["spk_id"]


def build_config(dims: str = "tiny", kind: str = "custom-voice") -> dict[str, Any]:
    """The top-level ``config.json`` of a checkpoint, keys as in the released files."""
    d = dims_of(dims)
    _checked("kind", kind, KINDS)
    fields = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(d).items()}
    config = _fill(
        _template("config.json"),
        {
            **fields,
            **_SIZES,
            "tts_model_type": _KIND_TO_TTS_TYPE[kind],
            "cp_layer_types": ["full_attention"] * d.cp_layers,
            "speaker_attention_channels": 16 if d.tiny_codec else 128,
            "speaker_se_channels": 16 if d.tiny_codec else 128,
        },
    )
    if kind != "custom-voice":
        # Only CustomVoice checkpoints name speakers; Base and VoiceDesign ship empty tables.
        config["talker_config"]["spk_id"] = {}
        config["talker_config"]["spk_is_dialect"] = {}
    return config


def speech_tokenizer_config(dims: str = "tiny") -> dict[str, Any]:
    """``speech_tokenizer/config.json``: released values for real dims, a narrow codec for tiny."""
    d = dims_of(dims)
    config = _fill(_template("speech_tokenizer/config.json"), _SIZES)
    if d.tiny_codec:
        for section, widths in _TINY_CODEC.items():
            config[section].update(widths)  # every key is in the template, so key order is kept
    return config


# --------------------------------------------------------------------------------------------
# Weight names and shapes
# --------------------------------------------------------------------------------------------


def _decoder_layer_shapes(
    prefix: str, hidden: int, heads: int, kv_heads: int, head_dim: int, mlp: int
) -> dict[str, tuple[int, ...]]:
    return {
        f"{prefix}.self_attn.q_proj.weight": (heads * head_dim, hidden),
        f"{prefix}.self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
        f"{prefix}.self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
        f"{prefix}.self_attn.o_proj.weight": (hidden, heads * head_dim),
        f"{prefix}.self_attn.q_norm.weight": (head_dim,),
        f"{prefix}.self_attn.k_norm.weight": (head_dim,),
        f"{prefix}.mlp.gate_proj.weight": (mlp, hidden),
        f"{prefix}.mlp.up_proj.weight": (mlp, hidden),
        f"{prefix}.mlp.down_proj.weight": (hidden, mlp),
        f"{prefix}.input_layernorm.weight": (hidden,),
        f"{prefix}.post_attention_layernorm.weight": (hidden,),
    }


def predictor_weight_shapes(dims: str = "tiny") -> dict[str, tuple[int, ...]]:
    """Official names (``talker.code_predictor.*``) and shapes of the code predictor."""
    d = dims_of(dims)
    p = "talker.code_predictor"
    shapes: dict[str, tuple[int, ...]] = {}
    for k in range(NUM_CODE_GROUPS - 1):
        # Residual-codebook embeddings live in the talker's width (projected afterwards).
        shapes[f"{p}.model.codec_embedding.{k}.weight"] = (CODEBOOK_VOCAB, d.talker_hidden)
    for i in range(d.cp_layers):
        shapes.update(
            _decoder_layer_shapes(
                f"{p}.model.layers.{i}", d.cp_hidden, d.cp_heads, d.cp_kv_heads, d.cp_head_dim, d.cp_mlp
            )
        )
    shapes[f"{p}.model.norm.weight"] = (d.cp_hidden,)
    for k in range(NUM_CODE_GROUPS - 1):
        shapes[f"{p}.lm_head.{k}.weight"] = (CODEBOOK_VOCAB, d.cp_hidden)
    if d.talker_hidden != d.cp_hidden:
        shapes[f"{p}.small_to_mtp_projection.weight"] = (d.cp_hidden, d.talker_hidden)
        shapes[f"{p}.small_to_mtp_projection.bias"] = (d.cp_hidden,)
    return shapes


def talker_weight_shapes(dims: str = "tiny") -> dict[str, tuple[int, ...]]:
    """Official names and shapes of everything in ``model.safetensors`` except the speaker encoder."""
    d = dims_of(dims)
    shapes: dict[str, tuple[int, ...]] = {
        "talker.model.codec_embedding.weight": (TALKER_VOCAB, d.talker_hidden),
        "talker.model.text_embedding.weight": (TEXT_VOCAB, d.text_hidden),
    }
    for i in range(d.talker_layers):
        shapes.update(
            _decoder_layer_shapes(
                f"talker.model.layers.{i}",
                d.talker_hidden,
                d.talker_heads,
                d.talker_kv_heads,
                d.talker_head_dim,
                d.talker_mlp,
            )
        )
    shapes["talker.model.norm.weight"] = (d.talker_hidden,)
    shapes["talker.text_projection.linear_fc1.weight"] = (d.text_hidden, d.text_hidden)
    shapes["talker.text_projection.linear_fc1.bias"] = (d.text_hidden,)
    shapes["talker.text_projection.linear_fc2.weight"] = (d.talker_hidden, d.text_hidden)
    shapes["talker.text_projection.linear_fc2.bias"] = (d.talker_hidden,)
    shapes["talker.codec_head.weight"] = (TALKER_VOCAB, d.talker_hidden)
    shapes.update(predictor_weight_shapes(dims))
    return shapes


# --------------------------------------------------------------------------------------------
# Random values
# --------------------------------------------------------------------------------------------


def _generator(seed: int, name: str):
    import torch

    g = torch.Generator()
    g.manual_seed((int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return g


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _random_tensor(name: str, shape: tuple[int, ...], seed: int):
    import torch

    g = _generator(seed, name)
    x = torch.randn(shape, generator=g, dtype=torch.float32)
    if _is_norm(name):
        # RMSNorm weights near 1, not exactly 1, so a swapped or missing norm is visible in tests.
        return 1.0 + 0.05 * x
    return 0.02 * x


def outlier_channels(dims: str, seed: int) -> list[int]:
    """The predictor hidden channels that ``outliers=True`` inflates (deterministic by seed)."""
    import torch

    d = dims_of(dims)
    g = _generator(seed, "outlier-channels")
    return sorted(torch.randperm(d.cp_hidden, generator=g)[:OUTLIER_CHANNELS].tolist())


def talker_outlier_channels(dims: str, seed: int) -> list[int]:
    """The talker hidden channels that ``outliers=True`` inflates: the predictor's where both are
    as wide (the layer-0 table that feeds both carries them), else drawn by seed."""
    import torch

    d = dims_of(dims)
    if d.talker_hidden == d.cp_hidden:
        return outlier_channels(dims, seed)
    g = _generator(seed, "talker-outlier-channels")
    return sorted(torch.randperm(d.talker_hidden, generator=g)[:OUTLIER_CHANNELS].tolist())


def _apply_talker_outliers(tensors: dict[str, Any], dims: str, seed: int) -> None:
    d = dims_of(dims)
    ch = talker_outlier_channels(dims, seed)
    for name, t in tensors.items():
        if name.startswith("talker.model.layers.") and name.endswith(
            ("input_layernorm.weight", "post_attention_layernorm.weight")
        ):
            t[ch] *= OUTLIER_NORM_SCALE
        elif name == "talker.codec_head.weight":
            t *= PEAKED_HEAD_LOGIT_STD / (0.02 * d.talker_hidden**0.5)


def _apply_outliers(tensors: dict[str, Any], dims: str, seed: int) -> None:
    """Give the predictor and the talker trained-transformer-like statistics (see :func:`make_model`)."""
    d = dims_of(dims)
    ch = outlier_channels(dims, seed)
    _apply_talker_outliers(tensors, dims, seed)
    p = "talker.code_predictor"
    for name, t in tensors.items():
        if not name.startswith(p):
            continue
        if name.startswith(f"{p}.model.layers.") and name.endswith(
            ("input_layernorm.weight", "post_attention_layernorm.weight")
        ):
            t[ch] *= OUTLIER_NORM_SCALE
        elif ".model.codec_embedding." in name and d.talker_hidden == d.cp_hidden:
            t[:, ch] *= OUTLIER_EMBED_SCALE
        elif name == f"{p}.small_to_mtp_projection.weight":
            t[ch, :] *= OUTLIER_EMBED_SCALE
        elif ".lm_head." in name:
            # final-norm output has about unit RMS per channel, so logit std is about row_std * sqrt(H).
            t *= PEAKED_HEAD_LOGIT_STD / (0.02 * d.cp_hidden**0.5)
    if d.talker_hidden == d.cp_hidden and LAYER0_EMBEDDING in tensors:
        # Layer-0 embeddings enter the predictor too (position 1).
        tensors[LAYER0_EMBEDDING][:, ch] *= OUTLIER_EMBED_SCALE


def _speaker_encoder_tensors(config: dict[str, Any], seed: int) -> dict[str, Any]:
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSSpeakerEncoderConfig
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSSpeakerEncoder

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        enc = Qwen3TTSSpeakerEncoder(Qwen3TTSSpeakerEncoderConfig(**config["speaker_encoder_config"]))
    return {f"speaker_encoder.{k}": v.detach().clone().contiguous() for k, v in enc.state_dict().items()}


def _speech_tokenizer_tensors(st_config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Codec weights named as the released ``speech_tokenizer/model.safetensors`` (encoder.*, decoder.*)."""
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
        configuration_qwen3_tts_tokenizer_v2 as st_conf,
    )
    from vllm_omni.model_executor.models.qwen3_tts.tokenizer_12hz import (
        modeling_qwen3_tts_tokenizer_v2 as st_model,
    )

    cfg = st_conf.Qwen3TTSTokenizerV2Config(
        **{k: v for k, v in st_config.items() if k not in ("architectures", "model_type")}
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = st_model.Qwen3TTSTokenizerV2Model(cfg)
    out: dict[str, Any] = {}
    for name, t in model.state_dict().items():
        if not t.is_floating_point():
            continue  # conv stride/kernel bookkeeping buffers are rebuilt from the config
        t = t.detach().clone().float().contiguous()
        if name.endswith(("embed_sum", "embedding_sum")):
            # Module init leaves codebooks at zero; distinct codewords make codes audible/encodable.
            t = torch.randn(t.shape, generator=_generator(seed, name))
        elif name.endswith(("cluster_usage", "initialized")):
            t = torch.ones_like(t)
        out[name] = t
    return out


# --------------------------------------------------------------------------------------------
# Text tokenizer
# --------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte <-> printable-char table, so token id == byte value for the 256 base tokens.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def tokenizer_json() -> dict[str, Any]:
    """A byte-level BPE tokenizer: ids 0-255 are bytes, special tokens keep their Qwen ids."""
    template = _template("tokenizer.json")
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    vocab.update({t["content"]: t["id"] for t in template["added_tokens"]})
    return _fill(template, {"vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1]))})


# --------------------------------------------------------------------------------------------
# Writer
# --------------------------------------------------------------------------------------------


# Templates without placeholders: written as they are.
_VERBATIM = ("generation_config.json", "tokenizer_config.json", "speech_tokenizer/preprocessor_config.json")


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def _save_safetensors(tensors: dict[str, Any], path: Path, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    td = getattr(torch, dtype)
    ordered = {k: tensors[k].to(td).contiguous() for k in sorted(tensors)}
    save_file(ordered, str(path), metadata={"format": "pt"})


def make_model(
    out_dir: str | Path,
    dims: str = "tiny",
    kind: str = "custom-voice",
    seed: int = 0,
    outliers: bool = False,
    parts: str = "all",
) -> Path:
    """Write a random Qwen3-TTS checkpoint to ``out_dir`` and return its path.

    ``dims``: ``tiny`` | ``tiny-proj`` | ``0.6b`` | ``1.7b``. ``kind``: ``custom-voice`` (speaker
    table with the released names, e.g. ``vivian``), ``base`` (empty speaker table plus
    ``speaker_encoder.*`` weights, for voice cloning) or ``voice-design`` (empty speaker table, no
    speaker encoder); the ``tts_model_type`` field carries the kind, as in the released files.
    ``parts="predictor"`` writes only ``talker.code_predictor.*`` and the layer-0 table
    ``talker.model.codec_embedding.weight`` (with the full config, no codec weights): enough for
    predictor tests and benchmarks at real dimensions, not for the engine.

    Values: normal(0, 0.02) for matrices, embeddings and biases, 1 + normal(0, 0.05) for RMSNorm
    weights; each tensor from a generator seeded by (seed, name). Same arguments give
    byte-identical safetensors files.

    ``outliers=True`` makes the code predictor look trained where int8 quantization cares:
    - ``OUTLIER_CHANNELS`` hidden channels, picked by seed (:func:`outlier_channels`), get their
      ``input_layernorm`` and ``post_attention_layernorm`` weights multiplied by
      ``OUTLIER_NORM_SCALE`` in every predictor layer, so every q/k/v and gate/up input carries
      those channels far above the rest;
    - the same columns of the codec embeddings that feed the predictor (its residual tables and
      the talker's layer-0 table; or the rows of ``small_to_mtp_projection`` when it exists) are
      multiplied by ``OUTLIER_EMBED_SCALE``, so the residual stream carries them too;
    - the codebook heads are scaled so their logits have a standard deviation of
      ``PEAKED_HEAD_LOGIT_STD``: the top-1 probability becomes substantial rather than near-uniform;
    - the talker likewise: the same RMSNorm weights of every talker layer at
      :func:`talker_outlier_channels`, and its codec head scaled to the same logit spread.
    """
    import torch

    d = dims_of(dims)
    _checked("kind", kind, KINDS)
    _checked("parts", parts, PARTS)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(dims, kind)
    shapes = predictor_weight_shapes(dims) if parts == "predictor" else talker_weight_shapes(dims)
    if parts == "predictor":
        # The layer-0 embedding table feeds the predictor's position 1: keep it with the predictor.
        shapes[LAYER0_EMBEDDING] = (TALKER_VOCAB, d.talker_hidden)
    with torch.no_grad():
        store = getattr(torch, d.dtype)
        # Cast to the storage dtype at once (peak memory at 1.7B), except what outliers rescale.
        tensors = {
            name: t if name.startswith("talker.code_predictor.") or name == LAYER0_EMBEDDING else t.to(store)
            for name, t in ((n, _random_tensor(n, shape, seed)) for n, shape in shapes.items())
        }
        if outliers:
            _apply_outliers(tensors, dims, seed)
        if kind == "base" and parts == "all":
            tensors.update(_speaker_encoder_tensors(config, seed))
        _save_safetensors(tensors, out / "model.safetensors", d.dtype)
        st_config = speech_tokenizer_config(dims)
        written = {
            "config.json": config,
            "tokenizer.json": tokenizer_json(),
            "speech_tokenizer/config.json": st_config,
            **{rel: _template(rel) for rel in _VERBATIM},
        }
        st = out / "speech_tokenizer"
        st.mkdir(exist_ok=True)
        for rel, obj in written.items():
            _write_json(out / rel, obj)
        if parts == "all":
            _save_safetensors(_speech_tokenizer_tensors(st_config, seed), st / "model.safetensors", "float32")
        elif (st / "model.safetensors").exists():
            (st / "model.safetensors").unlink()
    _write_json(
        out / "omni_cpu_fastpath.json",
        {
            "made_by": "omni_cpu_fastpath.testing.checkpoint.make_model",
            "dims": dims,
            "kind": kind,
            "seed": seed,
            "outliers": outliers,
            "parts": parts,
            "outlier_channels": outlier_channels(dims, seed) if outliers else [],
            "talker_outlier_channels": talker_outlier_channels(dims, seed) if outliers else [],
        },  # fmt: skip
    )
    return out


def cli_make_model(args: argparse.Namespace) -> int:
    out = Path(args.dir)
    parts = getattr(args, "parts", "all")
    path = make_model(
        out, dims=args.dims, kind=args.kind, seed=args.seed, outliers=args.outliers, parts=parts
    )
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    print(json.dumps({"dir": str(path), "dims": args.dims, "kind": args.kind, "seed": args.seed,
                      "outliers": bool(args.outliers), "bytes": size}))  # fmt: skip
    return 0


__all__ = [
    "CheckpointError",
    "DIMS",
    "KINDS",
    "SPEAKERS",
    "build_config",
    "cli_make_model",
    "make_model",
    "outlier_channels",
    "predictor_weight_shapes",
    "talker_outlier_channels",
    "speech_tokenizer_config",
    "talker_weight_shapes",
]
