"""End to end: the real ``vllm serve MODEL --omni`` server on loopback, on CPU, via the openai client.

One server for the whole module (starting one takes minutes on 2 cores), run the way
``omni-cpu-fastpath serve`` runs it, with the fast path on and step stats recorded. References:
the checkpoint's own config (sample rate, frame rate), the same request repeated, and the
server's own HTTP answers.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
import wave
from io import BytesIO
from pathlib import Path

import pytest

from omni_cpu_fastpath import serving, step_stats

pytestmark = pytest.mark.slow

FRAMES = 16  # talker frames per request: 1.28 s of audio


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("serve")
    env = {
        "VLLM_OMNI_CPU_FASTPATH": "1",
        # The default int8 predictor serves; the parity check runs its fp32 copy beside it.
        "VLLM_OMNI_PREDICTOR_PARITY_CHECK": "1",
        "VLLM_OMNI_STEP_STATS_DIR": str(work / "stats"),
        "XDG_CACHE_HOME": str(work / "cache"),
    }
    srv = serving.start_server(str(tiny_model_dir), work / "server.log", env=env)
    try:
        srv.wait_ready(900)
        yield srv
    finally:
        srv.stop()


def _expected_sample_rate(model: Path) -> int:
    st = json.loads((model / "speech_tokenizer" / "config.json").read_text())
    return int(st.get("output_sample_rate") or st["sample_rate"])


def _samples_per_frame(model: Path) -> int:
    st = json.loads((model / "speech_tokenizer" / "config.json").read_text())
    return int(st.get("decode_upsample_rate") or _expected_sample_rate(model) * 2 // 25)  # 12.5 Hz frames


def _post(server: serving.Server, body: bytes, content_type: str = "application/json") -> tuple[int, str]:
    req = urllib.request.Request(
        server.base_url + "/v1/audio/speech", data=body, headers={"Content-Type": content_type}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read()[:200].decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def test_wav_has_the_model_sample_rate_and_a_plausible_length(server, tiny_model_dir):
    speech = serving.synthesize(server, "Hello from a CPU.", max_frames=FRAMES, seed=1)
    assert speech.sample_rate == _expected_sample_rate(tiny_model_dir)
    with wave.open(BytesIO(speech.wav)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2
        n = w.getnframes()
        pcm = w.readframes(n)
    per_frame = _samples_per_frame(tiny_model_dir)
    # Whole talker frames (80 ms each), at least one, at most the cap.
    assert n % per_frame == 0, (n, per_frame)
    assert 1 <= n // per_frame <= FRAMES
    assert any(pcm), "all-zero audio"


def test_same_seed_same_audio_and_the_seed_matters(server):
    a = serving.synthesize(server, "Determinism, please.", max_frames=FRAMES, seed=1234)
    b = serving.synthesize(server, "Determinism, please.", max_frames=FRAMES, seed=1234)
    c = serving.synthesize(server, "Determinism, please.", max_frames=FRAMES, seed=4321)
    assert a.wav == b.wav
    assert a.wav != c.wav


def test_eight_concurrent_requests_each_get_their_own_audio(server, tiny_model_dir):
    results: dict[int, serving.Speech] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = serving.synthesize(server, f"Request number {i}.", max_frames=FRAMES, seed=100 + i)
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert sorted(results) == list(range(8))
    rate = _expected_sample_rate(tiny_model_dir)
    assert all(s.sample_rate == rate and s.audio_s > 0 for s in results.values())
    # Different texts and seeds: eight different waveforms, none mixed up with another.
    assert len({s.wav for s in results.values()}) == 8
    # A request's audio does not depend on its batch neighbours: the same request alone.
    alone = serving.synthesize(server, "Request number 3.", max_frames=FRAMES, seed=103)
    assert _pcm(alone.wav).shape == _pcm(results[3].wav).shape
    assert _close(_pcm(alone.wav), _pcm(results[3].wav))


def _pcm(data: bytes):
    import numpy as np

    with wave.open(BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2").astype(np.float64)


def _close(a, b) -> bool:
    import numpy as np

    # Batched and single matmuls may differ in the last bits; the sampled codes must not.
    return bool(np.sqrt(np.mean((a - b) ** 2)) <= 0.01 * max(1.0, np.sqrt(np.mean(b**2))))


def test_streaming_request_returns_audio_early(server, tiny_model_dir):
    speech = serving.synthesize_streaming(
        server,
        "Streaming output.",
        max_frames=FRAMES,
        seed=5,
        sample_rate=_expected_sample_rate(tiny_model_dir),
    )
    assert speech.ttfa_s is not None and 0 < speech.ttfa_s <= speech.wall_s
    assert speech.audio_s > 0


@pytest.mark.parametrize(
    "body, what",
    [
        ({"input": "", "voice": "vivian"}, "empty input"),
        ({"input": "Hello.", "voice": "no_such_voice_xyz"}, "unknown voice"),
        ({"input": "Hello.", "voice": "vivian", "max_new_tokens": 10**15}, "absurd max tokens"),
        ({"input": "Hello.", "voice": "vivian", "max_new_tokens": -5}, "negative max tokens"),
        (b"{this is not json", "body that is not JSON"),
    ],
)
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(server, body, what):
    raw = body if isinstance(body, bytes) else json.dumps({"model": server.model, **body}).encode()
    status, message = _post(server, raw)
    assert 400 <= status < 500, f"{what}: HTTP {status}: {message[:500]}"
    assert message.strip(), f"{what}: no message"
    assert server.healthy()
    ok = serving.synthesize(server, "Still here.", max_frames=4, seed=3)
    assert ok.audio_s > 0


def test_served_path_records_the_model_timers(server):
    serving.synthesize(server, "Timers.", max_frames=FRAMES, seed=9)
    stats_dir = Path(server.env["VLLM_OMNI_STEP_STATS_DIR"])
    summary = step_stats.summarize_dir(stats_dir)
    for name in ("model.forward_ms", "model.sample_ms", "model.talker_mtp_ms", "sampler.draw_ms"):
        assert summary.get(name, {}).get("count", 0) > 0, (name, sorted(summary))
    # The talker's first codebook is sampled by CpuSampler's C kernel.
    assert "FastQwen3TTSTalker sampler: fast (C kernel)" in server.log_path.read_text(errors="replace")
    # In-situ parity of the served (int8) predictor against its fp32 copy, 15 values per frame.
    top1, kl = summary["predictor.parity.top1"], summary["predictor.parity.kl"]
    assert top1["count"] >= 15 and top1["count"] % 15 == 0
    assert 0.0 <= top1["mean"] <= 1.0 and top1["max"] <= 1.0
    assert top1["mean"] >= 0.8, "the served int8 predictor disagrees with fp32 on the top-1 code"
    assert 0.0 <= kl["mean"] < 0.1
    assert summary["predictor.parity.max_logit_diff"]["max"] > 0.0  # int8 really serves, not fp32


def test_server_shuts_down_cleanly(server):
    code = server.stop()
    assert code == 0, f"exit code {code}; log tail:\n{server.log_tail()}"
    assert not server.left_behind, "stage processes outlived the server"
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log.split("Shutting down")[-1], server.log_tail(80)
