"""A reply longer than the platform takes (Telegram 4,096 characters, Avito 1,000) goes
out as parts, in order, split where a reader would pause: at a line break, else after a
sentence, else between words; a word longer than a whole part is cut. Pure and
deterministic: the same text always gives the same parts, so an attempt that resumes a
reply half sent sends exactly the parts still missing."""

from __future__ import annotations

import re

_BREAKS = (
    re.compile(r"\n+"),  # paragraphs and lines
    re.compile(r"(?<=[.!?…])\s+"),  # sentences
    re.compile(r"\s+"),  # words
)


def split_reply(text: str, limit: int) -> list[str]:
    """``text`` as parts of at most ``limit`` characters, none empty, in order; their
    concatenation is the text without the whitespace at the cuts."""
    if limit < 1:
        raise ValueError("a part holds at least one character")
    text = text.strip()
    if len(text) <= limit:
        return [text] if text else []
    parts: list[str] = []
    rest = text
    while len(rest) > limit:
        cut = _cut_point(rest, limit)
        parts.append(rest[:cut].rstrip())
        rest = rest[cut:].lstrip()
    if rest:
        parts.append(rest)
    return parts


def _cut_point(text: str, limit: int) -> int:
    """Where the first part of ``text`` ends: the last break of the most natural kind that
    leaves a part of at least half the limit (so parts stay full), else a hard cut."""
    window = text[: limit + 1]
    for pattern in _BREAKS:
        ends = [m.start() for m in pattern.finditer(window) if limit // 2 <= m.start() <= limit]
        if ends:
            return ends[-1]
    return limit
