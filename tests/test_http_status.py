"""The too-long-input middleware on a plain ASGI app: what it rewrites, and what it leaves alone.

The served behaviour (a real too-long request answered 400) is in test_serving_e2e.py; here the
reference is the ASGI messages themselves.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from omni_cpu_fastpath.serving.http_status import InputTooLongIs400

TOO_LONG = (
    "Speech generation failed: The decoder prompt (length 52915) is longer than the maximum model "
    "length of 4096. Make sure that `max_model_len` is no smaller than the number of text tokens."
)


def _app(status: int, chunks: list[bytes]):
    async def app(scope, receive, send):
        length = str(sum(map(len, chunks))).encode()
        await send(
            {"type": "http.response.start", "status": status, "headers": [(b"content-length", length)]}
        )
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i + 1 < len(chunks)})

    return app


def _run(app) -> tuple[int, dict[bytes, bytes], bytes, int]:
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(InputTooLongIs400(app)({"type": "http", "method": "POST"}, receive, send))
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], dict(start["headers"]), body, len(sent) - 1


def _error(message: str, status: int = 500) -> bytes:
    err_type = "InternalServerError" if status == 500 else "BadRequestError"
    return json.dumps(
        {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    ).encode()


def test_too_long_input_becomes_a_400_with_the_message() -> None:
    body = _error(TOO_LONG)
    status, headers, out, _ = _run(_app(500, [body[:30], body[30:]]))  # a body in two chunks
    assert status == 400
    error = json.loads(out)["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["message"].startswith(
        "The decoder prompt (length 52915) is longer than the maximum model length"
    )
    assert headers[b"content-length"] == str(len(out)).encode()


@pytest.mark.parametrize(
    "status, body",
    [
        (500, _error("Speech generation failed: CUDA out of memory")),  # a real server error stays
        (500, b"not json at all"),
        (400, _error("is longer than the maximum model length", status=400)),  # already a 4xx
        (200, b"RIFF....WAVEfmt "),
    ],
)
def test_everything_else_passes_through(status: int, body: bytes) -> None:
    got_status, headers, out, _ = _run(_app(status, [body]))
    assert (got_status, out) == (status, body)
    assert headers[b"content-length"] == str(len(body)).encode()


def test_streamed_200_is_passed_chunk_by_chunk() -> None:
    chunks = [b"a" * 10, b"b" * 10, b"c" * 10]
    status, _, out, messages = _run(_app(200, chunks))
    assert status == 200 and out == b"".join(chunks) and messages == 3
