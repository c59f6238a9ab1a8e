"""The Spark-X2.5 config class, validated on construction.

Registered with transformers' public ``AutoConfig.register`` (see ``plugin.py``): a registered
class wins over the checkpoint's ``auto_map``, so the released folder loads without
``trust_remote_code``.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import PretrainedConfig

MODEL_TYPE = "spark2_5"
ARCHITECTURE = "Spark2_5ForCausalLM"
LAYER_TYPES = ("sliding_attention", "full_attention")


class SparkConfigError(ValueError):
    """A Spark-X2.5 config value the model cannot run with."""


@strict
class Spark2_5Config(PretrainedConfig):
    """Hybrid sliding/full attention decoder with a sigmoid head-wise output gate."""

    model_type = MODEL_TYPE
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 131072
    hidden_size: int = 2048
    intermediate_size: int = 6656
    num_hidden_layers: int = 28
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "gelu"
    max_position_embeddings: int = 1048576
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = True
    rope_parameters: dict | None = None
    attention_bias: bool = False
    mlp_bias: bool = False
    attention_dropout: float | int = 0.0
    sliding_window: int = 512
    layer_types: list[str] | None = None
    headwise_attn_output_gate: bool = True
    gate_attn_act_mode: str = "sigmoid"
    pad_token_id: int | None = 2
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self, **kwargs: Any) -> None:
        if self.layer_types is None:
            # The released pattern: three sliding layers, then one full layer.
            self.layer_types = [
                "full_attention" if i % 4 == 3 else "sliding_attention" for i in range(self.num_hidden_layers)
            ]
        super().__post_init__(**kwargs)
        self.check()

    def convert_rope_params_to_dict(self, **kwargs: Any) -> dict[str, Any]:
        # Keep the per-layer-type dicts as they are: the base class would otherwise add top-level
        # rope_theta / rope_type keys beside them.
        kwargs.pop("rope_scaling", None)
        kwargs.pop("rope_theta", None)
        if self.rope_parameters is None:
            self.rope_parameters = {
                "full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.25},
                "sliding_attention": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 1.0,
                },
            }
        for params in self.rope_parameters.values():
            if isinstance(params, dict):
                params.setdefault("rope_type", "default")
        return kwargs

    def validate_architecture(self) -> None:
        # Part of @strict validation; check() raises the package's own error type.
        self.check()

    def check(self) -> None:
        """Raise :class:`SparkConfigError` naming the first value the model cannot run with."""
        if self.num_attention_heads <= 0 or self.num_key_value_heads <= 0 or self.head_dim <= 0:
            raise SparkConfigError(
                f"spark2_5: num_attention_heads ({self.num_attention_heads}), num_key_value_heads "
                f"({self.num_key_value_heads}) and head_dim ({self.head_dim}) must be positive"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise SparkConfigError(
                f"spark2_5: num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        layer_types = self.layer_types
        if not isinstance(layer_types, list) or len(layer_types) != self.num_hidden_layers:
            n = len(layer_types) if isinstance(layer_types, list) else type(layer_types).__name__
            raise SparkConfigError(
                f"spark2_5: layer_types must list one type per layer: got {n} entries for "
                f"num_hidden_layers={self.num_hidden_layers}"
            )
        bad = sorted({t for t in layer_types if t not in LAYER_TYPES}, key=str)
        if bad:
            raise SparkConfigError(
                f"spark2_5: layer_types has unknown entries {bad}; accepted: {list(LAYER_TYPES)}"
            )
        rope = self.rope_parameters
        if not isinstance(rope, dict):
            raise SparkConfigError("spark2_5: rope_parameters must map each layer type to its RoPE dict")
        for layer_type in sorted(set(layer_types)):
            params = rope.get(layer_type)
            if not isinstance(params, dict) or "rope_theta" not in params:
                raise SparkConfigError(
                    f"spark2_5: rope_parameters[{layer_type!r}] is missing or has no rope_theta "
                    f"(got {params!r})"
                )
            if params.get("rope_type", "default") != "default":
                raise SparkConfigError(
                    f"spark2_5: rope_parameters[{layer_type!r}].rope_type={params['rope_type']!r}; "
                    "only 'default' is supported"
                )
            rotary = self.rotary_dim(layer_type)
            if rotary <= 0 or rotary > self.head_dim or rotary % 2:
                raise SparkConfigError(
                    f"spark2_5: rope_parameters[{layer_type!r}].partial_rotary_factor gives a rotary "
                    f"dimension of {rotary} for head_dim {self.head_dim}; it must be even and in "
                    f"(0, head_dim]"
                )
        if "sliding_attention" in layer_types and (self.sliding_window is None or self.sliding_window <= 0):
            raise SparkConfigError(f"spark2_5: sliding_window must be positive, got {self.sliding_window!r}")
        if self.hidden_act != "gelu":
            raise SparkConfigError(
                f"spark2_5: hidden_act={self.hidden_act!r}; the model uses exact (erf) 'gelu'"
            )
        if self.headwise_attn_output_gate is not True:
            raise SparkConfigError(
                "spark2_5: headwise_attn_output_gate must be true (the model always gates each head)"
            )
        if self.gate_attn_act_mode != "sigmoid":
            raise SparkConfigError(
                f"spark2_5: gate_attn_act_mode={self.gate_attn_act_mode!r}; only 'sigmoid' is supported"
            )
        if self.tie_word_embeddings is not True:
            raise SparkConfigError(
                "spark2_5: tie_word_embeddings must be true (the head is model.embedding.weight; the "
                "checkpoint has no lm_head)"
            )
        if self.attention_bias or self.mlp_bias:
            raise SparkConfigError("spark2_5: attention_bias and mlp_bias must be false")

    def rotary_dim(self, layer_type: str) -> int:
        """Dimensions rotated on a layer type (the rest of each head passes through)."""
        factor = float(self.rope_parameters[layer_type].get("partial_rotary_factor", 1.0))
        return int(self.head_dim * factor)


__all__ = ["ARCHITECTURE", "MODEL_TYPE", "Spark2_5Config", "SparkConfigError"]
