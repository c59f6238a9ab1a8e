"""Spark-X2.5 for vLLM, built from vLLM's own layers.

Per layer: RMSNorm -> fused QKV (``q_k_v_proj``) -> per-layer-type RoPE -> vLLM attention (a
512-position window on sliding layers) -> each head scaled by sigmoid(g_proj(x_norm)) -> out_proj;
then RMSNorm -> down(gelu(gate(x)) * up(x)) with exact-erf GELU. The head is the tied
``model.embedding.weight``.

Served eager in bf16 on a CPU without native bf16, the decoder linears take the package's
:class:`~omni_cpu_fastpath.fp32_prefill.Fp32PrefillLinearMethod` (``VLLM_OMNI_SPARK_FP32_PREFILL``):
torch emulates bf16 products there, slowly for a prompt's many rows.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from itertools import islice
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import CacheConfig, CompilationMode, VllmConfig
from vllm.distributed import (
    get_pp_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from vllm.model_executor.layers.activation import GeluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization import QuantizationConfig
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.model_executor.utils import set_weight_attrs
from vllm.platforms import current_platform
from vllm.sequence import IntermediateTensors

from omni_cpu_fastpath import envs
from omni_cpu_fastpath.fp32_prefill import Fp32PrefillConfig
from omni_cpu_fastpath.serving.stage_settings import cpu_has_native_bf16

from .config import Spark2_5Config

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it


class HeadGate(nn.Module):
    """The head-wise output gate: ``weight`` is [heads on this rank, hidden].

    A plain parameter applied with ``F.linear``: vLLM's CPU linear dispatch sends narrow bf16
    linears to a packed GEMM on some CPUs, and this keeps the gate the same op on every platform
    and under torch.compile. Under tensor parallelism each rank keeps the rows of its own heads.
    """

    def __init__(self, hidden_size: int, total_num_heads: int) -> None:
        super().__init__()
        tp_size = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.num_heads = total_num_heads // tp_size
        self.weight = nn.Parameter(torch.empty(self.num_heads, hidden_size), requires_grad=False)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        rows = loaded_weight.narrow(0, self.tp_rank * self.num_heads, self.num_heads)
        param.data.copy_(rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The sigmoid in fp32, as the released model computes it.
        return torch.sigmoid(F.linear(x, self.weight).float())


class Spark2_5Attention(nn.Module):
    def __init__(
        self,
        config: Spark2_5Config,
        max_position: int,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        layer_type = config.layer_types[layer_idx]
        tp_size = get_tensor_model_parallel_world_size()
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = config.num_key_value_heads
        if self.total_num_heads % tp_size:
            raise ValueError(f"spark2_5: {self.total_num_heads} heads do not split over tp={tp_size}")
        if self.total_num_kv_heads % tp_size and tp_size % self.total_num_kv_heads:
            raise ValueError(f"spark2_5: {self.total_num_kv_heads} kv heads do not split over tp={tp_size}")
        self.num_heads = self.total_num_heads // tp_size
        self.num_kv_heads = max(1, self.total_num_kv_heads // tp_size)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        self.q_k_v_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            self.total_num_heads,
            self.total_num_kv_heads,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.q_k_v_proj",
        )
        self.g_proj = HeadGate(config.hidden_size, self.total_num_heads)
        self.out_proj = RowParallelLinear(
            self.total_num_heads * self.head_dim,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.out_proj",
        )
        rope = config.rope_parameters[layer_type]
        self.rotary_emb = get_rope(
            self.head_dim,
            max_position=max_position,
            is_neox_style=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": float(rope["rope_theta"]),
                "partial_rotary_factor": float(rope.get("partial_rotary_factor", 1.0)),
            },
        )
        window = config.sliding_window if layer_type == "sliding_attention" else None
        self.attn = Attention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.q_k_v_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v)
        # Scale each head before the heads are merged by out_proj.
        gate = self.g_proj(hidden_states).to(out.dtype)
        out = (out.view(-1, self.num_heads, self.head_dim) * gate.unsqueeze(-1)).view(-1, self.q_size)
        out, _ = self.out_proj(out)
        return out


class Spark2_5MLP(nn.Module):
    def __init__(self, config: Spark2_5Config, quant_config: QuantizationConfig | None, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [config.intermediate_size] * 2,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            config.intermediate_size,
            config.hidden_size,
            bias=False,
            quant_config=quant_config,
            prefix=f"{prefix}.down_proj",
        )
        self.act_fn = GeluAndMul(approximate="none")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class Spark2_5DecoderLayer(nn.Module):
    def __init__(
        self,
        config: Spark2_5Config,
        max_position: int,
        cache_config: CacheConfig | None,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.self_attn = Spark2_5Attention(
            config, max_position, cache_config, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = Spark2_5MLP(config, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def decoder_linears_config(vllm_config: VllmConfig) -> tuple[QuantizationConfig | None, str]:
    """The decoder linears' quantization config, and how they run (for the log)."""
    quant_config = vllm_config.quant_config
    if quant_config is not None:
        return quant_config, f"the checkpoint's {quant_config.get_name()}"
    setting = envs.get("VLLM_OMNI_SPARK_FP32_PREFILL")
    dtype = vllm_config.model_config.dtype
    if setting == "off" or not current_platform.is_cpu():
        return None, "vLLM's unquantized linears"
    if setting == "auto" and cpu_has_native_bf16():
        return None, "vLLM's unquantized linears (this CPU has native bf16)"
    if dtype is not torch.bfloat16:
        return None, f"vLLM's unquantized linears ({dtype}: nothing to widen)"
    if vllm_config.compilation_config.mode != CompilationMode.NONE:
        # Its apply branches on the row count, which one graph traced for every size cannot keep.
        why = "VLLM_OMNI_SPARK_FP32_PREFILL needs an eager model (--enforce-eager)"
        if setting == "on":
            logger.warning("spark2_5: decoder linears stay vLLM's: %s", why)
        return None, f"vLLM's unquantized linears ({why})"
    # Every linear the decoder layers build (the config reaches nothing else).
    return Fp32PrefillConfig(), "bf16, calls of 16+ rows in fp32, 1-8 rows through the few-row kernel"


