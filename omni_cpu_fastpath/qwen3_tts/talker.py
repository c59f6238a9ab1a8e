"""``FastQwen3TTSTalker``: vllm-omni's Qwen3-TTS talker with the CPU fast paths plugged in.

Registered by ``omni_cpu_fastpath.serving.plugins.register_models`` under the stock architecture name
``Qwen3TTSTalkerForConditionalGeneration`` (the runners' string allow-lists key off it), only
when VLLM_OMNI_CPU_FASTPATH is on. What it changes, each behind its own flag:

- VLLM_OMNI_PREDICTOR_INCREMENTAL: after weight loading the code predictor becomes
  ``omni_cpu_fastpath.qwen3_tts.predictor.CachedCodePredictor.from_stock(stock)`` (KV-cached sub-steps,
  sharing the stock weights), with VLLM_OMNI_PREDICTOR_COMPILE=step compiled once per batch
  bucket the runner can reach (``max_num_seqs``), after quantization.
- VLLM_OMNI_PREDICTOR_INT8 / VLLM_OMNI_PREDICTOR_PARITY_CHECK: the predictor (cached or stock)
  is quantized by ``omni_cpu_fastpath.qwen3_tts.quant.prepare_served_predictor``; with the parity check on,
  every talker step also runs a float copy teacher-forced on the served codes and records
  ``predictor.parity.*`` into step_stats.
- ``--dtype float32`` serves: the stock talker builds its input embeddings in bf16 whatever the
  model's dtype and fails at its first float32 step; this class builds them in the model's dtype.
- VLLM_OMNI_TALKER_INT8 acts through vLLM's quantization config (``quant/talker_int8.py``); this
  class records what serves the decoder linears as ``talker.int8``, and its ``load_weights`` hands
  the ``w8-channel`` linears the RMSNorm gains that pick their fp32 columns. With
  VLLM_OMNI_TALKER_PARITY_CHECK=1 each forward also runs the decoder with the int8 layers' float
  weights first and records ``talker.parity.*`` (``talker_parity.TalkerParityChecker``).
  VLLM_OMNI_TALKER_FP32_PREFILL and VLLM_OMNI_TALKER_DECODE_GEMV take the same road with int8 off
  (``quant/talker_fp32_prefill.py``); this class records how the float linears run as
  ``talker.prefill``.
- VLLM_OMNI_TALKER_COMPILE=vllm (``auto``: beside int8 ``w8-group``) leaves the stage's decoder to
  vLLM's own compilation (the stage settings); this class records it as ``talker.compile``
  (with why ``auto`` left it eager), and with the parity check on the
  reference forward runs the decoder eager (``talker_parity.eager_decoder``).
- VLLM_OMNI_CPU_FAST_SAMPLER (CPU only): ``prefer_model_sampler = True`` and ``sample()`` uses
  ``omni_cpu_fastpath.qwen3_tts.sampler.CpuSampler`` (no torch.compile) for codebook 0.

Either one that cannot be built (module missing, construction error) is logged with the reason
and the stock component serves. What serves each piece (``served``: predictor, its int8 scheme
and compiled buckets, parity, sampler), fallback reasons included, is logged in one line at load
and recorded with ``step_stats.served``. Forward, sampling and the talker MTP step are timed into
step_stats (``model.forward_ms``, ``model.sample_ms``, ``model.talker_mtp_ms``).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn
from vllm_omni.model_executor.models.qwen3_tts.qwen3_tts_talker import Qwen3TTSTalkerForConditionalGeneration

from omni_cpu_fastpath import envs, step_stats
from omni_cpu_fastpath.errors import describe

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it


def _load_module(module: str) -> tuple[Any, str | None]:
    """The module, or (None, why not)."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # a broken install, or a bug at import time
        return None, f"{module} unavailable ({describe(exc)})"


