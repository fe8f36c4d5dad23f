"""The platform client's micro-measurement: httpx.AsyncClient against aiohttp posting a
Telegram sendMessage to a trivial uvicorn endpoint (another process) with N requests in
flight, alternating rounds in one run; req/s and the client's CPU per request.

Usage: python -m bench.http_clients [--in-flight 32] [--seconds 5] [--rounds 3]
Why the responder sends through aiohttp (platforms/http.py).
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
import httpx
from fastapi import FastAPI

BODY = {"chat_id": 1, "text": "Thanks for your message! Yes, it is available; we deliver within 2 days."}

app = FastAPI()


@app.post("/bot{token}/sendMessage")
async def send_message(token: str) -> dict[str, object]:
    return {"ok": True, "result": {"message_id": 1}}


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def drive(post: Callable[[], Awaitable[None]], in_flight: int, seconds: float) -> tuple[float, float]:
    """(req/s, client CPU ms per request)."""
    done = 0
    stop = time.monotonic() + seconds

    async def worker() -> None:
        nonlocal done
        while time.monotonic() < stop:
            await post()
            done += 1

    cpu, started = cpu_seconds(), time.monotonic()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return done / (time.monotonic() - started), (cpu_seconds() - cpu) * 1000 / max(done, 1)


async def measure(url: str, args: argparse.Namespace) -> dict[str, list[tuple[float, float]]]:
    hx = httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=2 * args.in_flight))
    ah = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=10), connector=aiohttp.TCPConnector(limit=2 * args.in_flight)
    )

    async def with_httpx() -> None:
        r = await hx.post(url, json=BODY)
        r.raise_for_status()
        r.json()

    async def with_aiohttp() -> None:
        async with ah.post(url, json=BODY) as r:
            r.raise_for_status()
            await r.json()

    results: dict[str, list[tuple[float, float]]] = {"httpx": [], "aiohttp": []}
    try:
        await drive(with_httpx, 4, 1)  # warm-up
        await drive(with_aiohttp, 4, 1)
        for _ in range(args.rounds):
            results["httpx"].append(await drive(with_httpx, args.in_flight, args.seconds))
            results["aiohttp"].append(await drive(with_aiohttp, args.in_flight, args.seconds))
    finally:
        await hx.aclose()
        await ah.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "bench.http_clients:app",
            "--port",
            str(port),
            "--log-level",
            "warning",
            "--no-access-log",
        ]
    )
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/docs")
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        results = asyncio.run(measure(f"http://127.0.0.1:{port}/bot1:x/sendMessage", args))
    finally:
        server.terminate()
        server.wait()
    for name, rounds in results.items():
        shown = ", ".join(f"{rps:.0f} req/s ({ms:.2f} ms CPU/req)" for rps, ms in rounds)
        print(f"{name:8} {args.in_flight} in flight: {shown}")
    ratio = statistics.median(r for r, _ in results["aiohttp"]) / statistics.median(
        r for r, _ in results["httpx"]
    )
    print(f"aiohttp / httpx, median req/s: {ratio:.1f}x")


if __name__ == "__main__":
    main()
