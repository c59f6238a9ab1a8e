"""CPU workers and model runners for vllm-omni stages.

Each class combines vllm-omni's omni layer with vLLM's CPU layer through the MRO, without
copying either:

- runners: ``GPUARModelRunner`` / ``GPUGenerationModelRunner`` (omni hooks: talker MTP,
  inter-stage connectors, multimodal outputs) first, then vLLM's ``CPUModelRunner`` (CPU tensors
  in place of device buffers, no CUDA events or graphs), then vLLM's ``GPUModelRunner``. The omni
  ``load_model`` / ``_to_list`` call ``super()`` and so reach the CPU versions.
- workers: ``OmniWorkerMixin`` (loads the ``vllm_omni.general_plugins`` group in the worker
  process) on vLLM's ``CPUWorker`` (CPU memory accounting, gloo, OpenMP binding done by the
  multiprocessing executor, or by the stage's environment where the model runs in the stage's
  engine process: ``serving/executor.py``), with the runner swapped for the omni one.

Model Runner V2 needs Triton GPU kernels, so these workers run the V1 runners; a stage whose
deploy config asks for ``model_runner: v2`` is refused at start with the reason (the scheduler
and the runner must agree on the data plane). ``omni_cpu_fastpath.serving.plugins`` points Qwen3-TTS at a
deploy config that selects V1 on CPU.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

from omni_cpu_fastpath import cpu_threads, envs, step_stats

from . import core_sharing, executor

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

ENGINE_GAP = step_stats.ENGINE_GAP


class CpuOmniRunnerError(RuntimeError):
    """A stage asked for something the CPU runners cannot do."""


class _CpuOmniRunnerMixin:
    """Shared by both CPU omni runners: rebind device buffers, close a step_stats step, say
    which model class serves the stage."""

    def _cpu_omni_post_init(self) -> None:
        # vLLM's CPUModelRunner aliased its device buffers to the host ones inside its __init__;
        # the omni runner made more buffers after that, so alias those too.
        self._postprocess_tensors()  # type: ignore[attr-defined]
        # vLLM's CPU platform empties the CUDA-graph sizes, leaving this None; the omni runner
        # sizes its talker-MTP buffers with max(max_num_reqs, this). No graphs on CPU: 0.
        compilation_config = self.compilation_config  # type: ignore[attr-defined]
        if compilation_config.max_cudagraph_capture_size is None:
            compilation_config.max_cudagraph_capture_size = 0

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        model = self.model  # type: ignore[attr-defined]
        step_stats.served("model", f"{type(model).__module__}.{type(model).__qualname__}")
        # vLLM serves a float32 checkpoint in the platform's 16-bit dtype unless --dtype says otherwise.
        step_stats.served("model.dtype", str(self.model_config.dtype).removeprefix("torch."))  # type: ignore[attr-defined]

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        # Values recorded outside a step (the start-up dummy runs) close into a line of their
        # own, so every later line holds exactly one engine step.
        step_stats.end_step()
        self._start_step(scheduler_output)
        out = super().execute_model(scheduler_output, intermediate_tensors)  # type: ignore[misc]
        if out is not None:
            # An output here means no sample_tokens follows (nothing scheduled, an encoder-only
            # step): the step ends now, or its values would run into the next step's line.
            self._end_step()
        return out

    def _start_step(self, scheduler_output: Any) -> None:
        """Between the previous step's line and this step's model calls (what it records is this step's)."""

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        # execute_model then sample_tokens is one engine step; the step's timers end here.
        try:
            return super().sample_tokens(*args, **kwargs)  # type: ignore[misc]
        finally:
            self._end_step()

    def _end_step(self) -> None:
        step_stats.end_step()


class CPUARModelRunner(_CpuOmniRunnerMixin, GPUARModelRunner, CPUModelRunner):
    """The omni autoregressive runner (talker stage) on vLLM's CPU runner.

    With ``VLLM_OMNI_STEP_STATS_CODES=1`` it writes the codes of every frame of every request
    (codebook 0 and the predictor's residual codes) to the step-stats folder: the runner serves
    the stock talker and the fast one alike, so two servers can be compared code for code.
    """

    _in_talker_mtp = False
    # Step-stats bookkeeping of the engine gap (used only while stats are on):
    _gap_from: float | None = None  # where this step's uncovered time starts; None outside a step
    _covered_s = 0.0  # time inside the model calls of this step
    _ran_forward = False
    _step_tokens = 0  # tokens this step scheduled (its prompts' lengths in a prefill)
    _last_step_end: float | None = None
    _last_step_reqs: frozenset[str] = frozenset()
    _model_times_itself = False
    _threads: core_sharing.ThreadStepper | None = None  # set where code2wav shares the cores

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._cpu_omni_post_init()

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        # FastQwen3TTSTalker times its forward, talker MTP and sampling itself; for any other
        # model (the stock talker) this runner records those timers around the same calls.
        self._model_times_itself = bool(getattr(self.model, "records_step_timers", False))
        if core_sharing.wanted():
            stepper = core_sharing.ThreadStepper(
                core_sharing.BusyFlag(core_sharing.flag_path()),
                wide=core_sharing.BusyFlag(core_sharing.wide_flag_path(), clear=True),
            )
            self._threads = stepper
            step_stats.served(
                "core_sharing",
                f"talker: 1 of {stepper.full} threads while code2wav decodes ({stepper.flag.path}); "
                f"a chunk waits for a step on {stepper.full} to end its forward ({stepper.wide.path})",
            )
            # The code predictor steps down sub-step by sub-step, within an engine step.
            follow = getattr(self.model, "follow_threads", None)
            if follow is not None:
                follow(stepper.threads_now, (1, stepper.full))
        else:
            step_stats.served("core_sharing", f"off ({core_sharing.why_off()})")

    def _fit_threads(self, scheduler_output: Any) -> None:
        # Once per engine step, before vLLM's CPU attention builds its metadata: that metadata
        # holds the thread count, and the attention kernel refuses to run under another one.
        if self._threads is not None:
            scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
            decode_only = all(n <= 1 for n in scheduled.values())
            step_stats.record(step_stats.TALKER_THREADS, float(self._threads.fit(decode_only)))

    # --- engine gap: step wall time outside the model calls --------------------------------------
    # A step's gap runs from the end of the previous step (when this step continues one of its
    # requests; otherwise from this step's start, so idle time between requests is not counted)
    # to the end of this step, minus the time inside talker MTP, forward and sampling: scheduling,
    # output hand-off to the next stage, input preparation, logits and output building.

    def _start_step(self, scheduler_output: Any) -> None:
        self._fit_threads(scheduler_output)
        if not step_stats.enabled():
            return
        now = time.perf_counter()
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        continues = self._last_step_end is not None and any(r in self._last_step_reqs for r in scheduled)
        self._gap_from = self._last_step_end if continues else now
        self._covered_s = 0.0
        self._ran_forward = False
        self._step_tokens = sum(scheduled.values())

    def _end_step(self) -> None:
        if self._threads is not None:  # a step that ran no forward
            self._threads.forward_ended()
        if self._gap_from is not None:
            now = time.perf_counter()
            if self._ran_forward:
                step_stats.record(ENGINE_GAP, (now - self._gap_from - self._covered_s) * 1e3)
                step_stats.record(step_stats.ENGINE_TOKENS, float(self._step_tokens))
            self._gap_from = None
            self._last_step_end = now
            self._last_step_reqs = frozenset(self.input_batch.req_ids)
        step_stats.end_step()

    def _timed_call(self, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # Outside a stats step (stats off, warm-up and profiling runs) the call runs bare.
        if self._gap_from is None:
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - t0
            self._covered_s += elapsed
            if not self._model_times_itself:
                step_stats.record(name, elapsed * 1e3)

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._gap_from is not None:
            self._ran_forward = True
        try:
            return self._timed_call(step_stats.MODEL_FORWARD, super()._model_forward, *args, **kwargs)
        finally:
            if self._threads is not None:
                self._threads.forward_ended()

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        return self._timed_call(step_stats.MODEL_SAMPLE, super()._sample, *args, **kwargs)

    # --- seeded requests whose prompt is prefilled over several steps ---------------------------
    # A step that prefills only part of a prompt still samples a token for that request, and
    # vLLM discards it. vLLM then rewinds the request's generator by moving its Philox offset
    # back, which a CPU generator refuses ("CPU Generator does not use offset"): the talker
    # engine dies. Here the generator state of each such row is saved before sampling and put
    # back in place of vLLM's rewind, which leaves the generator exactly where it was.

    _discarded_rows: dict[int, torch.Tensor] = {}  # batch row -> its generator's state before sampling

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self._discarded_rows = {}
        if self.execute_model_state is not None:  # else this call samples nothing
            generators = self.input_batch.generators
            rows = [int(i) for i in self.discard_request_mask.np[: self.input_batch.num_reqs].nonzero()[0]]
            self._discarded_rows = {i: generators[i].get_state() for i in rows if i in generators}
        return super().sample_tokens(*args, **kwargs)

    def _bookkeeping_sync(self, *args: Any, **kwargs: Any) -> Any:
        generators = self.input_batch.generators
        withheld = {i: generators.pop(i) for i in self._discarded_rows if i in generators}
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            for i, generator in withheld.items():
                generator.set_state(self._discarded_rows[i])
                generators[i] = generator
            self._discarded_rows = {}

    # --- talker MTP ----------------------------------------------------------------------------

    def _talker_mtp_forward(
        self, decode_req_ids: list[str], inputs_embeds: torch.Tensor, start_offsets: list[int] | None = None
    ) -> None:
        # The omni runner calls itself once per row when seeded rows cannot share a batch:
        # time and record once, around the outermost call, when every row's codes are in place.
        outer = not self._in_talker_mtp
        self._in_talker_mtp = True
        try:
            if outer and decode_req_ids:  # a prefill-only step has no MTP work to time
                self._timed_call(
                    step_stats.MODEL_TALKER_MTP,
                    super()._talker_mtp_forward,
                    decode_req_ids,
                    inputs_embeds,
                    start_offsets,
                )
            else:
                super()._talker_mtp_forward(decode_req_ids, inputs_embeds, start_offsets)
        finally:
            if outer:
                self._in_talker_mtp = False
        if outer and step_stats.codes_enabled():
            key, qual = getattr(self.model, "talker_mtp_output_key", ("codes", "audio"))
            for req_id in decode_req_ids:
                codes = self.model_intermediate_buffer.get(req_id, {}).get(key, {}).get(qual)
                if isinstance(codes, torch.Tensor):
                    step_stats.record_codes(req_id, codes.reshape(-1, codes.shape[-1]).tolist())


class CPUGenerationModelRunner(_CpuOmniRunnerMixin, GPUGenerationModelRunner, CPUModelRunner):
    """The omni generation runner (code2wav stage) on vLLM's CPU runner."""

    _empty_steps = 0  # steps that scheduled nothing since the last one that ran something
    _busy: core_sharing.BusyFlag | None = None  # raised while a step with work runs
    _talker_wide: core_sharing.BusyFlag | None = None  # a talker step on all threads, to its forward's end
    _waited_s: float | None = None  # how long this step waited for the talker

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        super().__init__(vllm_config, device)
        self._cpu_omni_post_init()
        if core_sharing.wanted():
            self._busy = core_sharing.BusyFlag(core_sharing.flag_path(), clear=True)
            self._talker_wide = core_sharing.BusyFlag(core_sharing.wide_flag_path())

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)
        if self._busy is not None:
            step_stats.served(
                "core_sharing",
                f"code2wav: raises {self._busy.path} while a step runs, after the forward of a talker "
                f"step on all threads ({core_sharing.wide_flag_path()}, "
                f"at most {core_sharing.WAIT_CAP_S:g} s; not for a request's first chunk)",
            )
        else:
            step_stats.served("core_sharing", f"off ({core_sharing.why_off()})")

    def _start_step(self, scheduler_output: Any) -> None:
        if self._waited_s is not None:  # into this step's line, beside its forward
            step_stats.record(step_stats.CODE2WAV_WAIT, self._waited_s * 1e3)
            self._waited_s = None

    def _end_step(self) -> None:
        if self._busy is not None:
            self._busy.lower()
        super()._end_step()

    def execute_model(self, scheduler_output: Any, intermediate_tensors: Any = None) -> Any:
        if self._busy is not None and scheduler_output.total_num_scheduled_tokens > 0:
            # Lowered when the step ends (_end_step), or here if it fails.
            try:
                # A step of the talker already on all threads runs to the end of its forward
                # first, unless a request's first chunk is here.
                if self._talker_wide is not None and not scheduler_output.scheduled_new_reqs:
                    self._busy.set(core_sharing.WAITING)
                    self._waited_s = core_sharing.wait_while_up(self._talker_wide)
                self._busy.raise_()
                return self._execute_model(scheduler_output, intermediate_tensors)
            except BaseException:
                self._busy.lower()
                raise
        return self._execute_model(scheduler_output, intermediate_tensors)

    def _execute_model(self, scheduler_output: Any, intermediate_tensors: Any) -> Any:
        if step_stats.enabled():
            if scheduler_output.total_num_scheduled_tokens == 0:
                self._empty_steps += 1
            elif self._empty_steps:
                # Counted rather than recorded one by one, so that idle steps write no lines; the
                # count closes into a line of its own as this step starts (stamped with its start).
                step_stats.record(step_stats.ENGINE_EMPTY_STEPS, float(self._empty_steps))
                self._empty_steps = 0
        return super().execute_model(scheduler_output, intermediate_tensors)


class _CpuOmniWorkerMixin:
    model_runner_cls: type

    def init_device(self) -> None:
        envs.validate_all()
        model_config = self.model_config  # type: ignore[attr-defined]
        if getattr(model_config, "use_v2_model_runner", False):
            hint = ""
            if os.environ.get("VLLM_TARGET_DEVICE", "").lower() == "cpu":
                # vLLM then returns its built-in CpuPlatform without asking platform plugins, so
                # omni_cpu_fastpath's vLLM platform never gets to move the stage to V1.
                hint = " VLLM_TARGET_DEVICE=cpu is set: unset it so omni-cpu-fastpath's platform runs."
            raise CpuOmniRunnerError(
                f"stage {getattr(model_config, 'stage_id', '?')} asks for Model Runner V2 "
                "(deploy config `model_runner: v2`), which needs Triton GPU kernels; on CPU set "
                "`model_runner: v1` in the deploy config (omni-cpu-fastpath's CPU deploy config does)." + hint
            )
        # vLLM's CPU init: thread and memory-node checks, gloo process group, seed, and a plain
        # CPUModelRunner, which is replaced by the omni runner right away.
        super().init_device()  # type: ignore[misc]
        self.model_runner = None
        gc.collect()
        self.model_runner = self.model_runner_cls(self.vllm_config, self.device)  # type: ignore[attr-defined]
        # After vLLM bound the threads, in the thread that will run the model.
        blocktime = cpu_threads.apply_blocktime()
        step_stats.served("openmp.blocktime", blocktime)
        step_stats.served("executor", executor.describe(self.vllm_config))  # type: ignore[attr-defined]
        logger.info(
            "omni-cpu-fastpath: %s with %s (torch threads %d, OpenMP blocktime %s)",
            type(self).__name__,
            self.model_runner_cls.__name__,
            torch.get_num_threads(),
            blocktime,
        )


class CPUARWorker(_CpuOmniWorkerMixin, OmniWorkerMixin, CPUWorker):
    """Worker for autoregressive omni stages (e.g. the Qwen3-TTS talker) on CPU."""

    model_runner_cls = CPUARModelRunner


class CPUGenerationWorker(_CpuOmniWorkerMixin, OmniWorkerMixin, CPUWorker):
    """Worker for generation omni stages (e.g. Qwen3-TTS code2wav) on CPU."""

    model_runner_cls = CPUGenerationModelRunner
