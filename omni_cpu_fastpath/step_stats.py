"""Per-step timers and counters, written where ``VLLM_OMNI_STEP_STATS_DIR`` points.

Usage::

    from omni_cpu_fastpath import step_stats

    with step_stats.timer("model.forward_ms", sync=True):
        ...

    @step_stats.timed("model.sample_ms")
    def sample(...): ...

    step_stats.record("predictor.parity_top1", 0.97)   # any number
    step_stats.end_step()                              # one JSON line for this step
    step_stats.served("predictor", "cached")           # what serves a component, and why

Off (the variable unset or empty) every entry point returns after one check of a module global, so
the hot path pays a function call and nothing else (``benchmarks/test_step_stats_overhead.py``).
On, each process appends one JSON line per step to ``<dir>/<pid>.jsonl``
(``{"pid", "step", "ts", "values": {name: [v, ...]}}``) and writes ``<dir>/<pid>.summary.json``
(count, mean, p50, p90, max per counter) at exit. The folder is checked when stats are first
configured, so an unwritable folder fails at start-up, not in the middle of serving.

Besides numbers, a process records which implementation serves each component
(:func:`served`: ``<dir>/<pid>.served.json``, rewritten on every change, so a fallback at run
time shows up at once) and, with ``VLLM_OMNI_STEP_STATS_CODES=1``, the codes of every frame of
every request (:func:`record_codes`: ``<dir>/<pid>.codes.jsonl``), so that two servers can be
compared code for code.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, TypeVar

from . import envs

F = TypeVar("F", bound=Callable[..., Any])

# Named timers of the library, for reference (any name may be recorded).
MODEL_FORWARD = "model.forward_ms"
MODEL_SAMPLE = "model.sample_ms"
MODEL_TALKER_MTP = "model.talker_mtp_ms"
PREDICTOR_SUBSTEP = "predictor.substep_ms"
PREDICTOR_LOOP = "predictor.loop_ms"
# Talker step wall time outside talker MTP, forward and sampling (the CPU AR runner).
ENGINE_GAP = "engine.gap_ms"
# Tokens the talker's engine step ran through the model (the CPU AR runner): a prompt's length
# in its prefill step, one per sequence in a decode step.
ENGINE_TOKENS = "engine.scheduled_tokens"
# Torch threads of each talker engine step where code2wav shares the talker's cores
# (serving/core_sharing.py): 1 while stepped down.
TALKER_THREADS = "talker.threads"
# Mean torch threads over the sub-steps of each predictor call that follows the server's count
# (``CachedCodePredictor.follow_threads``).
PREDICTOR_THREADS = "predictor.threads"
# code2wav's decoder forward (``qwen3_tts/code2wav.py``).
CODE2WAV_FORWARD = "code2wav.forward_ms"
# How long a code2wav step with work (other than a request's first chunk) waited for a talker
# step on all threads to end its forward (serving/core_sharing.py).
CODE2WAV_WAIT = "code2wav.wait_talker_ms"
# Engine steps of a stage that scheduled nothing (all its requests waiting for input), counted by
# the CPU generation runner and recorded with the next step that ran something.
ENGINE_EMPTY_STEPS = "engine.empty_steps"


class StepStatsError(RuntimeError):
    """The stats folder cannot be used."""


SERVED_SUFFIX = ".served.json"
CODES_SUFFIX = ".codes.jsonl"


class _Recorder:
    def __init__(self, directory: Path, sync: bool, codes: bool) -> None:
        directory = directory.expanduser()
        self.directory = directory
        self.sync = sync
        self.pid = os.getpid()
        self.step = 0
        self.pending: dict[str, list[float]] = {}
        self.all: dict[str, array] = {}
        self.served: dict[str, str] = {}
        self._codes_fh: Any = None
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.lines_path = directory / f"{self.pid}.jsonl"
            self._fh = open(self.lines_path, "a", buffering=1)  # noqa: SIM115 - closed at exit
            if codes:
                self._codes_fh = open(directory / f"{self.pid}{CODES_SUFFIX}", "a", buffering=1)  # noqa: SIM115
        except OSError as exc:
            raise StepStatsError(
                f"VLLM_OMNI_STEP_STATS_DIR={str(directory)!r} is not a writable folder: {exc}"
            ) from exc

    def set_served(self, component: str, detail: str) -> None:
        if self.served.get(component) == detail:
            return
        self.served[component] = detail
        path = self.directory / f"{self.pid}{SERVED_SUFFIX}"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": self.pid, "served": self.served}, indent=1) + "\n")
        os.replace(tmp, path)

    @property
    def records_codes(self) -> bool:
        return self._codes_fh is not None

    def add_codes(self, request_id: str, codes: list[list[int]]) -> None:
        if self._codes_fh is not None:
            self._codes_fh.write(json.dumps({"request": request_id, "codes": codes}) + "\n")

    def add(self, name: str, value: float) -> None:
        self.pending.setdefault(name, []).append(value)
        self.all.setdefault(name, array("d")).append(value)

    def end_step(self) -> None:
        if not self.pending:
            return
        line = {"pid": self.pid, "step": self.step, "ts": time.time(), "values": self.pending}
        self._fh.write(json.dumps(line) + "\n")
        self.pending = {}
        self.step += 1

    def close(self) -> None:
        self.end_step()
        summary = {name: summarize(values) for name, values in self.all.items()}
        (self.directory / f"{self.pid}.summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self._fh.close()
        if self._codes_fh is not None:
            self._codes_fh.close()


_recorder: _Recorder | None = None
_configured = False


def configure(
    directory: str | os.PathLike[str] | None = None, sync: bool | None = None, codes: bool | None = None
) -> bool:
    """Start (or stop, with no folder) recording. Reads the flags when arguments are None.

    Returns whether stats are on. Raises StepStatsError for an unwritable folder.
    """
    global _recorder, _configured
    if directory is None:
        directory = envs.get("VLLM_OMNI_STEP_STATS_DIR")
    if sync is None:
        sync = envs.get("VLLM_OMNI_STEP_STATS_SYNC")
    if codes is None:
        codes = envs.get("VLLM_OMNI_STEP_STATS_CODES")
    same = (Path(directory).expanduser(), bool(sync), bool(codes)) if directory else None
    if _recorder is not None and same == (_recorder.directory, _recorder.sync, _recorder.records_codes):
        # Unchanged: keep recording into the same files (and what served so far in this process).
        _configured = True
        return True
    if _recorder is not None:
        _recorder.close()
        atexit.unregister(_recorder.close)
        _recorder = None
    if directory:
        _recorder = _Recorder(Path(directory), bool(sync), bool(codes))
        atexit.register(_recorder.close)
    _configured = True
    return _recorder is not None


def _active() -> _Recorder | None:
    if not _configured:
        configure()
    return _recorder


def enabled() -> bool:
    return _active() is not None


def record(name: str, value: float) -> None:
    """Record one value of counter ``name`` for the current step."""
    rec = _recorder if _configured else _active()
    if rec is not None:
        rec.add(name, float(value))


def served(component: str, detail: str) -> None:
    """Record which implementation serves ``component`` in this process (the latest call wins).

    ``detail`` names it and, for a fallback, why (``"stock (CachedCodePredictor failed: ...)"``).
    """
    rec = _recorder if _configured else _active()
    if rec is not None:
        rec.set_served(component, detail)


def codes_enabled() -> bool:
    """Whether :func:`record_codes` writes anything (``VLLM_OMNI_STEP_STATS_CODES``)."""
    rec = _recorder if _configured else _active()
    return rec is not None and rec.records_codes


def record_codes(request_id: str, codes: list[list[int]]) -> None:
    """Append one frame's (or several frames') codes of a request to ``<pid>.codes.jsonl``."""
    rec = _recorder if _configured else _active()
    if rec is not None:
        rec.add_codes(request_id, codes)


def end_step() -> None:
    """Close the current step: its values become one JSON line."""
    rec = _recorder if _configured else _active()
    if rec is not None:
        rec.end_step()


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _Timer(AbstractContextManager):
    __slots__ = ("name", "sync", "rec", "t0")

    def __init__(self, name: str, sync: bool, rec: _Recorder) -> None:
        self.name = name
        self.sync = sync and rec.sync
        self.rec = rec

    def __enter__(self) -> _Timer:
        if self.sync:
            _synchronize()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sync:
            _synchronize()
        self.rec.add(self.name, (time.perf_counter() - self.t0) * 1e3)


class _NullTimer(AbstractContextManager):
    def __exit__(self, *exc: object) -> None:
        return None


_NULL = _NullTimer()


def timer(name: str, sync: bool = False) -> AbstractContextManager:
    """A context manager timing its body into ``name`` (milliseconds).

    ``sync=True`` marks a model timer: with VLLM_OMNI_STEP_STATS_SYNC=1 the accelerator is
    synchronized on entry and exit so the time covers the device work.
    """
    rec = _recorder if _configured else _active()
    if rec is None:
        return _NULL
    return _Timer(name, sync, rec)


def timed(name: str, sync: bool = False) -> Callable[[F], F]:
    """Decorator form of :func:`timer`; the on/off check happens per call."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args: Any, **kwargs: Any) -> Any:
            rec = _recorder if _configured else _active()
            if rec is None:
                return fn(*args, **kwargs)
            with _Timer(name, sync, rec):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def _quantile(sorted_values: list[float], q: float) -> float:
    # Linear interpolation between closest ranks (numpy's default).
    if len(sorted_values) == 1:
        return sorted_values[0]
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """count, mean, p50, p90, max of a counter's values."""
    v = sorted(values)
    if not v:
        return {
            "count": 0,
            "mean": float("nan"),
            "p50": float("nan"),
            "p90": float("nan"),
            "max": float("nan"),
        }
    return {
        "count": len(v),
        "mean": sum(v) / len(v),
        "p50": _quantile(v, 0.5),
        "p90": _quantile(v, 0.9),
        "max": v[-1],
    }


