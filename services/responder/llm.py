"""Reply generation. With LLM_BASE_URL: an OpenAI-compatible model (short timeout,
max_retries=0: the queue owns the retry budget). Without: the built-in facts responder,
deterministic, answering from FACTS_FILE."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import openai

from shared import metrics

from .failures import Failure, Kind, classify_llm


@dataclass(frozen=True)
class Turn:
    role: str  # "buyer" | "bot"
    text: str


class ReplyWriter(Protocol):
    async def write(self, history: Sequence[Turn], batch: Sequence[str]) -> str: ...

    async def aclose(self) -> None: ...


SYSTEM_PROMPT = (
    "You answer buyers on behalf of a seller in a marketplace chat. Answer every question in the "
    "buyer's latest messages in one short, friendly reply, in the buyer's language. Use only the "
    "facts below; if they do not cover a question, say a person will follow up. Never promise "
    "what the seller does not do.\n\nFacts:\n{facts}"
)


class OpenAIWriter:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        model: str,
        timeout: float,
        facts: str,
        prompt: str = SYSTEM_PROMPT,
    ) -> None:
        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "not-needed", timeout=timeout, max_retries=0
        )
        self._model = model
        # An account's own prompt names where its facts go with {facts}, or gets them after it.
        facts = facts or "(none given)"
        self._system = (
            prompt.replace("{facts}", facts) if "{facts}" in prompt else f"{prompt}\n\nFacts:\n{facts}"
        )

    async def write(self, history: Sequence[Turn], batch: Sequence[str]) -> str:
        messages: list[dict[str, str]] = [{"role": "system", "content": self._system}]
        for turn in history:
            messages.append({"role": "user" if turn.role == "buyer" else "assistant", "content": turn.text})
        messages.append({"role": "user", "content": "\n".join(batch)})
        started = time.perf_counter()
        try:
            response = await self._client.chat.completions.create(
                model=self._model,
                messages=messages,  # type: ignore[arg-type]
                temperature=0.3,
                max_tokens=400,
            )
        except Exception as exc:
            failure = classify_llm(exc)
            metrics.LLM_SECONDS.labels(outcome=failure.kind.value).observe(time.perf_counter() - started)
            raise failure from None
        metrics.LLM_SECONDS.labels(outcome="ok").observe(time.perf_counter() - started)
        text = (response.choices[0].message.content or "").strip() if response.choices else ""
        if not text:
            raise Failure(Kind.TRANSIENT, "the model returned an empty reply")
        return text

    async def aclose(self) -> None:
        await self._client.close()


DEFAULT_FACTS = """\
# Built-in facts, used when CHATQ_FACTS_FILE is not set. Format: one fact per line,
# "keyword, keyword: answer"; [we do not] lists what the seller does not do.
[facts]
available, still, in stock, есть, актуально: Yes, it is available.
deliver, delivery, shipping, доставка, доставите: We ship across the country; delivery takes 2-5 days.
price, cost, discount, cheaper, цена, скидка: The price in the listing is final.
pick up, pickup, самовывоз: Pick-up is possible by appointment.
[we do not]
trade, exchange, обмен: We do not accept trades.
"""


@dataclass(frozen=True)
class Fact:
    keywords: tuple[str, ...]
    answer: str


def parse_facts(text: str) -> tuple[list[Fact], list[Fact]]:
    facts: list[Fact] = []
    refusals: list[Fact] = []
    section = facts
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.lower() in ("[facts]", "[we do not]"):
            section = facts if line.lower() == "[facts]" else refusals
            continue
        keywords, sep, answer = line.partition(":")
        if not sep or not answer.strip():
            raise ValueError(f"facts line is not 'keywords: answer': {line!r}")
        section.append(
            Fact(tuple(k.strip().lower() for k in keywords.split(",") if k.strip()), answer.strip())
        )
    return facts, refusals


class FactsWriter:
    """Answers from the seller's facts, deterministically: every fact whose keyword
    appears in the batch, in file order; a hand-over line when none does."""

    FALLBACK = "Thank you for your message! The seller will get back to you shortly."

    def __init__(self, facts_text: str) -> None:
        self._facts, self._refusals = parse_facts(facts_text)

    async def write(self, history: Sequence[Turn], batch: Sequence[str]) -> str:
        started = time.perf_counter()
        words = " ".join(batch).lower()
        answers = [
            f.answer for f in (*self._refusals, *self._facts) if any(_mentions(words, k) for k in f.keywords)
        ]
        # Keep each answer once, refusals first so the buyer hears them.
        seen: list[str] = []
        for a in answers:
            if a not in seen:
                seen.append(a)
        text = "Hello! " + " ".join(seen) if seen else self.FALLBACK
        metrics.LLM_SECONDS.labels(outcome="ok").observe(time.perf_counter() - started)
        return text

    async def aclose(self) -> None:
        return None


def _mentions(text: str, keyword: str) -> bool:
    return re.search(r"(?<!\w)" + re.escape(keyword), text) is not None


def facts_text(path: str | None) -> str:
    return Path(path).read_text(encoding="utf-8") if path else DEFAULT_FACTS