def rope_max_position(config: Spark2_5Config, max_model_len: int | None) -> int:
    """Rows of the cos/sin cache: the served length, not the config's 1M positions."""
    if max_model_len is None:
        return config.max_position_embeddings
    return min(config.max_position_embeddings, max_model_len)


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": 0,
        "positions": -1,
        "intermediate_tensors": 0,
        "inputs_embeds": 0,
    }
)
class Spark2_5Model(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: Spark2_5Config = vllm_config.model_config.hf_config
        cache_config = vllm_config.cache_config
        quant_config = vllm_config.quant_config
        self.config = config
        max_position = rope_max_position(config, vllm_config.model_config.max_model_len)
        layers_config, linears = decoder_linears_config(vllm_config)
        logger.info("spark2_5: decoder linears: %s", linears)

        if get_pp_group().is_first_rank or get_pp_group().is_last_rank:
            # The last rank needs it too: the head is tied to it.
            self.embedding = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, quant_config=quant_config, prefix=f"{prefix}.embedding"
            )
        else:
            self.embedding = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: Spark2_5DecoderLayer(
                config, max_position, cache_config, layers_config, prefix=prefix
            ),
            prefix=f"{prefix}.layers",
        )
        self.norm = (
            RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            if get_pp_group().is_last_rank
            else PPMissingLayer()
        )
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            ["hidden_states", "residual"], config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embedding(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        if get_pp_group().is_first_rank:
            hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            residual = None
        else:
            assert intermediate_tensors is not None
            hidden_states = intermediate_tensors["hidden_states"]
            residual = intermediate_tensors["residual"]
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            hidden_states, residual = layer(positions, hidden_states, residual)
        if not get_pp_group().is_last_rank:
            return IntermediateTensors({"hidden_states": hidden_states, "residual": residual})
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Spark2_5ForCausalLM(nn.Module, SupportsPP):
    # The checkpoint stores gate and up separately; vLLM runs them as one merged linear.
    hf_to_vllm_mapper = WeightsMapper(
        orig_to_new_stacked={
            ".gate_proj": (".gate_up_proj", 0),
            ".up_proj": (".gate_up_proj", 1),
        }
    )
    packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = Spark2_5Model(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            ).tie_weights(self.model.embedding)
        else:
            self.lm_head = PPMissingLayer()
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(weights, mapper=self.hf_to_vllm_mapper)