def summarize_dir(
    directory: str | os.PathLike[str], since: float | None = None
) -> dict[str, dict[str, float]]:
    """Summary of every ``*.jsonl`` in a stats folder (all processes pooled), keyed by counter.

    ``since`` (a ``time.time()``): only the steps that ended at or after it, e.g. to leave out a
    server's warm-up requests.
    """
    path = Path(directory)
    if path.is_dir() and not any(f for f in path.glob("*.jsonl") if not f.name.endswith(CODES_SUFFIX)):
        raise StepStatsError(f"{str(path)!r} holds no step-stats files (*.jsonl)")
    pooled: dict[str, list[float]] = {}
    for entry in _entries(path, since):
        for name, vals in entry["values"].items():
            pooled.setdefault(name, []).extend(vals)
    return {name: summarize(vals) for name, vals in sorted(pooled.items())}


# A talker step's own timers: its line's time less their sum is when the step started.
_STEP_PARTS = (MODEL_FORWARD, MODEL_TALKER_MTP, MODEL_SAMPLE, ENGINE_GAP)


def split_by_code2wav(
    directory: str | os.PathLike[str], since: float | None = None
) -> dict[str, dict[str, dict[str, float]]]:
    """The talker's steps that made a frame (``model.talker_mtp_ms``), split by whether a code2wav
    decode ran during them: ``{"alone": {counter: summary}, "beside": {...}}`` for the talker
    forward and talker MTP, so that a stage's served time can be told apart from the cost of the
    two stages meeting on the same cores.

    A step spans its timers and engine gap back from its line's time (lines are written as a step
    ends), a decode its ``code2wav.forward_ms`` back from its line's; ``since`` as for
    :func:`summarize_dir`.
    """
    steps: list[tuple[float, float, dict[str, list[float]]]] = []
    decodes: list[tuple[float, float]] = []
    for entry in _entries(directory, since):
        values, end = entry["values"], float(entry["ts"])
        for ms in values.get(CODE2WAV_FORWARD, []):
            decodes.append((end - ms / 1e3, end))
        if MODEL_TALKER_MTP in values:
            span = sum(sum(values.get(name, [])) for name in _STEP_PARTS) / 1e3
            steps.append((end - span, end, values))
    pooled: dict[str, dict[str, list[float]]] = {"alone": {}, "beside": {}}
    for start, end, values in steps:
        beside = any(d_start < end and start < d_end for d_start, d_end in decodes)
        half = pooled["beside" if beside else "alone"]
        for name in (MODEL_FORWARD, MODEL_TALKER_MTP):
            half.setdefault(name, []).extend(values.get(name, []))
    return {k: {name: summarize(v) for name, v in half.items()} for k, half in pooled.items()}


