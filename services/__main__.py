"""``python -m services``: run the whole pipeline in the foreground, one child process per
service, their logs interleaved on this terminal. Ctrl-C (or SIGTERM) is passed to every
service, which drains (stops consuming, finishes and acknowledges in-flight work) and
exits; a second Ctrl-C kills them at once."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time

SERVICES = ("receiver", "coalescer", "responder")


def main() -> int:
    env = dict(os.environ)
    if not env.get("CHATQ_ADMIN_TOKEN") and env.get("CHATQ_ENV", "development") == "development":
        # Local development only: a fresh token per run, printed below, never a default.
        env["CHATQ_ADMIN_TOKEN"] = secrets.token_urlsafe(12)
    port = env.get("CHATQ_HTTP_PORT", "8080")
    base_metrics = int(env.get("CHATQ_METRICS_PORT", "9100"))
    children: dict[str, subprocess.Popen[bytes]] = {}
    # The receiver migrates first; the others start once it answers (or 20 s pass).
    for i, name in enumerate(SERVICES):
        child_env = dict(env)
        child_env["CHATQ_METRICS_PORT"] = str(base_metrics + i)
        children[name] = subprocess.Popen([sys.executable, "-m", f"services.{name}"], env=child_env)
        if i == 0:
            time.sleep(1.5)
    print(
        f"\nchatqueue is starting. Sandbox chat: http://127.0.0.1:{port}/sandbox\n"
        f"Operations page: http://127.0.0.1:{port}/ops (admin token: {env['CHATQ_ADMIN_TOKEN']})\n"
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
