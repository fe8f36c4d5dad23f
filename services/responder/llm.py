"""Reply generation. With LLM_BASE_URL: an OpenAI-compatible model (short timeout,
max_retries=0: the queue owns the retry budget). Without: the built-in facts responder,
deterministic, answering from FACTS_FILE. Either answers in the buyer's language, and
knows the listing the chat is about when the platform gives one (Avito)."""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from platforms.base import Listing
from platforms.failures import Failure, Kind, classify_llm
from shared import metrics
from shared.messages import PromptBounds
from stores.accounts.registry import FACTS_FILE_NAME
from stores.jobs.protocol import Turn


@dataclass
class Writing:
    """What one write did beyond its text, for the job's record and the account's cost:
    what was cut from the prompt to keep it within bounds, and the model's token counts."""

    cuts: list[str] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0


#: Where a text was cut short (the model sees that it was).
CUT_MARK = " […]"


def _cut(text: str, chars: int, *, keep_end: bool = False) -> str:
    if len(text) <= chars:
        return text
    room = max(chars - len(CUT_MARK), 0)
    return CUT_MARK.strip() + " " + text[len(text) - room :] if keep_end else text[:room] + CUT_MARK


def bound_prompt(
    system: str, history: Sequence[Turn], batch: Sequence[str], bounds: PromptBounds
) -> tuple[str, list[Turn], str, list[str]]:
    """The system prompt, history and buyer's turn cut to ``bounds``, and what was cut, in
    words: each turn (history turns and buyer messages, their beginning kept) to
    ``bounds.turn``; the history to its newest turns within ``bounds.history``; then the
    whole prompt to ``bounds.prompt``: the buyer's turn to half of it at most (its end
    kept: the latest messages), the system prompt (instructions, facts, listing) to what
    is left beside it, and the oldest history turns dropped until it fits."""
    cuts: list[str] = []
    long_turns = sum(1 for t in history if len(t.text) > bounds.turn) + sum(
        1 for m in batch if len(m) > bounds.turn
    )
    if long_turns:
        cuts.append(f"{long_turns} message(s) longer than {bounds.turn} characters cut to that")
    turns = [Turn(t.role, _cut(t.text, bounds.turn)) for t in history]
    joined = "\n".join(_cut(m, bounds.turn) for m in batch)
    said = _cut(joined, bounds.prompt // 2, keep_end=True)
    if len(said) < len(joined):
        cuts.append(f"the buyer's messages cut to their last {bounds.prompt // 2} characters")
    room = bounds.prompt - len(said)
    if len(system) > room:
        cuts.append(f"the seller's instructions and facts cut from {len(system)} to {room} characters")
        system = _cut(system, room)
    kept: list[Turn] = []
    total = 0
    for turn in reversed(turns):
        total += len(turn.text)
        if total > bounds.history or total + len(system) + len(said) > bounds.prompt:
            break
        kept.append(turn)
    if len(kept) < len(turns):
        cuts.append(f"{len(turns) - len(kept)} older turn(s) of the chat left out")
    return system, kept[::-1], said, cuts


class ReplyWriter(Protocol):
    async def write(
        self,
        history: Sequence[Turn],
        batch: Sequence[str],
        listing: Listing | None = None,
        writing: Writing | None = None,
    ) -> str:
        """The reply to ``batch`` (the buyer's messages), after ``history``, about ``listing``;
        what was cut and counted goes in ``writing``."""
        ...

    def instructions(self) -> str:
        """The seller's instructions to the model: the system prompt without the facts
        meant for buyers (a reply must not repeat them, ``reply_check``)."""
        ...

    async def aclose(self) -> None: ...


SYSTEM_PROMPT = (
    "You answer buyers on behalf of a seller in a marketplace chat. Answer every question in the "
    "buyer's latest messages in one short, friendly reply, in the buyer's language: the language "
    "their messages are written in (a buyer writing Russian gets Russian). Use only the facts "
    "below and the listing; if they do not cover a question, say a person will follow up. Never "
    "promise what the seller does not do.\n\nFacts:\n{facts}"
)
#: Added to the system prompt when the chat is about a listing.
LISTING_PROMPT = "\n\nThe buyer writes about this listing: {listing}"


def listing_text(listing: Listing) -> str:
    """The listing in one line: “title”, price, url (what is known)."""
    return ", ".join(p for p in (f"“{listing.title}”", listing.price, listing.url) if p)


#: A typed placeholder of a message that is not text ("[the buyer sent a photo]"): ours, in
#: English, never the buyer's language.
PLACEHOLDER = re.compile(r"\[[^\]]*\]")


def buyer_language(texts: Sequence[str]) -> str:
    """The language the buyer writes in, as far as the facts responder tells them apart:
    "ru" when Cyrillic letters outnumber Latin ones, else "en" (placeholders not counted)."""
    joined = PLACEHOLDER.sub(" ", " ".join(texts)).lower()
    cyrillic = sum(1 for c in joined if "а" <= c <= "я" or c == "ё")
    latin = sum(1 for c in joined if "a" <= c <= "z")
    return "ru" if cyrillic > latin else "en"


class OpenAIWriter:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        model: str,
        timeout: float,
        facts: str,
        prompt: str = SYSTEM_PROMPT,
        bounds: PromptBounds | None = None,
    ) -> None:
        import openai  # here: half a second of imports a process without a model never needs

        self._client = openai.AsyncOpenAI(
            base_url=base_url, api_key=api_key or "not-needed", timeout=timeout, max_retries=0
        )
        self._model = model
        self._bounds = bounds or PromptBounds()
        self._instructions = prompt
        # An account's own prompt names where its facts go with {facts}, or gets them after it.
        facts = facts or "(none given)"
        self._system = (
            prompt.replace("{facts}", facts) if "{facts}" in prompt else f"{prompt}\n\nFacts:\n{facts}"
        )

    def instructions(self) -> str:
        return self._instructions

    async def write(
        self,
        history: Sequence[Turn],
        batch: Sequence[str],
        listing: Listing | None = None,
        writing: Writing | None = None,
    ) -> str:
        writing = writing if writing is not None else Writing()
        system = self._system + (LISTING_PROMPT.format(listing=listing_text(listing)) if listing else "")
        system, turns, said, writing.cuts = bound_prompt(system, history, batch, self._bounds)
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        for turn in turns:
            messages.append({"role": "user" if turn.role == "buyer" else "assistant", "content": turn.text})
        messages.append({"role": "user", "content": said})
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
        if response.usage is not None:
            writing.prompt_tokens = response.usage.prompt_tokens
            writing.completion_tokens = response.usage.completion_tokens
        text = (response.choices[0].message.content or "").strip() if response.choices else ""
        if not text:
            raise Failure(Kind.TRANSIENT, "the model returned an empty reply")
        return text

    async def aclose(self) -> None:
        await self._client.close()