def prompt_steps(
    directory: str | os.PathLike[str], since: float | None = None
) -> dict[str, dict[str, float]]:
    """The talker's steps that ran prompt rows only (a request's prefill, made no frame), as
    ``{counter: summary}`` for ``model.forward_ms`` and ``engine.scheduled_tokens``: what a
    request's first audio waits for first, and what the talker forward's mean per frame holds
    besides its decode steps. A prompt scheduled beside decode rows shares their step and is not
    counted here. ``since`` as for :func:`summarize_dir`.
    """
    pooled: dict[str, list[float]] = {}
    for entry in _entries(directory, since):
        values = entry["values"]
        if MODEL_FORWARD in values and ENGINE_TOKENS in values and MODEL_TALKER_MTP not in values:
            for name in (MODEL_FORWARD, ENGINE_TOKENS):
                pooled.setdefault(name, []).extend(values[name])
    return {name: summarize(vals) for name, vals in pooled.items()}


def _entries(directory: str | os.PathLike[str], since: float | None) -> Iterator[dict[str, Any]]:
    """Every step line of a stats folder (``since``: ended at or after it)."""
    path = Path(directory)
    if not path.is_dir():
        raise StepStatsError(f"{str(path)!r} is not a folder of step stats")
    for file in sorted(f for f in path.glob("*.jsonl") if not f.name.endswith(CODES_SUFFIX)):
        with open(file) as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    entry = json.loads(line)
                    if not isinstance(entry["values"], dict):
                        raise TypeError("its values are not a mapping")
                    if since is not None and float(entry["ts"]) < since:
                        continue
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise StepStatsError(f"{file}:{lineno}: not a step-stats line ({exc})") from exc
                yield entry


