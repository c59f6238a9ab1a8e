"""An ASGI middleware that answers a too-long input with 400, as the client's error it is.

vllm-omni 0.30's speech endpoint turns every exception it does not know into a 500 ("Speech
generation failed: ..."), including vLLM's ``VLLMValidationError`` for a prompt longer than the
model's context: a client error, reported as the server's. ``omni-cpu-fastpath serve`` installs
this class through vLLM's public ``--middleware`` option; it rewrites exactly those responses (a
500 whose error message is vLLM's "longer than the maximum model length") to a 400
``BadRequestError`` with the same message, and passes everything else through untouched,
streaming included.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# vLLM's wording for a prompt over max_model_len (vllm/v1/engine/input_processor.py).
TOO_LONG = "is longer than the maximum model length"


class InputTooLongIs400:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        held: Message | None = None  # the start of a 500, until its body says what it is
        body = b""

        async def send_or_rewrite(message: Message) -> None:
            nonlocal held, body
            if message["type"] == "http.response.start" and message["status"] == 500:
                held = message
                return
            if held is None:
                await send(message)
                return
            body += message.get("body", b"")
            if message.get("more_body", False):
                return
            start, held = held, None
            new_body = _as_client_error(body)
            if new_body is not None:
                headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
                headers.append((b"content-length", str(len(new_body)).encode()))
                start = {**start, "status": 400, "headers": headers}
                body = new_body
            await send(start)
            await send({"type": "http.response.body", "body": body, "more_body": False})

        await self.app(scope, receive, send_or_rewrite)


def _as_client_error(body: bytes) -> bytes | None:
    """The 400 body for a 500 body that reports a too-long input, else None."""
    try:
        data = json.loads(body)
        error = data["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        return None
    if TOO_LONG not in message:
        return None
    # Drop the handler's "Speech generation failed: " prefix: the request failed, not the server.
    message = message.split(": ", 1)[1] if message.startswith("Speech generation failed: ") else message
    error.update(message=message, type="BadRequestError", code=400)
    return json.dumps(data).encode()
