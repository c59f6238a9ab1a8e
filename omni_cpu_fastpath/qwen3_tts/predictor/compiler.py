"""Compile policy of the predictor's static sub-step, kept apart from the model.

One compiled step per batch bucket, each built and warmed once at load; a batch is padded up to
the next bucket and one above the largest runs eager. Where every linear of the layers multiplies
through the package's few-row kernel (int8 layers), the graph calls it as an op on unfrozen
weights, and the buckets above 1 share one graph with a dynamic batch dimension: a warm start then
loads both graphs from AOTAutograd's and Inductor's caches and only traces. Otherwise Inductor's
GEMM templates run on frozen weights, per bucket. Here: which buckets a runner can reach, the
Inductor options each bucket tries in order, the global state every compiled call runs under, a
fresh code object per compile (so one predictor's frozen weights never serve another), the
thread cap, and what happens when a bucket fails (at load: next options, then eager; at a
request: that bucket is dropped and the status says why).
"""

from __future__ import annotations

import contextlib
import logging
import time
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.cpu_threads import set_torch_threads
from omni_cpu_fastpath.errors import describe

from . import compile_cache

if TYPE_CHECKING:
    from .model import CachedCodePredictor

logger = logging.getLogger(f"vllm.{__name__}")  # under "vllm" so a server's log shows it

# Batch sizes compiled at load with VLLM_OMNI_PREDICTOR_COMPILE=step; a batch is padded up to the
# next bucket, and one above the largest runs eager. A server compiles buckets_for(max_num_seqs).
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8)


def buckets_for(max_batch: int) -> tuple[int, ...]:
    """The buckets a runner of at most ``max_batch`` rows can reach: powers of two below it, and it."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    return tuple(sorted({1 << i for i in range(max_batch.bit_length()) if 1 << i <= max_batch} | {max_batch}))


@contextlib.contextmanager
def compiled_call_state() -> Iterator[None]:
    """The global state every compiled call runs under, at warm-up and when serving.

    Dynamo guards on global state such as the default dtype, and vLLM loads weights (when the
    served predictor compiles) under ``set_default_torch_dtype(model dtype)``: without this, a
    bf16 model compiled at load would miss its guards at the first request and recompile there,
    outside the warm-up's Inductor settings.
    """
    prev = torch.get_default_dtype()
    if prev is not torch.float32:
        torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        if prev is not torch.float32:
            torch.set_default_dtype(prev)


@contextlib.contextmanager
def cache_key_state() -> Iterator[None]:
    """Global settings that AOTAutograd's and Inductor's cache keys hold, set for each compile as
    a vLLM CPU worker has them: fp32 matmul precision "highest" (the worker sets it) and kernels
    that read the thread count at run time (vLLM's CPU platform turns ``cpp.dynamic_threads`` on).
    A compile outside a server (``omni-cpu-fastpath warmup``) then fills the entries a server
    looks up, and a compiled step follows torch's thread count."""
    import torch._inductor.config

    matmul = torch.backends.cuda.matmul
    prev = matmul.fp32_precision
    matmul.fp32_precision = "ieee"
    try:
        with torch._inductor.config.patch({"cpp.dynamic_threads": True}):
            yield
    finally:
        matmul.fp32_precision = prev


# Inductor settings that make batch-1 GEMV read weights near the bandwidth floor on CPU: freezing
# folds the weights into the graph so the CPP GEMM templates can pre-pack them.
INDUCTOR_OPTIONS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
    "epilogue_fusion": False,  # as the stock predictor: keeps RMSNorm/RoPE fp32 math unfused
}