def served_dir(directory: str | os.PathLike[str]) -> dict[str, dict[str, str]]:
    """What served each component, per process of a stats folder: ``{pid: {component: detail}}``."""
    out: dict[str, dict[str, str]] = {}
    for file in sorted(Path(directory).glob(f"*{SERVED_SUFFIX}")):
        try:
            data = json.loads(file.read_text())
            out[str(data["pid"])] = dict(data["served"])
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise StepStatsError(f"{file}: not a served-components file ({exc})") from exc
    return out


def codes_dir(directory: str | os.PathLike[str]) -> dict[str, list[list[int]]]:
    """Every request's codes in a stats folder, frame after frame: ``{request id: [[16 codes], ...]}``."""
    out: dict[str, list[list[int]]] = {}
    for file in sorted(Path(directory).glob(f"*{CODES_SUFFIX}")):
        for lineno, line in enumerate(file.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                out.setdefault(str(entry["request"]), []).extend(entry["codes"])
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise StepStatsError(f"{file}:{lineno}: not a codes line ({exc})") from exc
    return out


def format_served(served: dict[str, dict[str, str]]) -> str:
    rows = []
    for pid, components in served.items():
        rows.append(f"process {pid}:")
        width = max((len(c) for c in components), default=0)
        rows += [f"  {c:<{width}}  {d}" for c, d in components.items()]
    return "\n".join(rows)


def format_table(summary: dict[str, dict[str, float]]) -> str:
    header = f"{'counter':<34} {'count':>8} {'mean':>10} {'p50':>10} {'p90':>10} {'max':>10}"
    rows = [header, "-" * len(header)]
    for name, s in summary.items():
        cells = " ".join(f"{s[k]:>10.3f}" for k in ("mean", "p50", "p90", "max"))
        rows.append(f"{name:<34} {s['count']:>8d} {cells}")
    return "\n".join(rows)
