"""Text helpers shared by every layer (pure Python, imports nothing of dppo)."""

from __future__ import annotations


def one_line(value: object, limit: int | None = 300) -> str:
    """str(value) with every run of whitespace (newlines included) collapsed to one space, cut to at most limit
    characters with a trailing "..." (None: not cut). For putting an exception or a file's message into one line
    of an error."""
    text = " ".join(str(value).split())
    if limit is None or len(text) <= limit:
        return text
    return text[: max(limit - 3, 0)] + "..."