# Inductor settings where the linears call the few-row kernel: nothing for freezing to pre-pack, and
# unfrozen weights are graph inputs, which keeps AOTAutograd's cache (bypassed under freezing).
# Inductor's own loops run on one thread: at decode batches they are elementwise work and sums
# over a few hidden vectors, where a parallel region costs more than it saves, and a sum split
# across threads would round by the thread count. The kernel and ATen's ops sum each output
# whole on one thread, so the step gives the same bits at any torch thread count, and the graph
# compiled at one count serves the others (see StepCompiler.trace_at).
KERNEL_GRAPH_OPTIONS: dict[str, Any] = {
    "freezing": False,
    "epilogue_fusion": False,
    "cpp.threads": 1,
    "cpp.dynamic_threads": False,
}


def bucket_compile_options(options: dict[str, Any], bucket: int) -> list[dict[str, Any]]:
    """The Inductor options to try, in order, for one batch bucket.

    Batch 1 is matrix-vector work: there the CPP template alone reads near the bandwidth floor,
    and autotuning against ATen only adds noise (it times in-cache weights on a shared box and the
    on-disk cache keeps a bad pick), so it goes first with ATen as the fallback. From 2 rows up
    ATen's kernels can win (``_weight_int8pack_mm`` on int8 weights), so those buckets autotune as
    ``options`` say.
    """
    if bucket == 1 and options.get("max_autotune_gemm_backends") == "CPP,ATEN":
        return [{**options, "max_autotune_gemm_backends": "CPP"}, dict(options)]
    return [dict(options)]


