"""The admin API's one gate: Bearer ADMIN_TOKEN (and, during a rotation, the previous
one) compared in constant time; no token configured means the admin API is off."""

from __future__ import annotations

import hmac

from fastapi import Request

from platforms.inbound import ApiError


def require_admin(request: Request) -> None:
    accepted: list[str] = request.app.state.admin_tokens
    if not accepted:
        raise ApiError(404, "admin_api_disabled", "the admin API is off: set CHATQ_ADMIN_TOKEN")
    header = request.headers.get("authorization", "")
    scheme, _, presented = header.partition(" ")
    # Every accepted token is compared, so the time taken does not tell which one matched.
    matches = [hmac.compare_digest(presented.strip().encode(), token.encode()) for token in accepted]
    if scheme.lower() != "bearer" or not any(matches):
        raise ApiError(401, "unauthorized", "missing or wrong bearer token")