def _load(module: str, name: str) -> tuple[Any, str | None]:
    """``module.name`` or (None, why not)."""
    mod, why = _load_module(module)
    if mod is None:
        return None, why
    try:
        return getattr(mod, name), None
    except AttributeError as exc:
        return None, f"{module}.{name} unavailable ({exc})"


class ServedPredictorBuild(NamedTuple):
    predictor: nn.Module
    checker: Any  # parity.ParityChecker with VLLM_OMNI_PREDICTOR_PARITY_CHECK=1, else None
    served: dict[str, str]  # component -> what serves it, fallback reasons included


def build_served_predictor(stock: nn.Module, max_batch: int, on_cpu: bool = True) -> ServedPredictorBuild:
    """The predictor the talker serves, built from the flags as the talker builds it at load.

    The cached predictor (not compiled yet), then int8 and the parity copy, then, with
    VLLM_OMNI_PREDICTOR_COMPILE=step, one compile per bucket the runner can reach
    (``buckets_for(max_batch)``): compiling last compiles each bucket once, around the weights
    that will serve. Whatever cannot be built is logged and the stock part serves, with the reason
    in ``served``.
    """
    served: dict[str, str] = {}
    predictor, cached = stock, None
    if not envs.get("VLLM_OMNI_PREDICTOR_INCREMENTAL"):
        served["predictor"] = "stock (VLLM_OMNI_PREDICTOR_INCREMENTAL off)"
    else:
        module, why = _load_module("omni_cpu_fastpath.qwen3_tts.predictor")
        if module is not None:
            try:
                cached = module.CachedCodePredictor.from_stock(
                    stock, buckets=module.buckets_for(max_batch), warmup=False
                )
            except Exception as exc:
                why = f"CachedCodePredictor.from_stock failed ({describe(exc)})"
                logger.exception("omni-cpu-fastpath: %s", why)
        if cached is not None:
            predictor = cached
            served["predictor"] = "cached"
        else:
            logger.warning("omni-cpu-fastpath: %s; keeping the stock code predictor", why)
            served["predictor"] = f"stock ({why})"
    checker = None
    if on_cpu:
        from omni_cpu_fastpath import cpu_gemv
        from omni_cpu_fastpath.qwen3_tts import quant

        # A refused flag combination raises here, at load; a missing kernel keeps float weights.
        predictor, checker, served["predictor.int8"] = quant.prepare_served_predictor(predictor)
        int8_layers = (quant.Int8Linear, quant.Int8StackedHeads)
        if any(isinstance(m, int8_layers) for m in predictor.modules()):
            served["predictor.int8.product"] = cpu_gemv.status()
        if checker is not None:
            checker.candidate = predictor
            served["predictor.parity"] = "on (teacher-forced fp32 copy)"
    else:
        served["predictor.int8"] = "off (not on CPU)"
    if cached is None:
        served["predictor.compile"] = "off (stock predictor)"
    else:
        if cached.compile_mode == "step":
            cached.warmup()  # on failure it runs eager, and its status says why
        served["predictor.compile"] = cached.compile_status
    return ServedPredictorBuild(predictor, checker, served)


def _attends() -> bool:
    """Whether this forward has attention metadata. vLLM's profile and compile warm-up runs have
    none (attention leaves its output unwritten): nothing there for the parity check to compare."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    return is_forward_context_available() and get_forward_context().attn_metadata is not None


def compile_status(vllm_config: Any) -> str:
    """How vLLM compiles the talker's decoder, for ``step_stats.served`` (``talker.compile``)."""
    config = vllm_config.compilation_config
    mode = getattr(config.mode, "name", config.mode)
    return f"vllm ({mode}, backend {config.backend}: one graph for every batch size, compiled at load)"


def eager_status() -> str:
    """``talker.compile`` of an eager talker, with why ``auto`` left it eager."""
    if envs.get("VLLM_OMNI_TALKER_COMPILE") != "auto":
        return "off (eager)"
    return (
        "off (eager; VLLM_OMNI_TALKER_COMPILE=auto compiles beside talker int8 w8-group, "
        "or vLLM's bf16 linears on a CPU with AMX, only)"
    )


