"""How a caught exception is shown in a status string or a log line: one line, bounded."""

from __future__ import annotations


def describe(exc: BaseException, limit: int = 300) -> str:
    """``"TypeName: message"`` on one line, cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
