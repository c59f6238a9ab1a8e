"""``FastQwen3TTSTalker``: vllm-omni's Qwen3-TTS talker with the CPU fast paths plugged in.

Registered by ``omni_cpu_fastpath.plugins.register_models`` under the stock architecture name
``Qwen3TTSTalkerForConditionalGeneration`` (the runners' string allow-lists key off it), only
when VLLM_OMNI_CPU_FASTPATH is on. What it changes, each behind its own flag:

- VLLM_OMNI_PREDICTOR_INCREMENTAL: after weight loading the code predictor becomes
  ``omni_cpu_fastpath.predictor.CachedCodePredictor.from_stock(stock)`` (KV-cached sub-steps,
  sharing the stock weights).
- VLLM_OMNI_PREDICTOR_INT8 / VLLM_OMNI_PREDICTOR_PARITY_CHECK: the predictor (cached or stock)
  is quantized by ``omni_cpu_fastpath.quant.prepare_served_predictor``; with the parity check on,
  every talker step also runs a float copy teacher-forced on the served codes and records
  ``predictor.parity.*`` into step_stats.
- VLLM_OMNI_CPU_FAST_SAMPLER (CPU only): ``prefer_model_sampler = True`` and ``sample()`` uses
  ``omni_cpu_fastpath.sampler.CpuSampler`` (no torch.compile) for codebook 0.

Either one that cannot be built (module missing, construction error) is logged with the reason
and the stock component serves. Forward, sampling and the talker MTP step are timed into
step_stats (``model.forward_ms``, ``model.sample_ms``, ``model.talker_mtp_ms``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger
from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSTalkerForConditionalGeneration

from . import envs, step_stats

logger = init_logger(f"vllm.{__name__}")  # under "vllm" so vLLM's log config shows it


def _load(module: str, name: str) -> tuple[Any, str | None]:
    """``module.name`` or (None, why not)."""
    try:
        return getattr(importlib.import_module(module), name), None
    except Exception as exc:  # ImportError while the helper module does not exist yet, or its bugs
        return None, f"{module}.{name} unavailable ({type(exc).__name__}: {exc})"


class FastQwen3TTSTalker(Qwen3TTSTalkerForConditionalGeneration):
    """The stock talker plus the KV-cached predictor and the compile-free sampler."""

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        envs.validate_all()
        # Fails here, at start-up, when VLLM_OMNI_STEP_STATS_DIR is not writable.
        step_stats.configure()
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._on_cpu = torch.device(vllm_config.device_config.device).type == "cpu"
        self._predictor_swapped = False
        self._parity: Any = None  # quant.ParityChecker when VLLM_OMNI_PREDICTOR_PARITY_CHECK is on
        self.fast_path: dict[str, str] = {}  # component -> "fast" (with details) or the reason it is stock
        self._model_sampler: nn.Module | None = None
        self._sampler_times_itself = False
        self._init_sampler(vllm_config)
        logger.info("omni-cpu-fastpath: FastQwen3TTSTalker sampler: %s", self.fast_path["sampler"])

    # --- sampler -------------------------------------------------------------------------------

    def _init_sampler(self, vllm_config: Any) -> None:
        if not envs.get("VLLM_OMNI_CPU_FAST_SAMPLER"):
            self.fast_path["sampler"] = "stock (VLLM_OMNI_CPU_FAST_SAMPLER off)"
            return
        if not self._on_cpu:
            self.fast_path["sampler"] = "stock (not on CPU)"
            return
        model_config = vllm_config.model_config
        cls, why = _load("omni_cpu_fastpath.sampler", "CpuSampler")
        sampler: nn.Module | None = None
        if cls is not None:
            try:
                sampler = cls(
                    logprobs_mode=model_config.logprobs_mode,
                    use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False),
                )
            except Exception as exc:
                why = f"CpuSampler could not be built ({type(exc).__name__}: {exc})"
        if sampler is not None:
            # CpuSampler times its whole call as model.sample_ms itself.
            self._sampler_times_itself = True
            self.fast_path["sampler"] = f"fast ({sampler.kernel_status})"
        else:
            # Keep the model-sampler hook (so the step is timed) with vLLM's own Sampler inside:
            # the same tokens as the runner's default path.
            from vllm.v1.sample.sampler import Sampler

            logger.warning("omni-cpu-fastpath: %s; sampling with vLLM's Sampler", why)
            sampler = Sampler(
                logprobs_mode=model_config.logprobs_mode,
                use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False),
            )
            self.fast_path["sampler"] = f"stock ({why})"
        self._model_sampler = sampler
        self.prefer_model_sampler = True

    def sample(self, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        """Codebook-0 sampling; called by vllm-omni's runner when ``prefer_model_sampler``."""
        assert self._model_sampler is not None, "sample() called with the fast sampler off"
        if self._sampler_times_itself:
            return self._model_sampler(logits, sampling_metadata)
        with step_stats.timer(step_stats.MODEL_SAMPLE, sync=True):
            return self._model_sampler(logits, sampling_metadata)

    # --- predictor -----------------------------------------------------------------------------

    def load_weights(self, weights: Any) -> set[str]:
        loaded = super().load_weights(weights)
        self._swap_predictor()
        return loaded

    def _swap_predictor(self) -> None:
        if self._predictor_swapped:
            return
        self._predictor_swapped = True
        self._swap_cached_predictor()
        if self._on_cpu:
            from . import quant

            # A refused flag combination raises here, at load; a missing kernel keeps float weights.
            self.code_predictor, self._parity = quant.prepare_served_predictor(self.code_predictor)
            if self._parity is not None:
                self._parity.candidate = self.code_predictor
        self.fast_path["int8"] = envs.get("VLLM_OMNI_PREDICTOR_INT8") if self._on_cpu else "off (not on CPU)"

    def _swap_cached_predictor(self) -> None:
        if not envs.get("VLLM_OMNI_PREDICTOR_INCREMENTAL"):
            self.fast_path["predictor"] = "stock (VLLM_OMNI_PREDICTOR_INCREMENTAL off)"
            return
        cls, why = _load("omni_cpu_fastpath.predictor", "CachedCodePredictor")
        if cls is not None:
            try:
                self.code_predictor = cls.from_stock(self.code_predictor)
            except Exception as exc:
                why = f"CachedCodePredictor.from_stock failed ({type(exc).__name__}: {exc})"
                logger.exception("omni-cpu-fastpath: %s", why)
            else:
                self.fast_path["predictor"] = "fast"
                logger.info("omni-cpu-fastpath: code predictor is CachedCodePredictor")
                return
        logger.warning("omni-cpu-fastpath: %s; keeping the stock code predictor", why)
        self.fast_path["predictor"] = f"stock ({why})"

    # --- timed entry points --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with step_stats.timer(step_stats.MODEL_FORWARD, sync=True):
            return super().forward(*args, **kwargs)

    def talker_mtp(
        self,
        input_ids: torch.Tensor,
        input_embeds: torch.Tensor,
        last_talker_hidden: torch.Tensor,
        text_step: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # Weights loaded without load_weights (``--load-format dummy``) still get the fast predictor.
        if not self._predictor_swapped:
            self._swap_predictor()
        with step_stats.timer(step_stats.MODEL_TALKER_MTP, sync=True):
            out = super().talker_mtp(input_ids, input_embeds, last_talker_hidden, text_step, *args, **kwargs)
        if self._parity is not None:
            self._check_parity(input_ids, input_embeds, last_talker_hidden, out[1])
        return out

    def _check_parity(
        self, input_ids: torch.Tensor, input_embeds: torch.Tensor, hidden: torch.Tensor, codes: torch.Tensor
    ) -> None:
        # Rows whose layer-0 code is not a codec code (EOS) were zeroed by the stock talker_mtp;
        # teacher-forcing on those zeros would measure nothing, so only real frames are checked.
        bsz = int(codes.shape[0])
        layer0 = input_ids.reshape(bsz).long()
        rows = (layer0 >= 0) & (layer0 < int(self._codebook_vocab_size))
        if not bool(rows.any()):
            return
        self._parity.check(
            layer0[rows].reshape(-1, 1),
            input_embeds.reshape(bsz, 1, -1)[rows],
            hidden.reshape(bsz, 1, -1)[rows],
            codes[rows],
        )

    # The stock class aliases ``mtp = talker_mtp`` for Model Runner V2; keep the alias on ours.
    mtp = talker_mtp
