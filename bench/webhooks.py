"""Benchmark: the webhook outbox's cost per event (issue 36, docs/webhooks.md).

Three figures, on a real SQLite file (and with ``--store postgresql://...`` on that
database too; its outbox tables are emptied first, so use a database of its own):

- ``observe_us_per_event``: the event bus's observer (map the event, check the
  webhooks, hand it to the writer's buffer): what a published ``TaskEvent`` costs the
  publishing task;
- ``enqueue_us_per_event``: the writer's store transaction per event (batches of 256,
  one webhook, as the writer makes them), and its CPU;
- ``deliver_ms_per_event`` and ``events_per_s``: ``--events`` events from enqueue to
  acknowledged by a receiver on loopback (a stdlib HTTP server in a thread answering
  204), through the sender: claims, signed POSTs, outcomes recorded; with
  ``store_us_per_event`` the store calls' share.

A server with no webhook pays none of this (no observer, no task). Finishes in well
under a minute by default; prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import http.server
import inspect
import json
import pathlib
import tempfile
import threading
import time
from typing import Any

import trio

from agentserver.agents.clock import SystemClock
from agentserver.agents.edge.hooksign import new_secret
from agentserver.agents.edge.outbox import Channel, Outbox
from agentserver.agents.edge.webhooks import (
    WebhookDirectory,
    Webhooks,
    channel_name,
    render_signed,
)
from agentserver.agents.events import EventBus, TaskEvent
from agentserver.agents.profile.settings import StoreSettings
from agentserver.agents.profile.webhooks import WebhookSpec
from agentserver.agents.store import outbox as store_outbox
from agentserver.agents.store.outbox import OutboxItem


class Sink(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    count = 0
    lock = threading.Lock()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        with Sink.lock:
            Sink.count += 1
        self.send_response(204)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class SinkServer(http.server.ThreadingHTTPServer):
    request_queue_size = 256  # the default 5 resets connections under concurrency


def receiver() -> tuple[http.server.ThreadingHTTPServer, str]:
    server = SinkServer(("127.0.0.1", 0), Sink)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/hook"


class Timed:
    """A store whose outbox calls are timed (their wall time summed)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.seconds = 0.0
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)
        if not name.startswith("outbox_"):
            return fn

        async def timed(*args: Any, **kw: Any) -> Any:
            self.calls[name] = self.calls.get(name, 0) + 1
            t0 = time.perf_counter()
            try:
                return await fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


async def open_store(url: str | None, folder: pathlib.Path) -> Any:
    settings = StoreSettings(path=folder / "agents.sqlite3")
    if url is None:
        from agentserver.agents.store.sqlite_store import SqliteAgentStore

        return SqliteAgentStore.open(settings.path, clock=SystemClock(), settings=settings)
    from agentserver.agents.store.pg.store import PostgresAgentStore

    store = PostgresAgentStore.open(url, clock=SystemClock(), settings=settings)
    if inspect.isawaitable(store):
        store = await store
    from agentserver.agents.store.outbox import MIGRATION

    tables = [ln.split()[2] for ln in MIGRATION.splitlines() if ln.startswith("CREATE TABLE")]

    def empty(tx: Any, env: Any) -> None:
        for table in tables:
            tx.execute(f"DELETE FROM {table}")

    await store.run(empty)  # the bench's own scratch database
    return store


def items(n: int, url: str, tag: str) -> list[OutboxItem]:
    body = json.dumps({"type": "task.succeeded", "data": {"agent": "a", "answer": "x" * 200}})
    return [
        OutboxItem(
            channel=channel_name("bench"),
            url=url,
            body=body.encode(),
            dedupe_key=f"{tag}:{i}",
            order_key=f"bench|conv{i % 50}",
        )
        for i in range(n)
    ]


async def case(url: str | None, events: int, folder: pathlib.Path, sink_url: str) -> dict:
    store = await open_store(url, folder)
    try:
        secret = new_secret()
        from agentserver.agents.edge.hooksign import secret_bytes

        # The observer: a TaskEvent mapped, checked and buffered.
        bus = EventBus()
        directory = WebhookDirectory(store, bus)
        hooks = Webhooks(
            store,
            directory,
            Outbox(store, time.time, directory=directory),
            bus,
            time.time,
            (WebhookSpec("bench", sink_url, ("task.*",), secret),),
        )
        event = TaskEvent("assistant", "turn", "succeeded", "box", "card")
        n_obs = min(events, 10000)
        t0 = time.perf_counter()
        for _ in range(n_obs):
            hooks._observe(event)  # the observer is what is measured
        observe_us = (time.perf_counter() - t0) / n_obs * 1e6

        # The writer's transactions.
        batch = items(events, sink_url, "enq")
        c0, t0 = time.process_time(), time.perf_counter()
        for i in range(0, events, 256):
            await store.run(store_outbox.enqueue, batch[i : i + 256])
        enqueue_us = (time.perf_counter() - t0) / events * 1e6
        enqueue_cpu_us = (time.process_time() - c0) / events * 1e6

        # Delivery: what the enqueue made, through the sender, to the receiver.
        timed = Timed(store)
        outbox = Outbox(timed, time.time)
        outbox.add(
            Channel(
                channel_name("bench"),
                concurrency=16,
                timeout_s=10.0,
                render=render_signed(secret_bytes(secret)),
            )
        )
        Sink.count = 0
        c0, t0 = time.process_time(), time.perf_counter()
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            with trio.fail_after(120):
                while True:  # the receiver's threads count: polled
                    if Sink.count >= events and outbox.figures.delivered >= events:
                        break
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
        wall = time.perf_counter() - t0
        last_errors = [f.last_error for f in await store.read(store_outbox.figures) if f.last_error]
        return {
            "events": events,
            "observe_us_per_event": round(observe_us, 2),
            "enqueue_us_per_event": round(enqueue_us, 1),
            "enqueue_cpu_us_per_event": round(enqueue_cpu_us, 1),
            "deliver_ms_per_event": round(wall / events * 1e3, 3),
            "events_per_s": round(events / wall, 1),
            "store_us_per_event": round(timed.seconds / events * 1e6, 1),
            "sender_cpu_ms_per_event": round((time.process_time() - c0) / events * 1e3, 3),
            "attempts": outbox.figures.attempts,
            "store_calls": timed.calls,
            "last_error": last_errors[0] if last_errors else None,
        }
    finally:
        await store.aclose()


async def run(args: argparse.Namespace) -> dict:
    server, sink_url = receiver()
    try:
        out: dict[str, Any] = {"bench": "webhooks"}
        with tempfile.TemporaryDirectory() as tmp:
            out["sqlite"] = await case(None, args.events, pathlib.Path(tmp), sink_url)
        if args.store:
            with tempfile.TemporaryDirectory() as tmp:
                out["postgresql"] = await case(args.store, args.events, pathlib.Path(tmp), sink_url)
        return out
    finally:
        server.shutdown()
        server.server_close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=2000, help="events per case (default 2000)")
    ap.add_argument("--store", help="also on this PostgreSQL database (its outbox emptied)")
    args = ap.parse_args()
    print(json.dumps(trio.run(run, args)))


if __name__ == "__main__":
    main()
