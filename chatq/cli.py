"""``chatq``: the person on call's command line. Talks to the receiver's admin API
(CHATQ_ADMIN_URL, CHATQ_ADMIN_TOKEN, from the environment or ./.env) for status, list,
retry, resolve and stats; runs
migrations and exports the broker topology locally; connects this deployment to
Telegram and Avito (``connect``) and checks everything a seller needs (``doctor``).

Exit codes: 0 done; 1 the API or platform refused (not found, not retryable, ...), or a
doctor check failed; 2 bad usage or a missing setting; 3 the receiver or a platform
could not be reached or failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any
from urllib.parse import quote

import httpx
from pydantic import ValidationError

from chatq.envfile import DEFAULT_ENV_FILE

EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3


class CliError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    cells = [[str(h) for h in headers], *[["" if c is None else str(c) for c in r] for r in rows]]
    widths = [min(max(len(r[i]) for r in cells), 60) for i in range(len(headers))]

    def line(r: list[str]) -> str:
        return "  ".join(
            (c if len(c) <= 60 else c[:59] + "…").ljust(w) for c, w in zip(r, widths, strict=True)
        ).rstrip()

    return "\n".join([line(cells[0]), "  ".join("-" * w for w in widths), *(line(r) for r in cells[1:])])


def age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


class Api:
    def __init__(self, base_url: str, token: str | None) -> None:
        if not token:
            raise CliError(EXIT_USAGE, "set CHATQ_ADMIN_TOKEN (the receiver's admin token)")
        self._client = httpx.Client(
            base_url=base_url, headers={"authorization": f"Bearer {token}"}, timeout=15
        )

    def call(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            raise CliError(
                EXIT_UNREACHABLE, f"cannot reach the receiver at {self._client.base_url}: {exc}"
            ) from None
        try:
            body = response.json()
        except ValueError:
            body = {}
        if response.status_code >= 500:
            raise CliError(EXIT_UNREACHABLE, f"the receiver failed: HTTP {response.status_code}")
        if response.is_error:
            err = body.get("error", {}) if isinstance(body, dict) else {}
            raise CliError(
                EXIT_REFUSED, f"{err.get('code', response.status_code)}: {err.get('message', response.text)}"
            )
        if not isinstance(body, dict):
            raise CliError(EXIT_UNREACHABLE, f"the receiver answered {method} {path} with no JSON object")
        return body


def _status(api: Api, args: argparse.Namespace) -> str:
    op = api.call("GET", f"/v1/operations/{args.operation_id}")
    if args.json:
        return json.dumps(op, indent=2, ensure_ascii=False)
    lines = [
        f"operation  {op['id']}",
        f"status     {op['status']} — {op['status_text']}",
        f"chat       {op['platform']} {op['chat']['account_id']}/{op['chat']['chat_id']}",
        f"message    {op['message']['text']}",
        f"age        {age(op['age_seconds'])}",
    ]
    if op.get("job"):
        lines.append(f"job        {op['job']['id']} ({op['job']['status']})")
    if op.get("reply"):
        lines.append(f"reply      {op['reply']['text']}")
    if op.get("error"):
        lines.append(
            f"error      {op['error']['kind']}: {op['error']['message']} (attempts {op['error']['attempts']})"
        )
    if op.get("owner"):
        lines.append(f"owner      {op['owner']}")
    lines.append("record (who decided what, and when)")
    lines += [
        f"  {e['at']}  {e['event']}"
        + (f"  [by {e['by']}]" if e.get("by") else "")
        + (f"  [for {e['for']}]" if e.get("for") else "")
        for e in op.get("timeline", [])
    ]
    return "\n".join(lines)


def _list(api: Api, args: argparse.Namespace) -> str:
    params: dict[str, Any] = {"limit": args.limit}
    if args.status:
        params["status"] = args.status
    if args.older_than:
        params["older_than"] = args.older_than
    if args.account:
        params["account"] = args.account
    ops = api.call("GET", "/v1/operations", params=params)["operations"]
    if args.json:
        return json.dumps(ops, indent=2, ensure_ascii=False)
    rows = [
        (
            o["id"],
            o["status"],
            age(o["age_seconds"]),
            f"{o['platform']}:{o['chat']['chat_id']}",
            o["message"]["text"],
            o["status_text"],
        )
        for o in ops
    ]
    return (
        table(rows, ("operation", "status", "age", "chat", "message", "status text"))
        + f"\n{len(ops)} operation(s)"
    )


def _retry(api: Api, args: argparse.Namespace) -> str:
    body: dict[str, str] = {"note": args.note or ""}
    if args.by:
        body["by"] = args.by
    r = api.call(
        "POST",
        f"/v1/operations/{args.operation_id}/retry" + ("?resend=true" if args.resend else ""),
        json=body,
    )
    verb = "re-send confirmed; re-queued" if r.get("resend") else "re-queued"
    return f"{verb} {len(r['retried'])} operation(s): {', '.join(r['retried'])}"


def _resolve(api: Api, args: argparse.Namespace) -> str:
    r = api.call(
        "POST",
        f"/v1/operations/{args.operation_id}/resolve",
        json={"resolution": args.resolution, "owner": args.owner, "note": args.note or ""},
    )
    return f"{r['status']}: {', '.join(r['resolved'])}"


def _chats(api: Api, args: argparse.Namespace) -> str:
    if args.action == "resume":
        if not args.chat:
            raise CliError(EXIT_USAGE, "chatq chats resume PLATFORM:ACCOUNT:CHAT")
        api.call("POST", f"/v1/chats/{quote(args.chat, safe=':')}/resume")
        return f"{args.chat}: handed back to the bot; its waiting messages are answered after the usual pause"
    params = {"held": "true"} | ({"account": args.account} if args.account else {})
    held = api.call("GET", "/v1/chats", params=params)["chats"]
    rows = [(c["chat"], c["held_until"], c["seller_message_id"], c["waiting_messages"]) for c in held]
    scope = f" of account {args.account}" if args.account else ""
    return (
        table(rows, ("chat", "held until", "seller's message", "waiting"))
        + f"\n{len(rows)} chat(s){scope} held by the seller"
    )


def _stats(api: Api, args: argparse.Namespace) -> str:
    s = api.call("GET", "/v1/stats", params={"account": args.account} if args.account else None)
    if args.json:
        return json.dumps(s, indent=2)
    scope = [f"account {s['account']}", ""] if s.get("account") else []
    backlog = table(
        [(k, v["count"], age(v["oldest_age_seconds"])) for k, v in s["backlog"].items()],
        ("state", "count", "oldest"),
    )
    d = s["last_24h"]
    per_account = []
    if s.get("accounts") and not s.get("account"):
        per_account = [
            "",
            _account_rows(s["accounts"])
            + f"\n{len(s['accounts'])} of {s['accounts_total']} account(s), most backlog first",
        ]
    return "\n".join(
        [
            *scope,
            backlog,
            "",
            f"backlog                     {s['backlog_total']} unfinished",
            f"receipt-to-reply (24 h)     p50 {age(d['receipt_to_reply_p50_seconds'])}, "
            f"p95 {age(d['receipt_to_reply_p95_seconds'])}",
            f"failed share (24 h)         {d['failed_share'] * 100:.1f} %",
            f"retries (24 h)              {d['retries']} ({d['automatic_retries']} automatic, "
            f"{d['person_retries']} by a person)",
            f"oldest unfinished           {age(s['oldest_unfinished_age_seconds'])}",
            f"events (24 h)               received {d['received']}, replied {d['replied']}, "
            f"answered by the seller {d['answered_by_seller']}, failed {d['failed']}, "
            f"needs review {d['needs_review']}, resolved {d['resolved']}, ignored {d['ignored']}, "
            f"duplicates {d['duplicates']}",
            *per_account,
        ]
    )


def _account_rows(numbers: list[dict[str, Any]]) -> str:
    rows = [
        (
            f"{n['platform']}:{n['account_id']}",
            n["name"],
            n["state"],
            n["backlog"],
            age(n["receipt_to_reply_p50_seconds"]),
            f"{n['failed_share'] * 100:.1f} %",
            n["retries"],
        )
        for n in numbers
    ]
    return table(rows, ("account", "name", "state", "backlog", "reply p50", "failed", "retries"))


#: ``chatq accounts add`` options that carry a credential: their value is read from a
#: file (``@path``) or standard input (``-``) rather than typed where ``ps`` shows it.
SECRET_OPTIONS = ("bot_token", "webhook_secret", "client_id", "client_secret", "reply_url", "reply_secret")


#: What a credential option must hold (the admin API checks it: shared/credentials.py).
CREDENTIAL_HELP = {
    "webhook_secret": "; generic: a Standard Webhooks key, whsec_ + base64 of 24-64 bytes",
    "reply_url": "; generic (required): where its replies go, http(s)://",
    "reply_secret": "; generic (required): the whsec_ key its replies are signed with",
}


def _secret_value(value: str) -> str:
    if value == "-":
        return sys.stdin.readline().strip()
    if value.startswith("@"):
        try:
            with open(value[1:]) as fh:
                return fh.read().strip()
        except OSError as exc:
            raise CliError(EXIT_USAGE, f"cannot read {value[1:]}: {exc.strerror}") from None
    return value


def _account_ref(ref: str) -> str:
    platform, sep, account_id = ref.partition(":")
    if not sep or not platform or not account_id:
        raise CliError(EXIT_USAGE, "name the account as PLATFORM:ACCOUNT_ID, e.g. avito:123456")
    return f"{quote(platform, safe='')}/{quote(account_id, safe='')}"


def _account_text(a: dict[str, Any]) -> str:
    lines = [
        f"account    {a['platform']}:{a['account_id']}  ({a['name'] or 'no name'})",
        f"state      {a['state']}" + (f" — {a['reason']}" if a.get("reason") else ""),
        f"source     {a['source']}",
        f"webhook    {a['webhook_path']}",
        "credentials " + (", ".join(a["credentials_set"]) or "(the environment's)"),
    ]
    for key, value in a["overrides"].items():
        shown = value if not isinstance(value, str) or len(value) < 60 else value[:57] + "..."
        lines.append(f"override   {key} = {shown}")
    if a.get("numbers"):
        n = a["numbers"]
        lines.append(
            f"numbers    backlog {n['backlog']}, reply p50 {age(n['receipt_to_reply_p50_seconds'])}, "
            f"failed {n['failed_share'] * 100:.1f} %, retries {n['retries']} (24 h)"
        )
    return "\n".join(lines)


def _accounts(api: Api, args: argparse.Namespace) -> str:
    if args.action == "rotate-key":
        r = api.call("POST", "/v1/accounts/rotate-key")
        left = (
            f"; {len(r['unopened'])} no configured key opens: {', '.join(r['unopened'])}"
            if r["unopened"]
            else ""
        )
        return f"sealed {r['resealed']} account(s) again under the first SECRETS_KEY{left}"
    if args.action == "list":
        found = api.call("GET", "/v1/accounts", params={"removed": "true"} if args.removed else None)
        if args.json:
            return json.dumps(found["accounts"], indent=2, ensure_ascii=False)
        rows = [
            (f"{a['platform']}:{a['account_id']}", a["name"], a["state"], a["source"], a["webhook_path"])
            for a in found["accounts"]
        ]
        return (
            table(rows, ("account", "name", "state", "source", "webhook")) + f"\n{found['count']} account(s)"
        )
    if not args.account:
        raise CliError(EXIT_USAGE, f"chatq accounts {args.action} PLATFORM:ACCOUNT_ID")
    path = f"/v1/accounts/{_account_ref(args.account)}"
    if args.action == "add":
        platform, _, account_id = args.account.partition(":")
        credentials = {k: _secret_value(v) for k in SECRET_OPTIONS if (v := getattr(args, k)) is not None}
        overrides: dict[str, Any] = {}
        if args.facts_file:
            try:
                with open(args.facts_file) as fh:
                    overrides["facts"] = fh.read()
            except OSError as exc:
                raise CliError(EXIT_USAGE, f"cannot read {args.facts_file}: {exc.strerror}") from None
        for key in ("llm_model", "prompt", "takeover_seconds", "rate_per_second", "unreadable_messages"):
            if getattr(args, key) is not None:
                overrides[key] = getattr(args, key)
        if args.reply_delay:
            low, _, high = args.reply_delay.partition(",")
            try:
                overrides["reply_delay_min_seconds"] = float(low)
                overrides["reply_delay_max_seconds"] = float(high or low)
            except ValueError:
                raise CliError(EXIT_USAGE, "--reply-delay is MIN,MAX in seconds, e.g. 20,60") from None
        a = api.call(
            "POST",
            "/v1/accounts",
            json={
                "platform": platform,
                "account_id": account_id,
                "name": args.name or f"{platform} {account_id}",
                "credentials": credentials,
                "overrides": overrides,
                **({"continue_history": True} if args.continue_history else {}),
            },
        )
        head = "added" if a.get("created") else "updated"
        return f"{head} {a['platform']}:{a['account_id']}\n{_account_text(a)}"
    if args.action == "show":
        a = api.call("GET", path)
        return json.dumps(a, indent=2, ensure_ascii=False) if args.json else _account_text(a)
    if args.action == "pause":
        if not args.reason:
            raise CliError(EXIT_USAGE, "chatq accounts pause PLATFORM:ACCOUNT_ID --reason WHY")
        a = api.call("POST", f"{path}/pause", json={"reason": args.reason, "by": args.by or "admin"})
        return f"paused {args.account}: its replies wait until it is resumed\n{_account_text(a)}"
    if args.action == "resume":
        a = api.call("POST", f"{path}/resume")
        return f"{args.account}: {a['state']}\n{_account_text(a)}"
    a = api.call("DELETE", path)
    return f"removed {args.account}: its credentials are wiped and its webhooks refused; its record stays"


def _migrate(_: Api | None, args: argparse.Namespace) -> str:
    from shared.migrate import migrate_dsn

    applied = asyncio.run(migrate_dsn(args.settings.database_url.get_secret_value()))
    return f"applied {len(applied)} migration(s)" + (
        f": {applied}" if applied else "; the database is up to date"
    )


def _topology(_: Api | None, args: argparse.Namespace) -> str:
    from shared.broker.topology import build_topology, render_definitions

    text = render_definitions(build_topology(args.settings.retry_delays()), args.vhost)
    if args.output:
        with open(args.output, "w") as fh:
            fh.write(text)
        return f"wrote {args.output}"
    return text.rstrip("\n")


def _connect(_: Api | None, args: argparse.Namespace) -> str:
    from platforms.avito.connect import connect_avito
    from platforms.connect import ConnectError
    from platforms.telegram.connect import connect_telegram

    if args.account:
        # An added account: the receiver connects it with the credentials only it holds.
        token = args.settings.admin_token.get_secret_value() if args.settings.admin_token else None
        api = Api(args.settings.admin_base_url, token)
        ref = _account_ref(f"{args.platform}:{args.account}")
        answer = api.call("POST", f"/v1/accounts/{ref}/connect", json={"disconnect": args.disconnect})
        return str(answer["text"])

    connect = connect_telegram if args.platform == "telegram" else connect_avito

    async def run() -> str:
        async with httpx.AsyncClient(timeout=15) as client:
            return (await connect(args.settings, client, disconnect=args.disconnect)).text

    try:
        return asyncio.run(run())
    except ConnectError as exc:
        code = {"usage": EXIT_USAGE, "refused": EXIT_REFUSED, "unreachable": EXIT_UNREACHABLE}[exc.kind]
        raise CliError(code, str(exc)) from None


def _doctor(_: Api | None, args: argparse.Namespace) -> tuple[str, int]:
    from chatq.doctor import render, run_checks

    checks = asyncio.run(run_checks(args.settings))
    return render(checks), EXIT_REFUSED if any(c.state == "FAIL" for c in checks) else EXIT_OK


def scrub(text: str, secrets: Sequence[str]) -> str:
    """``text`` with every secret replaced by ``***``: nothing chatq prints carries one,
    whatever a platform or library put in a message. (Values under 4 characters would
    mask unrelated text; the production guards refuse any secret under 16.)"""
    for secret in sorted(secrets, key=len, reverse=True):
        if len(secret) >= 4:
            text = text.replace(secret, "***")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="chatq", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--env-file",
        default=DEFAULT_ENV_FILE,
        help="read CHATQ_* settings from this file when it exists, under the environment "
        "(default: .env here, the file make run keeps the development admin token in)",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "status", aliases=["show"], help="one operation: status, reply or error, and its record of events"
    )
    s.add_argument("operation_id")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_status, api=True)
    s = sub.add_parser("list", help="operations, newest first")
    s.add_argument("--status", help="comma-separated, e.g. failed,needs_review")
    s.add_argument("--older-than", help="e.g. 90, 15m, 2h")
    s.add_argument("--account", help="one account's operations: PLATFORM:ACCOUNT_ID")
    s.add_argument("--limit", type=int, default=50)
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_list, api=True)
    s = sub.add_parser("retry", help="put a failed or needs_review operation back to work")
    s.add_argument("operation_id")
    s.add_argument(
        "--resend",
        action="store_true",
        help="needs_review only: you checked the chat and the reply is not there; send one again",
    )
    s.add_argument("--by", help="who decided (recorded with the retry)")
    s.add_argument("--note")
    s.set_defaults(run=_retry, api=True)
    s = sub.add_parser("resolve", help="close a failed or needs_review operation")
    s.add_argument("operation_id")
    s.add_argument("--resolution", choices=["replied_manually", "dismissed"], required=True)
    s.add_argument("--owner", required=True)
    s.add_argument("--note")
    s.set_defaults(run=_resolve, api=True)
    s = sub.add_parser(
        "chats", help="chats the seller holds (they answered in person): list, or hand one back"
    )
    s.add_argument("action", choices=["list", "resume"])
    s.add_argument("chat", nargs="?", help="PLATFORM:ACCOUNT:CHAT (resume)")
    s.add_argument("--account", help="list: one account's chats: PLATFORM:ACCOUNT_ID")
    s.set_defaults(run=_chats, api=True)
    s = sub.add_parser("stats", help="backlog, oldest unfinished, failed share, retries, reply time")
    s.add_argument("--account", help="one account's numbers: PLATFORM:ACCOUNT_ID")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_stats, api=True)
    s = sub.add_parser(
        "accounts", help="the accounts this deployment answers for: add, list, show, pause, ..."
    )
    s.add_argument("action", choices=["add", "list", "show", "pause", "resume", "remove", "rotate-key"])
    s.add_argument(
        "account", nargs="?", help="PLATFORM:ACCOUNT_ID (Telegram: the bot id; Avito: the user_id)"
    )
    s.add_argument("--name")
    for key in SECRET_OPTIONS:
        s.add_argument(
            f"--{key.replace('_', '-')}",
            dest=key,
            help="a value, @FILE, or - (a line of stdin)" + CREDENTIAL_HELP.get(key, ""),
        )
    s.add_argument("--facts-file", help="this account's facts (read now, kept in the database)")
    s.add_argument("--model", dest="llm_model")
    s.add_argument("--prompt")
    s.add_argument("--reply-delay", help="MIN,MAX seconds before a reply")
    s.add_argument("--takeover-seconds", type=float)
    s.add_argument("--rate-per-second", type=float, help="this account's send pace")
    s.add_argument(
        "--unreadable-messages",
        choices=["person", "answer"],
        help="a voice note or file without words: hand it to a person, or let the bot answer it",
    )
    s.add_argument(
        "--continue-history",
        action="store_true",
        help="add: take an id that was removed or is the environment's, with its chats (the same seller only)",
    )
    s.add_argument("--reason", help="pause: why (shown with the account)")
    s.add_argument("--by", help="pause: who")
    s.add_argument("--removed", action="store_true", help="list: removed accounts too")
    s.add_argument("--json", action="store_true")
    s.set_defaults(run=_accounts, api=True)
    s = sub.add_parser("migrate", help="apply pending database migrations")
    s.set_defaults(run=_migrate, api=False)
    s = sub.add_parser("topology", help="broker topology")
    s.add_argument("action", choices=["export"])
    s.add_argument("--vhost", default="/")
    s.add_argument("--output", "-o")
    s.set_defaults(run=_topology, api=False)
    s = sub.add_parser(
        "connect", help="register this deployment's webhook with Telegram or Avito (CHATQ_PUBLIC_URL)"
    )
    s.add_argument("platform", choices=["telegram", "avito"])
    s.add_argument("--disconnect", action="store_true", help="remove this deployment's webhook instead")
    s.add_argument("--account", help="an added account's id (its own webhook, connected by the receiver)")
    s.set_defaults(run=_connect, api=False)
    s = sub.add_parser("doctor", help="check everything buyers' messages need; exit 1 if anything fails")
    s.set_defaults(run=_doctor, api=False)
    return p


def settings_errors(exc: ValidationError) -> list[str]:
    """Each refused setting as ``CHATQ_NAME: why``, without the value it was given."""
    lines = []
    for error in exc.errors(include_input=False, include_url=False):
        loc = error.get("loc") or ()
        why = error.get("msg", "not valid")
        lines.append(
            f"invalid setting CHATQ_{str(loc[0]).upper()}: {why}" if loc else f"invalid settings: {why}"
        )
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    from shared.settings import Settings

    args = parser().parse_args(argv)
    # What goes wrong is in the output and the exit code; libraries' own log lines (a broker
    # client's connection errors, say) would only repeat it.
    logging.basicConfig(level=logging.CRITICAL, format="chatq: %(message)s")
    try:
        args.settings = Settings(_env_file=args.env_file or None)  # type: ignore[call-arg]
    except ValidationError as exc:
        # A usage error like a wrong option (argparse's 2): which setting and why, never
        # its value (it may be a secret), and no traceback.
        for line in settings_errors(exc):
            print(f"chatq: {line}", file=sys.stderr)
        return EXIT_USAGE
    secrets = args.settings.secret_values()
    try:
        api = None
        if args.api:
            token = args.settings.admin_token.get_secret_value() if args.settings.admin_token else None
            api = Api(args.settings.admin_base_url, token)
        out = args.run(api, args)
        text, code = (out, EXIT_OK) if isinstance(out, str) else out
        print(scrub(text, secrets))
        return code
    except CliError as exc:
        print(scrub(f"chatq: {exc}", secrets), file=sys.stderr)
        return exc.code


if __name__ == "__main__":
    sys.exit(main())
