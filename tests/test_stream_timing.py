"""The speech response timer on a plain ASGI app: what it records, and that it changes nothing.

The served behaviour (a streamed response's first audio sent before the talker's last step) is in
test_serving_e2e.py; here the reference is the ASGI messages the app sent and the pauses it took.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from omni_cpu_fastpath import step_stats
from omni_cpu_fastpath.serving.stream_timing import SpeechResponseTimes

PAUSE_S = 0.05
CHUNKS = [b"", b"first", b"second", b"third"]  # an empty body message is not a chunk


@pytest.fixture(autouse=True)
def _stats_off_after():
    yield
    step_stats.configure(directory="")


async def _streaming_app(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i, chunk in enumerate(CHUNKS):
        await send({"type": "http.response.body", "body": chunk, "more_body": i + 1 < len(CHUNKS)})
        if chunk:
            await asyncio.sleep(PAUSE_S)


def _serve(path: str) -> list[dict]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path}
    asyncio.run(SpeechResponseTimes(_streaming_app)(scope, receive, send))
    return sent


def _lines(directory: Path) -> list[dict]:
    return [json.loads(x) for f in directory.glob("*.jsonl") for x in f.read_text().splitlines()]


def test_a_streamed_speech_response_is_one_line(tmp_path: Path) -> None:
    assert step_stats.configure(directory=tmp_path)
    sent = _serve("/v1/audio/speech")
    assert [m.get("body") for m in sent[1:]] == CHUNKS  # passed through as sent
    step_stats.configure(directory="")  # flush
    (line,) = _lines(tmp_path)
    values = {k: v for k, (v,) in line["values"].items()}
    assert values["http.body_chunks"] == 3
    # The app paused after each non-empty chunk: at least two pauses after the first one left.
    assert values["http.response_ms"] - values["http.first_body_ms"] >= 2 * PAUSE_S * 1e3
    assert 0 <= values["http.first_body_ms"] < values["http.response_ms"]


@pytest.mark.parametrize("stats, path", [(False, "/v1/audio/speech"), (True, "/v1/models")])
def test_other_paths_and_stats_off_record_nothing(tmp_path: Path, stats: bool, path: str) -> None:
    step_stats.configure(directory=tmp_path if stats else "")
    sent = _serve(path)
    assert [m.get("body") for m in sent[1:]] == CHUNKS
    step_stats.configure(directory="")
    assert _lines(tmp_path) == []
