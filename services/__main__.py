"""``python -m services``: run the whole pipeline in the foreground, one child process per
service, their logs interleaved on this terminal. Ctrl-C (or SIGTERM) is passed to every
service, which drains (stops consuming, finishes and acknowledges in-flight work) and
exits; a second Ctrl-C kills them at once.

``--env-file PATH`` (``make run`` passes ``.env``) reads the seller's settings from that
file, under the environment, and keeps the development admin token in it, so
credentials and the token survive a restart."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from chatq.envfile import merged_environment, stored_admin_token
from shared.settings import Settings

SERVICES = ("receiver", "coalescer", "responder")


def child_environment(
    settings: Settings, environ: Mapping[str, str], env_file: str | None
) -> tuple[dict[str, str], str | None]:
    """The services' environment (``environ`` over the env file's settings), and the
    development admin token when this run provides it: for local development only (never
    a default, never under the production guards), made once and kept in the env file."""
    env = merged_environment(environ, env_file)
    if environ.get("CHATQ_ADMIN_TOKEN") or settings.production_guards or not env_file:
        return env, None
    token = stored_admin_token(env_file)
    env["CHATQ_ADMIN_TOKEN"] = token
    return env, token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services", description=__doc__)
    parser.add_argument(
        "--env-file",
        help="read CHATQ_* settings from this file (the environment wins) and keep the token in it",
    )
    args = parser.parse_args(argv)
    # The settings every service parses: what they would refuse is refused before any starts.
    settings = Settings(_env_file=args.env_file)  # type: ignore[call-arg]
    env, generated_token = child_environment(settings, os.environ, args.env_file)
    # The pages are on the admin port when there is one, else with the webhooks.
    port = settings.admin_port or settings.http_port
    base_metrics = settings.metrics_port
    children: dict[str, subprocess.Popen[bytes]] = {}
    # The receiver migrates first; the others start once it answers (or 20 s pass).
    for i, name in enumerate(SERVICES):
        child_env = dict(env)
        child_env["CHATQ_METRICS_PORT"] = str(base_metrics + i)
        children[name] = subprocess.Popen([sys.executable, "-m", f"services.{name}"], env=child_env)
        if i == 0:
            time.sleep(1.5)
    if generated_token is not None:
        token_note = f"admin token: {generated_token}, kept in {args.env_file}"
    elif settings.admin_token is not None:
        token_note = "admin token: CHATQ_ADMIN_TOKEN"
    else:
        token_note = "admin API off: set CHATQ_ADMIN_TOKEN"
    sandbox = f"Sandbox chat: http://127.0.0.1:{port}/sandbox\n" if settings.sandbox_active else ""
    print(
        f"\nchatqueue is starting. {sandbox}"
        f"Operations page: http://127.0.0.1:{port}/ops ({token_note})\n"
        "Ctrl-C drains and stops everything.\n",
        file=sys.stderr,
        flush=True,
    )
    stopping = False

    def forward(sig: int, _frame: object) -> None:
        nonlocal stopping
        if stopping:
            for child in children.values():
                child.kill()
            return
        stopping = True
        print("\nstopping: every service drains its in-flight work (Ctrl-C again to kill)", file=sys.stderr)
        for child in children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    exit_code = 0
    while children:
        for name, child in list(children.items()):
            code = child.poll()
            if code is None:
                continue
            del children[name]
            if not stopping:
                print(f"{name} exited with {code}; stopping the others", file=sys.stderr)
                exit_code = code or 1
                forward(signal.SIGTERM, None)
        time.sleep(0.2)
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
