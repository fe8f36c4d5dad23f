"""The admin API, a package of five modules:

- ``routes``: the HTTP routes; parse, check, then read or command.
- ``read``: the read side (documents, lists, held chats, stats, the timeline), raw SQL.
- ``commands``: a person's retry and resolve, decided over an ``OperationStore``.
- ``stores``: ``OperationStore`` (Protocol) and its Postgres implementation, which writes
  through shared/state.
- ``models``: the responses, for /openapi.json.
- ``auth``: the bearer-token gate, shared with the accounts API.
"""

from __future__ import annotations

from services.receiver.admin.auth import require_admin
from services.receiver.admin.read import account_numbers, collect_stats
from services.receiver.admin.routes import router

__all__ = ["account_numbers", "collect_stats", "require_admin", "router"]
