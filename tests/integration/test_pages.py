"""The browser pages (/ops, /sandbox): a Content-Security-Policy that allows this origin
only, and pages built so that the policy blocks nothing they need (the e2e test drives
/ops and /sandbox in Chromium under it)."""

from __future__ import annotations

from html.parser import HTMLParser

import pytest

from tests.conftest import replace
from tests.support.receiver import running_receiver

pytestmark = pytest.mark.integration

PAGES = ["/ops", "/sandbox"]


class Inline(HTMLParser):
    """What a page would need 'unsafe-inline' for, and the files it loads."""

    def __init__(self) -> None:
        super().__init__()
        self.inline: list[str] = []
        self.assets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "style":
            self.inline.append("<style>")
        if tag == "script":
            if named.get("src"):
                self.assets.append(named["src"] or "")
            else:
                self.inline.append("<script> without src")
        if tag == "link" and named.get("rel") == "stylesheet":
            self.assets.append(named.get("href") or "")
        self.inline += [f"{tag} {name}=" for name, _ in attrs if name == "style" or name.startswith("on")]


@pytest.fixture
async def client(settings):
    async with running_receiver(replace(settings, relay_enabled=False), host="localhost") as (_, c):
        yield c


@pytest.mark.parametrize("path", PAGES)
async def test_the_page_sends_a_policy_of_this_origin_only_and_refuses_framing(client, path: str) -> None:
    r = await client.get(path)
    assert r.status_code == 200
    policy = {d.split()[0]: d.split()[1:] for d in r.headers["content-security-policy"].split("; ")}
    assert policy["default-src"] == ["'self'"]
    assert policy["script-src"] == ["'self'"] and policy["style-src"] == ["'self'"]
    assert policy["frame-ancestors"] == ["'none'"]
    assert "unsafe-inline" not in r.headers["content-security-policy"]
    assert r.headers["x-frame-options"] == "DENY"
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["referrer-policy"] == "no-referrer"


@pytest.mark.parametrize("path", PAGES)
async def test_the_page_has_no_inline_script_or_style_and_its_files_are_served(client, path: str) -> None:
    parser = Inline()
    parser.feed((await client.get(path)).text)
    assert parser.inline == []
    assert parser.assets, "the page loads its script and style from files"
    for asset in parser.assets:
        r = await client.get(asset)
        assert r.status_code == 200, asset
        expected = "text/javascript" if asset.endswith(".js") else "text/css"
        assert r.headers["content-type"].startswith(expected)
        assert r.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", ["/static/ops.html", "/static/..%2Fapp.py", "/static/nope.js"])
async def test_only_the_pages_listed_files_are_served_from_static(client, path: str) -> None:
    r = await client.get(path)
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "not_found"