class StepCompiler:
    """The compiled sub-steps of one :class:`CachedCodePredictor`, per batch bucket.

    ``steps`` maps a bucket to its compiled step (None: nothing compiled); ``status`` says what
    runs the step and why, and is what the talker reports as served. ``options`` None: the
    kernel graph where the predictor's linears run the few-row kernel, else ``INDUCTOR_OPTIONS``.
    """

    def __init__(
        self,
        predictor: CachedCodePredictor,
        *,
        mode: str,
        threads: int,
        buckets: Sequence[int],
        options: dict[str, Any] | None = None,
    ) -> None:
        if mode not in ("off", "step"):
            raise ValueError(f"compile must be 'off' or 'step', got {mode!r}")
        if threads < 0:
            raise ValueError(f"threads must be >= 0 (0: no cap), got {threads}")
        if not buckets or any(int(b) < 1 for b in buckets):
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.predictor = predictor
        self.mode = mode
        self.threads = int(threads)
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.options = None if options is None else dict(options)
        self.kernel_graph = False  # the last warmup() compiled around the few-row kernel
        self.steps: dict[int, Any] | None = None
        self.warming = False  # inside warmup(): failures propagate
        self.may_compile = False  # inside warmup(), where a call may compile
        self.seconds: float | None = None
        self.counts: dict[int, int] = {}  # how many times each bucket was compiled
        self.failed: dict[int, str] = {}  # bucket -> why its compiled step was dropped
        self.cache_dir: str | None = None  # Inductor's cache folder at the last warmup()
        self.cache_hits = 0  # FX graph cache hits and misses of the last warmup()
        self.cache_misses = 0
        self.status = "off" if mode == "off" else "step (not compiled yet)"
        self._generation = 0
        # torch's thread counts the steps were traced at, the warm-up's first (empty: none yet);
        # see calling() and trace_at().
        self.thread_counts: tuple[int, ...] = ()
        self.follow_counts: tuple[int, ...] = ()  # what trace_at() was asked for, kept across warm-ups

    def thread_cap(self) -> ThreadCap:
        return ThreadCap(self.threads)

    def runs_at(self, threads: int) -> bool:
        """Whether a call at ``threads`` torch threads runs the steps as they are (eager: any count)."""
        return self.steps is None or threads in self.thread_counts

    def bucket_for(self, rows: int) -> int:
        """The compiled bucket that serves ``rows`` rows, or 0 (eager)."""
        return next((b for b in sorted(self.steps or ()) if b >= rows), 0)

    @contextlib.contextmanager
    def calling(self) -> Iterator[None]:
        """The state a compiled call runs under; past warm-up, a call that would compile fails.

        Dynamo guards on torch's thread count, so a call under a count the steps were not traced
        at (the talker's step-down while code2wav decodes) would fail its guards: it runs at the
        warm-up's count, restored after.
        """
        stance = "default" if self.may_compile else "fail_on_recompile"
        threads = torch.get_num_threads()
        if threads not in self.thread_counts:
            threads = self.thread_counts[0] if self.thread_counts else 0
        with ThreadCap(threads), compiled_call_state(), torch.compiler.set_stance(stance):
            yield

    def trace_at(self, counts: Iterable[int]) -> str | None:
        """Make a call at each of ``counts`` torch threads run compiled, as at the warm-up's count;
        None when it does (or the step runs eager, at any count), else why not.

        Only the kernel graph: its arithmetic does not depend on the count (``KERNEL_GRAPH_OPTIONS``),
        so each further count is one Dynamo trace that loads what Inductor compiled at the first.
        Inductor's GEMM templates on frozen weights would compile anew per count and split their
        sums by it. Kept across later warm-ups (new weights).
        """
        counts = tuple(sorted({int(n) for n in counts}))
        if any(n < 1 for n in counts):
            raise ValueError(f"thread counts must be >= 1, got {counts}")
        if self.threads:
            return f"VLLM_OMNI_PREDICTOR_THREADS caps it at {self.threads}"
        if self.steps is None:
            self.follow_counts = counts
            return None
        if not self.kernel_graph:
            return "its compiled GEMMs on frozen weights are built for one thread count"
        self.follow_counts = counts
        self.warming = self.may_compile = True
        try:
            with compile_cache.using_cache_dir(compile_cache.cache_dir()), cache_key_state():
                for n in counts:
                    if n in self.thread_counts:
                        continue
                    self.thread_counts += (n,)
                    with ThreadCap(n):
                        for bucket in sorted(self.steps):
                            self.predictor.warm(bucket)
        except Exception as exc:  # noqa: BLE001 - the steps stay compiled at the counts that worked
            self.thread_counts = self.thread_counts[:-1]
            self.follow_counts = ()
            logger.warning("code predictor: tracing the compiled step at %d threads failed: %r", n, exc)
            return f"tracing the compiled step at {n} threads failed: {describe(exc)}"
        finally:
            self.warming = self.may_compile = False
        return None

    def invalidate(self, recompile: bool) -> None:
        """The weights changed: compiled steps froze the old ones, so drop them (and rebuild)."""
        if self.steps is not None:
            self.steps = None
            if recompile and self.mode == "step":
                self.warmup()

    def warmup(self) -> bool:
        """Compile the step for every bucket (prefill and sub-step shapes); False if it fell back.

        Each bucket gets its own compiled step and options (:func:`bucket_compile_options`); a
        bucket whose first options fail is retried with the next before the whole step falls back
        to eager. After this, a call that would compile again fails instead (and that bucket runs
        eager, with the reason in ``status``): every shape is compiled here, never first at a
        request.
        """
        from torch._dynamo.utils import counters

        t0 = time.perf_counter()
        compiled: dict[int, Any] = {}
        self.kernel_graph = self.options is None and self.predictor.linears_run_kernel()
        options = KERNEL_GRAPH_OPTIONS if self.kernel_graph else self.options or INDUCTOR_OPTIONS
        # Keyed on the weights where they are frozen, computed once for every bucket.
        cache = compile_cache.cache_options(self.predictor, frozen=bool(options.get("freezing")))
        path = compile_cache.cache_dir()
        self.cache_dir = str(path) if cache.get("fx_graph_cache") else None
        hits, misses = counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]
        with compile_cache.using_cache_dir(path):
            if self.kernel_graph:
                ok = self._compile_kernel_graph(compiled, {**options, **cache})
            else:
                ok = self._compile_buckets(compiled, options, cache)
        self.cache_hits = counters["inductor"]["fxgraph_cache_hit"] - hits
        self.cache_misses = counters["inductor"]["fxgraph_cache_miss"] - misses
        if not ok:
            return False
        self.steps = compiled
        if self.follow_counts:
            self.trace_at(self.follow_counts)  # on failure it warns; calls then run at the first count
        self.seconds = time.perf_counter() - t0
        how = "few-row kernel in the graph" if self.kernel_graph else "GEMM templates on frozen weights"
        self._set_status(
            f"step (buckets {_csv_ints(self.buckets)}, compiled at load in {self.seconds:.1f} s; {how})"
        )
        logger.info(
            "code predictor: compiled the static step for batch buckets %s in %.1f s "
            "(compile cache %s: %d graphs loaded, %d compiled)",
            self.buckets,
            self.seconds,
            self.cache_dir or "off",
            self.cache_hits,
            self.cache_misses,
        )
        return True

    def _compile_kernel_graph(self, compiled: dict[int, Any], options: dict[str, Any]) -> bool:
        """Bucket 1 in a graph of its own; the buckets above it in one graph whose batch dimension
        is dynamic between the smallest and the largest of them."""
        batched = [b for b in self.buckets if b > 1]
        try:
            if 1 in self.buckets:
                compiled[1] = self._compile_bucket(1, options)
            if len(batched) == 1:
                compiled[batched[0]] = self._compile_bucket(batched[0], options)
            elif batched:
                key = compile_cache.BatchRangeKey(batched[0], batched[-1])
                ranged = {**options, "post_grad_custom_post_pass": key}
                step = self._compile_bucket(batched[0], ranged, up_to=batched[-1])
                compiled.update((b, step) for b in batched)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: run eager, say why
            return self._eager_after(exc)
        return True

    def _compile_buckets(
        self, compiled: dict[int, Any], options: dict[str, Any], cache: dict[str, Any]
    ) -> bool:
        for b in self.buckets:
            attempts = [{**o, **cache} for o in bucket_compile_options(options, b)]
            for i, options in enumerate(attempts):
                try:
                    compiled[b] = self._compile_bucket(b, options)
                    break
                except Exception as exc:  # noqa: BLE001 - any compiler failure: retry or run eager
                    if i + 1 < len(attempts):  # (_compile_bucket has already dropped its step)
                        logger.warning(
                            "code predictor: compiling bucket %d with GEMM backends %s failed (%r); "
                            "retrying with %s",
                            b,
                            options.get("max_autotune_gemm_backends"),
                            exc,
                            attempts[i + 1].get("max_autotune_gemm_backends"),
                        )
                        continue
                    return self._eager_after(exc)
        return True

    def _eager_after(self, exc: Exception) -> bool:
        """Compiling failed at load: the step runs eager from now on, and the status says why."""
        logger.warning("code predictor: torch.compile of the step failed, running eager: %r", exc)
        self.mode = "off"
        self._set_status(f"eager (torch.compile failed at load: {describe(exc)})")
        return False

    def drop(self, bucket: int, exc: Exception) -> None:
        """A compiled bucket failed at run time: batches pad to the next compiled bucket from now
        on (eager above the last one, or when none is left), and the status says why."""
        assert self.steps is not None
        del self.steps[bucket]
        why = f"the compiled step failed at run time: {describe(exc)}"
        self.failed.setdefault(bucket, why)
        logger.warning("code predictor: bucket %d dropped: %s", bucket, why)
        dropped = _csv_ints(sorted(self.failed))
        first = next(iter(self.failed.values()))
        left = sorted(self.steps)
        if left:
            self._set_status(f"step (buckets {_csv_ints(left)}; dropped {dropped}: {first})")
        else:
            self.steps = None
            self.mode = "off"
            self._set_status(f"eager (dropped buckets {dropped}: {first})")

    def _set_status(self, status: str) -> None:
        self.status = status
        step_stats.served("predictor.compile", status)

    def _fresh_compiled(self, options: dict[str, Any]) -> Any:
        # Compile an nn.Module (not a bound method): only then are the weights module parameters
        # that Inductor's freezing folds into constants, which its CPP GEMM templates need.
        # Dynamo caches graphs on the forward's code object; a distinct code object per instance and
        # refresh gives each its own cache, so frozen (stale) weights of another instance never match.
        self._generation += 1
        name = f"_CompiledStep_{id(self):x}_{self._generation}"
        base = StepModule.forward
        forward = types.FunctionType(base.__code__.replace(co_name=name), base.__globals__, name)
        module = type(name, (StepModule,), {"forward": forward})(self.predictor)
        # No guards on the modules' parameters and attributes, only on the call's inputs and global
        # state: checking the modules' dozens of tensors cost more per sub-step than its small ops.
        # Safe here because the modules never change under a compiled step: new weights or layers
        # go through invalidate(), which compiles a fresh code object.
        options = {**options, "guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        compiled = torch.compile(module, fullgraph=True, dynamic=False, options=options)
        # A bound method, not the module: assigning a module would register it as our child.
        return compiled.__call__

    def _compile_bucket(self, bucket: int, options: dict[str, Any], up_to: int | None = None) -> Any:
        """A step compiled with ``options`` and warmed on ``bucket`` rows (prefill and sub-step);
        with ``up_to``, one graph for every batch of ``bucket`` to ``up_to`` rows, also run on
        ``up_to`` rows, where a call that would compile again fails."""
        import torch._inductor.config  # noqa: F401 - torch.compile imports it lazily

        step = self._fresh_compiled(options)
        if up_to is not None:
            step = self._dynamic_batch(step, bucket, up_to)
        for b in self.buckets:
            if bucket <= b <= (up_to or bucket):
                self.counts[b] = self.counts.get(b, 0) + 1
        self.steps = {bucket: step, up_to or bucket: step}  # forward_cached pads to these, calls it
        self.warming = self.may_compile = True
        # Inductor reads ``freezing`` outside the per-compile ``options`` scope, so it is set here,
        # around the calls that compile (all of them happen in this warm-up).
        try:
            with (
                torch._inductor.config.patch(freezing=bool(options.get("freezing", False))),
                cache_key_state(),
                self.thread_cap(),
            ):
                self.thread_counts = (torch.get_num_threads(),)
                self.predictor.warm(bucket)
                self.may_compile = False
                if up_to is not None:
                    self.predictor.warm(up_to)
        finally:
            self.warming = self.may_compile = False
            self.steps = None
        return step

    def _dynamic_batch(self, step: Any, lo: int, hi: int) -> Any:
        """``step`` with the batch dimension of its batched arguments (``substep``'s ``x``, ``caches``
        and ``u``) marked dynamic in ``[lo, hi]`` while warming, so that one graph serves them all."""

        def call(*args: Any) -> Any:
            if self.warming:
                x, _pos, _mask, caches, _head, u = args[:6]
                for t in (x, u, *caches):
                    torch._dynamo.mark_dynamic(t, 0, min=lo, max=hi)
            return step(*args)

        return call


def _csv_ints(values: Iterable[int]) -> str:
    return ",".join(str(v) for v in values)


class StepModule(nn.Module):
    """The unit handed to torch.compile: one sub-step of ``pred`` (see ``_fresh_compiled``)."""

    def __init__(self, pred: CachedCodePredictor) -> None:
        super().__init__()
        self.pred = pred

    def forward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.pred.substep(*args)


class ThreadCap:
    """Caps torch's intra-op threads for the duration of a predictor call, then restores them."""

    __slots__ = ("n", "prev")

    def __init__(self, n: int) -> None:
        self.n = n
        self.prev = 0

    def __enter__(self) -> ThreadCap:
        if self.n:
            self.prev = torch.get_num_threads()
            if self.n != self.prev:
                set_torch_threads(self.n)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n and self.prev and self.prev != torch.get_num_threads():
            set_torch_threads(self.prev)
