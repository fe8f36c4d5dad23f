"""Each account's reply writer, from the account registry (``stores.accounts.registry``): an account
with its own facts, model or prompt writes with them; every other account with the
settings'. A writer is built when first needed and again when the account's overrides
change (no restart). Which adapter an account sends with is ``platforms.accounts``."""

from __future__ import annotations

import asyncio

from services.responder.llm import (
    SYSTEM_PROMPT,
    FactsWriter,
    OpenAIWriter,
    ReplyWriter,
    account_facts_path,
    facts_text,
)
from shared.settings import Settings
from stores.accounts.registry import Account, AccountRegistry


def build_writer(settings: Settings, account: Account | None = None) -> ReplyWriter:
    """The reply writer of the settings, with the account's overrides (facts, model, prompt)."""
    o = account.overrides if account is not None else {}
    name = o.get("facts_file")
    facts = o.get("facts") or facts_text(
        account_facts_path(settings.facts_dir, name) if name else settings.facts_file
    )
    if settings.llm_base_url:
        return OpenAIWriter(
            settings.llm_base_url,
            settings.llm_api_key.get_secret_value() if settings.llm_api_key else None,
            o.get("llm_model") or settings.llm_model,
            settings.llm_timeout_seconds,
            facts,
            o.get("prompt") or SYSTEM_PROMPT,
            settings.prompt_bounds(),
        )
    return FactsWriter(facts)


WRITER_OVERRIDES = ("facts", "facts_file", "llm_model", "prompt")


class AccountWriters:
    """The reply writer each account writes with: the global one, or its own."""

    def __init__(self, settings: Settings, registry: AccountRegistry | None, default: ReplyWriter) -> None:
        self._settings = settings
        self._registry = registry
        self.default = default
        self._built: dict[tuple[str, str], tuple[str, ReplyWriter]] = {}
        self._retired: list[ReplyWriter] = []

    def for_account(self, platform: str, account_id: str) -> ReplyWriter:
        account = self._registry.get(platform, account_id) if self._registry is not None else None
        if account is None or not any(k in account.overrides for k in WRITER_OVERRIDES):
            return self.default
        mark = repr(sorted((k, account.overrides.get(k)) for k in WRITER_OVERRIDES))
        key = (platform, account_id)
        built = self._built.get(key)
        if built is None or built[0] != mark:
            if built is not None:
                self._retired.append(built[1])  # closed at the end: a job may still use it
            built = (mark, build_writer(self._settings, account))
            self._built[key] = built
        return built[1]

    async def aclose(self) -> None:
        writers = [self.default, *(w for _, w in self._built.values()), *self._retired]
        await asyncio.gather(*(w.aclose() for w in writers), return_exceptions=True)