class FastQwen3TTSTalker(Qwen3TTSTalkerForConditionalGeneration):
    """The stock talker plus the KV-cached predictor and the compile-free sampler."""

    # Tells the CPU AR runner that forward, talker MTP and sampling are timed here.
    records_step_timers = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        envs.validate_all()
        # Fails here, at start-up, when VLLM_OMNI_STEP_STATS_DIR is not writable.
        step_stats.configure()
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # The stock talker builds its input embeddings in bf16 whatever the model's dtype, which
        # stops a float32 talker (--dtype float32) at its first step (index_copy_ of bf16 rows
        # into float32 embeddings). In the model's dtype they fit, and bf16 is unchanged.
        self._embedding_dtype = vllm_config.model_config.dtype
        self._on_cpu = torch.device(vllm_config.device_config.device).type == "cpu"
        # The largest batch the runner can hand the predictor: its compiled buckets stop there.
        self._max_batch = int(vllm_config.scheduler_config.max_num_seqs)
        self._predictor_built = False
        # (threads_now, counts) from the runner for the predictor's sub-steps; see follow_threads().
        self._thread_source: tuple[Callable[[], int], tuple[int, ...]] | None = None
        self._parity: Any = None  # parity.ParityChecker when VLLM_OMNI_PREDICTOR_PARITY_CHECK is on
        # talker_parity.TalkerParityChecker when VLLM_OMNI_TALKER_PARITY_CHECK is on with talker int8
        self._talker_parity: Any = None
        self._int8_gains = False  # whether load_weights hands the int8 linears their RMSNorm gains
        # component -> what serves it ("cached", "CpuSampler (C kernel)", "stock (why)", ...)
        self.served: dict[str, str] = {}
        self._model_sampler: nn.Module | None = None
        self._sampler_times_itself = False
        self._init_sampler(vllm_config)
        self._init_decoder(vllm_config)

    def _init_decoder(self, vllm_config: Any) -> None:
        # The decoder linears were given their quantization method while the layers were built,
        # and vLLM's compile wrapper of the decoder was set up from the stage's compilation config.
        quant_config = vllm_config.quant_config
        parity = envs.get("VLLM_OMNI_TALKER_PARITY_CHECK")
        from omni_cpu_fastpath.qwen3_tts.quant import talker_fp32_prefill

        dtype = vllm_config.model_config.dtype
        self._serve("talker.prefill", talker_fp32_prefill.served_status(self, quant_config, dtype))
        compiled = not getattr(self.model, "do_not_compile", True)
        self._serve("talker.compile", compile_status(vllm_config) if compiled else eager_status())
        if isinstance(quant_config, talker_fp32_prefill.TalkerFp32PrefillConfig):
            quant_config = None  # no int8: its decoder linears are float
        from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import TalkerW8Config, served_status

        if quant_config is None:
            self._serve("talker.int8", "off")
        else:
            self._serve("talker.int8", served_status(self, quant_config))
            self._int8_gains = isinstance(quant_config, TalkerW8Config) and quant_config.float_columns
        if not parity:
            return
        references = []
        if compiled:
            references.append("the decoder eager")
        if isinstance(quant_config, TalkerW8Config):
            references.append("the int8 layers' float weights")
        if not references:
            why = "nothing to compare: talker int8 off and the decoder eager"
            if quant_config is not None:
                why = f"{quant_config.get_name()} quantization"
            self._serve("talker.parity", f"off ({why})")
            return
        from omni_cpu_fastpath.qwen3_tts.talker_parity import TalkerParityChecker

        self._talker_parity = TalkerParityChecker(self)
        self._serve("talker.parity", f"on ({' with '.join(references)}, same inputs, before each forward)")

    def _serve(self, component: str, detail: str) -> None:
        self.served[component] = detail
        step_stats.served(component, detail)

    # --- sampler -------------------------------------------------------------------------------

    def _init_sampler(self, vllm_config: Any) -> None:
        if not envs.get("VLLM_OMNI_CPU_FAST_SAMPLER"):
            self._serve("sampler", "vLLM Sampler (VLLM_OMNI_CPU_FAST_SAMPLER off)")
            return
        if not self._on_cpu:
            self._serve("sampler", "vLLM Sampler (not on CPU)")
            return
        model_config = vllm_config.model_config
        cls, why = _load("omni_cpu_fastpath.qwen3_tts.sampler", "CpuSampler")
        sampler: nn.Module | None = None
        if cls is not None:
            try:
                sampler = cls(
                    logprobs_mode=model_config.logprobs_mode,
                    use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False),
                )
            except Exception as exc:
                why = f"CpuSampler could not be built ({describe(exc)})"
        if sampler is not None:
            # CpuSampler times its whole call as model.sample_ms itself.
            self._sampler_times_itself = True
            self._serve("sampler", f"CpuSampler ({sampler.kernel_status})")
        else:
            # Keep the model-sampler hook (so the step is timed) with vLLM's own Sampler inside:
            # the same tokens as the runner's default path.
            from vllm.v1.sample.sampler import Sampler

            logger.warning("omni-cpu-fastpath: %s; sampling with vLLM's Sampler", why)
            sampler = Sampler(
                logprobs_mode=model_config.logprobs_mode,
                use_fp64_gumbel=getattr(model_config, "use_fp64_gumbel", False),
            )
            self._serve("sampler", f"vLLM Sampler ({why})")
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
        if self._int8_gains:
            # Before vLLM's process_weights_after_loading quantizes the decoder linears: w8-channel
            # keeps the input columns the RMSNorm gains inflate, a function of the checkpoint only.
            from omni_cpu_fastpath.qwen3_tts.quant.talker_int8 import hand_input_gains

            hand_input_gains(self)
        self._build_predictor()
        return loaded

    def _build_predictor(self) -> None:
        if self._predictor_built:
            return
        self._predictor_built = True
        built = build_served_predictor(self.code_predictor, self._max_batch, on_cpu=self._on_cpu)
        self.code_predictor, self._parity = built.predictor, built.checker
        for component, detail in built.served.items():
            self._serve(component, detail)
        if self._thread_source is not None:
            self.follow_threads(*self._thread_source)
        logger.info(
            "omni-cpu-fastpath: FastQwen3TTSTalker serves: %s",
            "; ".join(f"{k}: {v}" for k, v in self.served.items()),
        )

    def follow_threads(self, threads_now: Callable[[], int], counts: Sequence[int]) -> None:
        """Each sub-step of the code predictor runs at ``threads_now()`` torch threads, one of
        ``counts`` (the runner's step-down while code2wav decodes on the same cores), where the
        predictor can; ``predictor.threads`` in ``served`` says which."""
        self._thread_source = (threads_now, tuple(sorted(set(counts))))
        if not self._predictor_built:
            return  # applied once the predictor is built
        follow = getattr(self.code_predictor, "follow_threads", None)
        listed = ", ".join(str(n) for n in self._thread_source[1])
        if follow is None:
            self._serve("predictor.threads", "the engine step's count (stock predictor)")
        elif why := follow(threads_now, self._thread_source[1]):
            self._serve("predictor.threads", f"the engine step's count ({why})")
        else:
            self._serve("predictor.threads", f"each sub-step at the runner's count ({listed})")

    # --- timed entry points --------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._talker_parity is not None and _attends():
            return self._talker_parity.run(super().forward, *args, timer=step_stats.MODEL_FORWARD, **kwargs)
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
        if not self._predictor_built:
            self._build_predictor()
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
