"""vllm-omni's STOCK Qwen3-TTS objects, built on CPU from a checkpoint folder (tests, benchmarks).

``build_stock_predictor(model_dir)`` returns vllm-omni's own code predictor
(:class:`Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM`) with the checkpoint's
``talker.code_predictor.*`` tensors loaded through its own ``load_weights``, names stripped of
``talker.code_predictor.`` exactly as the talker's ``hf_to_vllm_mapper`` + ``AutoWeightsLoader`` do.

Why a subclass (:class:`EagerStockCodePredictor`): the stock ``_setup_compile`` asks
``current_omni_platform.supports_torch_inductor()``; without an omni platform on CPU that raises
NotImplementedError, and with one that allows Inductor it would compile inside a test.
The subclass overrides ONLY ``_setup_compile`` with the stock eager branch (the code vllm-omni runs
when the platform has no Inductor: cache dtype, heads and embeddings, ``model.forward`` uncompiled).
``forward``, ``load_weights``, the layers and the sampling are the stock ones, untouched; nothing in
vllm/vllm_omni is patched.

``build_stock_talker(model_dir)`` builds the whole stock talker (backbone ``Qwen3Model``, predictor,
speech-tokenizer encoder) the way a worker would, minus the runner, and ``build_stock_code2wav``
the stage-1 codec decoder: see their docstrings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

PREDICTOR_PREFIX = "talker.code_predictor."


class StockBuildError(RuntimeError):
    """A checkpoint folder could not be turned into the stock vllm-omni object."""


def _checkpoint_files(model_dir: Path) -> list[Path]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not (model_dir / "config.json").exists() or not files:
        raise StockBuildError(
            f"{model_dir} is not a Qwen3-TTS checkpoint folder (needs config.json and *.safetensors); "
            "make one with `omni-cpu-fastpath make-model DIR`"
        )
    return files


def iter_checkpoint(model_dir: str | Path, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor in the folder's safetensors whose name starts with ``prefix``."""
    from safetensors import safe_open

    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith(prefix):
                    yield name, f.get_tensor(name)


def load_qwen3_tts_config(model_dir: str | Path):
    """vllm-omni's ``Qwen3TTSConfig`` read from ``model_dir/config.json``."""
    from vllm_omni.model_executor.models.qwen3_tts.configuration_qwen3_tts import Qwen3TTSConfig

    _checkpoint_files(Path(model_dir))
    return Qwen3TTSConfig.from_pretrained(str(model_dir))


def _stock_predictor_cls(compiled: bool):
    import torch
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code_predictor_vllm import (
        Qwen3TTSTalkerCodePredictorForConditionalGenerationVLLM as Stock,
    )

    class StockCodePredictor(Stock):
        """The stock predictor with one of the two stock ``_setup_compile`` branches, whatever the
        platform: eager (what vllm-omni runs where its platform has no Inductor, CPU included), or
        compiled (where it has, GPUs: ``torch.compile(model.forward, dynamic=False,
        options={"epilogue_fusion": False})`` warmed on every batch bucket up to ``max_num_seqs``,
        no device graphs; the strongest stock path)."""

        def _setup_compile(self) -> None:
            if self._compiled_model_fwd is not None:
                return
            self._model_dtype = next(self.model.parameters()).dtype
            self._lm_heads_list = list(self.lm_head)
            self._codec_embeds_list = list(self.model.codec_embedding)
            if not compiled:
                self._compiled_model_fwd = self.model.forward
                return
            self._compiled_model_fwd = torch.compile(
                self.model.forward, dynamic=False, options={"epilogue_fusion": False}
            )
            with torch._dynamo.config.patch(cache_size_limit=self._compile_cache_size_limit()):
                self._warmup_buckets()

    StockCodePredictor.__name__ = StockCodePredictor.__qualname__ = (
        "CompiledStockCodePredictor" if compiled else "EagerStockCodePredictor"
    )
    return StockCodePredictor


_EAGER_CLS: Any = None
_COMPILED_CLS: Any = None


def eager_predictor_cls():
    """The :class:`EagerStockCodePredictor` class (built lazily: importing it imports vllm_omni)."""
    global _EAGER_CLS
    if _EAGER_CLS is None:
        _EAGER_CLS = _stock_predictor_cls(compiled=False)
    return _EAGER_CLS


def compiled_predictor_cls():
    """The :class:`CompiledStockCodePredictor` class (built lazily, as :func:`eager_predictor_cls`)."""
    global _COMPILED_CLS
    if _COMPILED_CLS is None:
        _COMPILED_CLS = _stock_predictor_cls(compiled=True)
    return _COMPILED_CLS