DEFAULT_FACTS = """\
# Built-in facts, used when CHATQ_FACTS_FILE is not set. Format: one fact per line,
# "keyword, keyword: answer"; [we do not] lists what the seller does not do. A section
# named with a language ([facts: ru], [we do not: ru]) answers buyers writing in it; the
# unnamed sections answer everyone else, in English.
[facts]
available, still, in stock, есть, актуально: Yes, it is available.
deliver, delivery, shipping, доставка, доставите: We ship across the country; delivery takes 2-5 days.
price, cost, discount, cheaper, цена, скидка: The price in the listing is final.
pick up, pickup, самовывоз: Pick-up is possible by appointment.
[we do not]
trade, exchange, обмен: We do not accept trades.

[facts: ru]
есть, актуал, в наличии, продаете, продаёте, продано: Да, в наличии.
доставк, отправ, пришлете, пришлёте: Отправляем по всей стране, доставка занимает 2-5 дней.
цен, стоит, стоимост, скидк, торг, дешевле, уступ: Цена в объявлении окончательная.
самовывоз, забрать, заберу: Самовывоз возможен по договорённости.
[we do not: ru]
обмен, поменя: Обмен не рассматриваем.
"""

#: The language of the unnamed sections of a facts file.
DEFAULT_LANGUAGE = "en"


@dataclass(frozen=True)
class Fact:
    keywords: tuple[str, ...]
    answer: str
    #: Any keyword at the start of a word: one pattern, compiled once (a pattern per
    #: keyword and job was 4% of the responder's CPU under bench.pipeline).
    _pattern: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        alternatives = "|".join(re.escape(k) for k in self.keywords)
        object.__setattr__(
            self, "_pattern", re.compile(rf"(?<!\w)(?:{alternatives})") if self.keywords else None
        )

    def mentioned_in(self, text: str) -> bool:
        """Whether one of the keywords starts a word of ``text`` (lower case)."""
        return self._pattern is not None and self._pattern.search(text) is not None


@dataclass
class FactBook:
    """The facts of one language, and what the seller does not do."""

    facts: list[Fact]
    refusals: list[Fact]


