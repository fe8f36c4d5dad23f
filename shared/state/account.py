"""A platform account (a Telegram bot, an Avito account, a generic sender): whether the
bot may send on it.

    active <-> paused_by_platform   the platform refused the account as a whole (a revoked
                                    token, wrong credentials, no paid plan): its jobs wait,
                                    a probe resumes it once the platform accepts it again
    active <-> paused_by_person     a person paused it (nothing resumes it but a person)

A refusal about one chat (the buyer blocked the bot, the chat is gone) is not about the
account: that job fails alone.
"""

from __future__ import annotations

import enum

from .machine import Lifecycle


class AccountState(enum.StrEnum):
    ACTIVE = "active"
    PAUSED_BY_PLATFORM = "paused_by_platform"
    PAUSED_BY_PERSON = "paused_by_person"


A = AccountState

LIFECYCLE = Lifecycle(
    "account",
    AccountState,
    {
        A.ACTIVE: frozenset({A.PAUSED_BY_PLATFORM, A.PAUSED_BY_PERSON}),
        A.PAUSED_BY_PLATFORM: frozenset({A.ACTIVE, A.PAUSED_BY_PERSON}),
        A.PAUSED_BY_PERSON: frozenset({A.ACTIVE}),
    },
)