def build_stock_predictor(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """vllm-omni's stock code predictor for ``model_dir`` on CPU, weights loaded, in ``dtype``, eval mode.

    Call it as the talker does: ``pred(layer0_code=[B,1], layer0_embed=[B,1,Ht],
    last_talker_hidden=[B,1,Ht], do_sample=False)`` -> codes ``[B, 16]`` (``Ht``: talker width; the
    layer-0 embedding is the talker's ``codec_embedding`` row). ``pred.model`` / ``pred.lm_head`` /
    ``pred.small_to_mtp_projection`` give the parts for teacher-forced logits.
    """
    from vllm.config import VllmConfig
    from vllm.config.vllm import set_current_vllm_config

    model_dir = Path(model_dir)
    config = load_qwen3_tts_config(model_dir)
    talker_config = config.talker_config
    vllm_config = VllmConfig()
    with set_current_vllm_config(vllm_config):
        pred = eager_predictor_cls()(
            vllm_config=vllm_config,
            config=talker_config.code_predictor_config,
            talker_config=talker_config,
            prefix="code_predictor",
        )
    weights = ((n[len(PREDICTOR_PREFIX) :], t) for n, t in iter_checkpoint(model_dir, PREDICTOR_PREFIX))
    loaded = pred.load_weights(weights)
    expected = {n for n, _ in pred.named_parameters()}
    missing = sorted(expected - set(loaded))
    if missing:
        raise StockBuildError(
            f"{model_dir}: the stock predictor's load_weights left parameters unloaded: {missing[:8]}"
        )
    return pred.to(dtype=dtype).eval()


def layer0_embedding(
    model_dir: str | Path, codes: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rows of the talker's ``codec_embedding`` (the layer-0 embedding the predictor gets), ``[B, 1, Ht]``."""
    name = "talker.model.codec_embedding.weight"
    for n, t in iter_checkpoint(model_dir, name):
        if n == name:
            return t.to(dtype)[codes.reshape(-1).long()].unsqueeze(1)
    raise StockBuildError(f"{model_dir} has no {name} (a parts='predictor' checkpoint without outliers?)")


def ensure_single_process_world() -> None:
    """A one-process gloo world and model-parallel groups, as a CPU worker sets them up (once)."""
    import socket

    from vllm.distributed import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
        model_parallel_is_initialized,
    )

    if model_parallel_is_initialized():
        return
    # On a free port: tests run in parallel.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    ensure_model_parallel_initialized(1, 1)


def _build_stock_stage(
    model_dir: str | Path,
    model_cls,
    stage: str,
    worker: str,
    dtype,
    load_format: str,
    quantization: str | None = None,
    arch: str | None = None,
    after_load: Callable[[nn.Module], Any] | None = None,
):
    # ``arch``: the architecture name the config declares (a subclass serves under the stock name).
    # ``after_load``: called with the model between loading and process_weights_after_loading.
    from vllm.config import DeviceConfig, LoadConfig, VllmConfig
    from vllm.config.vllm import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm_omni.config.model import OmniModelConfig
    from vllm_omni.plugins import load_omni_general_plugins

    model_dir = Path(model_dir)
    _checkpoint_files(model_dir)
    load_omni_general_plugins()
    model_config = OmniModelConfig(
        model=str(model_dir),
        dtype=dtype,
        max_model_len=4096,
        enforce_eager=True,
        model_stage=stage,
        model_arch=arch or model_cls.__name__,
        worker_type=worker,
        quantization=quantization,
    )
    vllm_config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig("cpu"),
        load_config=LoadConfig(load_format=load_format),
    )
    if quantization is None:
        # The platform hook gives a talker stage VLLM_OMNI_TALKER_INT8's method where the
        # environment selects one: a stock build is float unless asked otherwise.
        model_config.quantization = None
        vllm_config.quant_config = None
    with set_current_vllm_config(vllm_config):
        ensure_single_process_world()
        loader = get_model_loader(vllm_config.load_config)
        with torch.device("cpu"):
            model = model_cls(vllm_config=vllm_config, prefix="")
        model = model.to(dtype=dtype)
        loader.load_weights(model, model_config)
        if after_load is not None:
            after_load(model)
        process_weights_after_loading(model, model_config, torch.device("cpu"))
    return model.eval(), vllm_config


def build_stock_talker(
    model_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    load_format: str = "auto",
    quantization: str | None = None,
    after_load: Callable[[nn.Module], Any] | None = None,
):
    """The stock ``Qwen3TTSTalkerForConditionalGeneration`` built on CPU outside an engine.

    Steps (see shared notes "Building a tiny talker without downloads"): load vllm-omni's general
    plugins so transformers knows ``qwen3_tts``; an ``OmniModelConfig`` + ``VllmConfig`` on CPU;
    a one-process gloo "distributed" world and model-parallel groups; construct vllm-omni's own
    class (imported directly, not through the registry, which plugins may point at a fast
    subclass under the same architecture name); load weights (``load_format="auto"``: vLLM's strict loader
    through the talker's own ``load_weights``, ``"dummy"``: vLLM's random init);
    ``process_weights_after_loading``. The backbone's attention still needs a runner's KV cache,
    so this is for construction, loading, ``talker_mtp`` and embeddings, not a backbone forward
    through vLLM's attention (``qwen3_tts/talker_parity.py`` runs the layers with its own).
    ``quantization``: a vLLM quantization method name for the model config (e.g. the talker's int8
    method), resolved through vLLM's registry as a served stage resolves it. ``after_load``: called
    with the model once its weights are loaded, before ``process_weights_after_loading`` (where
    ``FastQwen3TTSTalker.load_weights`` hands the int8 linears their RMSNorm gains).
    Returns ``(model, vllm_config)``.
    """
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import (
        Qwen3TTSTalkerForConditionalGeneration,
    )

    return _build_stock_stage(
        model_dir,
        Qwen3TTSTalkerForConditionalGeneration,
        "qwen3_tts",
        "ar",
        dtype,
        load_format,
        quantization,
        after_load=after_load,
    )


def build_stock_code2wav(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, load_format: str = "auto"
):
    """The stock ``Qwen3TTSCode2Wav`` (stage 1) built on CPU, decoder loaded from ``speech_tokenizer/``.

    Returns ``(model, vllm_config)``; ``model.decoder`` is vllm-omni's codec decoder.
    """
    from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_code2wav import Qwen3TTSCode2Wav

    return _build_stock_stage(model_dir, Qwen3TTSCode2Wav, "code2wav", "generation", dtype, load_format)


__all__ = [
    "StockBuildError",
    "build_stock_code2wav",
    "build_stock_predictor",
    "build_stock_talker",
    "compiled_predictor_cls",
    "eager_predictor_cls",
    "iter_checkpoint",
    "layer0_embedding",
    "load_qwen3_tts_config",
]