@dataclass(frozen=True)
class Words:
    """The facts responder's own words in one language."""

    hello: str
    fallback: str
    #: Before the answers when the chat is about a listing: {title}, {price} (" (price)" or "").
    about: str
    #: The fallback when the chat is about a listing.
    fallback_about: str


WORDS = {
    "en": Words(
        hello="Hello!",
        fallback="Thank you for your message! The seller will get back to you shortly.",
        about="About “{title}”{price}:",
        fallback_about="Thank you for your message about “{title}”! The seller will get back to you shortly.",
    ),
    "ru": Words(
        hello="Здравствуйте!",
        fallback="Спасибо за сообщение! Продавец скоро ответит.",
        about="По объявлению «{title}»{price}:",
        fallback_about="Спасибо за сообщение по объявлению «{title}»! Продавец скоро ответит.",
    ),
}

_SECTION = re.compile(r"^\[(facts|we do not)(?:\s*:\s*([a-z]{2}))?\]$")


def parse_facts(text: str) -> dict[str, FactBook]:
    """A facts file, by language (the unnamed sections are DEFAULT_LANGUAGE's)."""
    books: dict[str, FactBook] = {}
    section = books.setdefault(DEFAULT_LANGUAGE, FactBook([], [])).facts
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if header := _SECTION.match(line.lower()):
            book = books.setdefault(header.group(2) or DEFAULT_LANGUAGE, FactBook([], []))
            section = book.facts if header.group(1) == "facts" else book.refusals
            continue
        keywords, sep, answer = line.partition(":")
        if not sep or not answer.strip():
            raise ValueError(f"facts line is not 'keywords: answer': {line!r}")
        section.append(
            Fact(tuple(k.strip().lower() for k in keywords.split(",") if k.strip()), answer.strip())
        )
    return books


class FactsWriter:
    """Answers from the seller's facts, deterministically, in the buyer's language when the
    facts have a section in it (else in English): every fact whose keyword appears in the
    batch, in file order, after the listing the chat is about; a hand-over line when none
    does."""

    FALLBACK = WORDS[DEFAULT_LANGUAGE].fallback

    def __init__(self, facts_text: str) -> None:
        self._books = parse_facts(facts_text)

    def instructions(self) -> str:
        return ""  # it follows no instructions: every word it says is the facts' or its own

    async def write(
        self,
        history: Sequence[Turn],
        batch: Sequence[str],
        listing: Listing | None = None,
        writing: Writing | None = None,
    ) -> str:
        started = time.perf_counter()
        language = buyer_language(batch)
        if language not in self._books or language not in WORDS:
            language = DEFAULT_LANGUAGE
        book, words = self._books[language], WORDS[language]
        said = " ".join(batch).lower()
        answers = [f.answer for f in (*book.refusals, *book.facts) if f.mentioned_in(said)]
        # Keep each answer once, refusals first so the buyer hears them.
        seen: list[str] = []
        for a in answers:
            if a not in seen:
                seen.append(a)
        if not seen:
            text = words.fallback_about.format(title=listing.title) if listing else words.fallback
        elif listing is None:
            text = " ".join([words.hello, *seen])
        else:
            price = f" ({listing.price})" if listing.price else ""
            text = " ".join([words.hello, words.about.format(title=listing.title, price=price), *seen])
        metrics.LLM_SECONDS.labels(outcome="ok").observe(time.perf_counter() - started)
        return text

    async def aclose(self) -> None:
        return None


def facts_text(path: str | Path | None) -> str:
    return Path(path).read_text(encoding="utf-8") if path else DEFAULT_FACTS


def account_facts_path(facts_dir: str | None, name: str) -> Path:
    """Where an account's ``facts_file`` override is read: a file of FACTS_DIR, never
    anything else on the host (its environment, the secrets key file), whatever the
    name or a link in the folder says."""
    if facts_dir is None:
        raise ValueError(f"facts_file {name!r} names a file in CHATQ_FACTS_DIR, which is not set")
    if not re.fullmatch(FACTS_FILE_NAME, name):  # match's "$" would let a trailing newline by
        raise ValueError(f"facts_file {name!r} is not a plain file name in CHATQ_FACTS_DIR")
    folder = Path(facts_dir).resolve()
    path = (folder / name).resolve()
    if not path.is_relative_to(folder):
        raise ValueError(f"facts_file {name!r} leads out of CHATQ_FACTS_DIR")
    return path
