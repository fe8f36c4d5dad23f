"""/openapi.json documents the admin API a user scripts against: every admin path, and
for each its response's schema (not an untyped object)."""

from __future__ import annotations

from typing import Any

import pytest

from services.receiver.app import create_app
from shared.settings import Settings

pytestmark = pytest.mark.unit

#: path, method, status -> the schema the response is described by
ADMIN = [
    ("/v1/operations/{operation_id}", "get", "200", "OperationWithTimeline"),
    ("/v1/operations", "get", "200", "OperationList"),
    ("/v1/operations/{operation_id}/retry", "post", "202", "Retried"),
    ("/v1/operations/{operation_id}/resolve", "post", "200", "Resolved"),
    ("/v1/chats", "get", "200", "HeldChats"),
    ("/v1/chats/{chat}/resume", "post", "200", "Resumed"),
    ("/v1/stats", "get", "200", "Stats"),
]


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    app = create_app(Settings(admin_token="t")).public
    return app.openapi()


@pytest.mark.parametrize(
    ("path", "method", "status", "model"), ADMIN, ids=[f"{m} {p}" for p, m, _, _ in ADMIN]
)
def test_each_admin_path_is_documented_with_its_response_schema(
    document: dict[str, Any], path: str, method: str, status: str, model: str
) -> None:
    response = document["paths"][path][method]["responses"][status]
    assert response["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model}"}
    assert document["components"]["schemas"][model]["properties"]


def test_an_operations_document_names_its_fields_and_their_types(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    operation = schemas["Operation"]["properties"]
    assert {"id", "status", "status_text", "message", "reply", "error", "owner", "retries"} <= set(operation)
    assert schemas["OperationWithTimeline"]["properties"]["timeline"]["type"] == "array"
    assert "for" in schemas["TimelineEvent"]["properties"]
    assert set(schemas["Last24h"]["properties"]) >= {
        "replied",
        "failed_share",
        "receipt_to_reply_p95_seconds",
    }
