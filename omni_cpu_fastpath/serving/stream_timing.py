"""An ASGI middleware that times, in the API server, when each speech response's bytes leave it.

A client's time to first audio adds whatever delays the client itself: on a small machine that
also runs the server, the client process can wait seconds for a core while the stage processes
busy-poll (vLLM's workers spin on ``sched_yield`` for a second after each message, vllm-omni's
orchestrator polls every millisecond, OpenMP threads spin between parallel regions), so audio
that the server sent on time is read late. This middleware says what the server did: with
``VLLM_OMNI_STEP_STATS_DIR`` set, every ``/v1/audio/speech`` response adds one line to the API
server's step stats with

- ``http.first_body_ms``: from the request reaching the app to its first non-empty body chunk
  handed to the HTTP server (raw PCM streaming: the first audio; WAV: its header, sent with the
  first audio);
- ``http.body_chunks``: non-empty body chunks sent (more than one for a streamed response);
- ``http.response_ms``: from the request reaching the app to the end of the response.

The line's ``ts`` is the end of the response. With stats off it passes every message through
untouched, as it does for other paths. ``omni-cpu-fastpath serve`` installs it with vLLM's
``--middleware`` option.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from omni_cpu_fastpath import step_stats

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

FIRST_BODY_MS = "http.first_body_ms"
BODY_CHUNKS = "http.body_chunks"
RESPONSE_MS = "http.response_ms"
SPEECH_PATH = "/audio/speech"


class SpeechResponseTimes:
    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or not str(scope.get("path", "")).endswith(SPEECH_PATH)
            or not step_stats.enabled()
        ):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        first: float | None = None
        chunks = 0

        async def timed_send(message: Message) -> None:
            nonlocal first, chunks
            await send(message)
            if message["type"] == "http.response.body" and message.get("body"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()

        try:
            await self.app(scope, receive, timed_send)
        finally:
            # Recorded and closed with no await between: one line per response, also when
            # several responses stream at once.
            if first is not None:
                step_stats.record(FIRST_BODY_MS, (first - t0) * 1e3)
            step_stats.record(BODY_CHUNKS, chunks)
            step_stats.record(RESPONSE_MS, (time.perf_counter() - t0) * 1e3)
            step_stats.end_step()
