"""One place where an upgrade of vLLM, vllm-omni, torch or torchao fails first, and clearly.

The package subclasses and calls into parts of its stack that are not public API: private
functions, methods it overrides, attributes it reads. Each is listed here with the parameters
this package relies on. A test failing here names the symbol that moved or changed; fix the
package's use of it (and this table) before trusting the rest of the suite on the new version.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any

import pytest

# (module, qualified name, leading parameter names the package passes or overrides)
SIGNATURES: list[tuple[str, str, list[str]]] = [
    # CpuSampler: vLLM's sampler internals, reproduced bit for bit
    ("vllm.v1.sample.ops.penalties", "_convert_to_tensors", ["output_token_ids", "vocab_size", "device"]),
    ("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p_pytorch", ["logits", "k", "p"]),
    ("vllm.v1.sample.ops.topk_topp_sampler", "sample_with_exponential_noise", ["probs", "q"]),
    ("vllm.v1.sample.ops.bad_words", "apply_bad_words", ["logits", "bad_words_token_ids", "past_tokens_ids"]),
    ("vllm.v1.sample.sampler", "Sampler.__init__", ["self", "logprobs_mode", "use_fp64_gumbel"]),
    (
        "vllm.v1.sample.sampler",
        "Sampler.forward",
        ["self", "logits", "sampling_metadata", "predict_bonus_token", "logprobs_mode_override"],
    ),
    # the CPU platform and workers: subclasses of vLLM's CPU classes
    ("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", ["vllm_config"]),
    ("vllm.platforms", "cpu_platform_plugin", []),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner.__init__", ["self", "vllm_config", "device"]),
    ("vllm.v1.worker.cpu_model_runner", "CPUModelRunner._postprocess_tensors", ["self"]),
    ("vllm.v1.worker.cpu_worker", "CPUWorker.init_device", ["self"]),
    ("vllm.utils.cpu_resource_utils", "get_memory_node_info", []),
    # vllm-omni's runners: the CPU runners override these
    (
        "vllm_omni.worker.gpu_model_runner",
        "OmniGPUModelRunner._talker_mtp_forward",
        ["self", "decode_req_ids", "inputs_embeds", "start_offsets"],
    ),
    ("vllm_omni.worker.gpu_ar_model_runner", "GPUARModelRunner.sample_tokens", ["self"]),
    ("vllm_omni.worker.gpu_ar_model_runner", "GPUARModelRunner.load_model", ["self"]),
    # the talker and its code predictor: FastQwen3TTSTalker subclasses, CachedCodePredictor wraps
    (
        "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker",
        "Qwen3TTSTalkerForConditionalGeneration.__init__",
        ["self", "vllm_config", "prefix"],
    ),
    (
        "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker",
        "Qwen3TTSTalkerForConditionalGeneration.talker_mtp",
        ["self", "input_ids", "input_embeds", "last_talker_hidden", "text_step", "do_sample", "temperature"],
    ),
    (
        "vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker",
        "Qwen3TTSTalkerForConditionalGeneration.load_weights",
        ["self", "weights"],
    ),
    (
        "vllm_omni.model_executor.models.common.qwen3_code_predictor",
        "CodePredictorWrapper.forward",
        [
            "self",
            "layer0_code",
            "layer0_embed",
            "last_talker_hidden",
            "do_sample",
            "temperature",
            "top_k",
            "top_p",
            "generator",
            "generators",
            "sample_uniforms",
        ],
    ),
    (
        "vllm_omni.model_executor.models.common.qwen3_code_predictor",
        "CodePredictorWrapper._setup_compile",
        ["self"],
    ),
    (
        "vllm_omni.model_executor.models.common.qwen3_code_predictor",
        "CodePredictorWrapper._warmup_buckets",
        ["self"],
    ),
    (
        "vllm_omni.model_executor.models.common.qwen3_code_predictor",
        "CodePredictorWrapper._compile_cache_size_limit",
        ["self"],
    ),
    ("vllm_omni.plugins", "load_omni_general_plugins", []),
    # torch and torchao
    ("torch.compiler", "set_stance", ["stance"]),
    ("torchao.quantization", "Int8WeightOnlyConfig", ["group_size", "granularity", "set_inductor_config"]),
    ("torchao.quantization", "quantize_", ["model", "config"]),
]

# (module, qualified name of a class or object, attributes the package reads on it or its instances)
ATTRIBUTES: list[tuple[str, str, list[str]]] = [
    (
        "vllm_omni.model_executor.models.common.qwen3_code_predictor",
        "CodePredictorWrapper",
        ["set_sampling_params", "configure_mtp_execution_buckets", "load_weights", "get_input_embeddings"],
    ),
    ("vllm_omni.model_executor.models.registry", "OmniModelRegistry", ["models", "register_model"]),
    ("vllm_omni.platforms.interface", "OmniPlatformEnum", ["OOT"]),
    ("vllm_omni.platforms.interface", "OmniPlatform", ["get_omni_ar_worker_cls", "supports_torch_inductor"]),
    ("vllm.v1.sample.logits_processor.builtin", "MinPLogitsProcessor", ["apply"]),
]


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("module, qualname, params", SIGNATURES, ids=[f"{m}:{q}" for m, q, _ in SIGNATURES])
def test_signature(module: str, qualname: str, params: list[str]) -> None:
    obj = _resolve(module, qualname)
    got = list(inspect.signature(obj).parameters)
    assert got[: len(params)] == params, (
        f"{module}.{qualname}{inspect.signature(obj)}: expected {params} first"
    )


@pytest.mark.parametrize("module, qualname, attrs", ATTRIBUTES, ids=[f"{m}:{q}" for m, q, _ in ATTRIBUTES])
def test_attributes(module: str, qualname: str, attrs: list[str]) -> None:
    obj = _resolve(module, qualname)
    missing = [a for a in attrs if not hasattr(obj, a)]
    assert not missing, f"{module}.{qualname} lacks {missing}"


def test_sampling_metadata_fields() -> None:
    from vllm.v1.sample.metadata import SamplingMetadata

    used = {
        "temperature",
        "all_greedy",
        "all_random",
        "top_p",
        "top_k",
        "generators",
        "max_num_logprobs",
        "no_penalties",
        "prompt_token_ids",
        "frequency_penalties",
        "presence_penalties",
        "repetition_penalties",
        "output_token_ids",
        "allowed_token_ids_mask",
        "bad_words_token_ids",
        "logitsprocs",
        "logprob_token_ids",
        "thinking_budget_state_holder",
    }
    fields = {f.name for f in dataclasses.fields(SamplingMetadata)}
    assert used <= fields, f"SamplingMetadata lost {sorted(used - fields)}"


def test_code_predictor_wrapper_config_fields() -> None:
    from vllm_omni.model_executor.models.common.qwen3_code_predictor import CodePredictorWrapperConfig

    fields = {f.name for f in dataclasses.fields(CodePredictorWrapperConfig)}
    assert {"sampling_mode", "return_proj_buf"} <= fields


def test_weight_int8pack_mm_schema() -> None:
    import torch

    schema = str(torch.ops.aten._weight_int8pack_mm.default._schema)
    assert schema == "aten::_weight_int8pack_mm(Tensor self, Tensor mat2, Tensor scales) -> Tensor", schema


def test_inductor_options_exist() -> None:
    import torch._inductor.config as inductor_config

    from omni_cpu_fastpath.qwen3_tts.predictor import INDUCTOR_OPTIONS

    for name in (*INDUCTOR_OPTIONS, "freezing"):
        assert hasattr(inductor_config, name), f"torch._inductor.config has no {name}"


def test_cpu_generator_state_layout() -> None:
    # CpuSampler's C kernel reads and writes ATen's CPU mt19937 state as Generator.get_state() gives it.
    import torch

    assert torch.Generator().get_state().numel() == 5056


def test_torchao_weight_only_tensor_fields() -> None:
    import torch
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    holder = torch.nn.Sequential(torch.nn.Linear(32, 16, bias=False))
    quantize_(holder, Int8WeightOnlyConfig(set_inductor_config=False))
    weight = holder[0].weight
    assert hasattr(weight, "qdata") and hasattr(weight, "scale"), type(weight)
