"""A webhook receiver for the tests: a real HTTP server on loopback (stdlib
``ThreadingHTTPServer`` in a thread), with a behaviour (fail the first N deliveries,
hang, answer 200), recording every request it got; stoppable and restartable on the
same port (a receiver killed and started again). Helpers, not tests."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Got:
    headers: dict[str, str]
    body: bytes
    at: float
    status: int

    @property
    def id(self) -> str:
        return self.headers.get("webhook-id", "")

    @property
    def payload(self) -> dict[str, Any]:
        return json.loads(self.body)


@dataclass
class Receiver:
    """``fail_first``: answer 500 to that many requests; ``hang``: never answer (hold
    the connection ``hang_s``); every request is recorded in ``got`` (with the status it
    was answered with)."""

    fail_first: int = 0
    hang: bool = False
    hang_s: float = 30.0
    port: int = 0
    got: list[Got] = field(default_factory=list)
    conns: set[socket.socket] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)
    _server: http.server.ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def start(self) -> Receiver:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                with receiver.lock:
                    receiver.conns.add(self.connection)

            def finish(self) -> None:
                with receiver.lock:
                    receiver.conns.discard(self.connection)
                super().finish()

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                headers = {k.lower(): v for k, v in self.headers.items()}
                if receiver.hang:
                    with receiver.lock:  # recorded as an attempt never answered
                        receiver.got.append(Got(headers, body, time.time(), 0))
                    time.sleep(receiver.hang_s)
                    return
                with receiver.lock:
                    failed = sum(1 for g in receiver.got if g.status >= 500)
                    status = 500 if failed < receiver.fail_first else 200
                    receiver.got.append(Got(headers, body, time.time(), status))
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: object) -> None:
                pass

        class Server(http.server.ThreadingHTTPServer):
            allow_reuse_address = True
            request_queue_size = 256  # the default 5 resets connections under concurrency

        server = Server(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Kill it: stop serving and close the listening socket (refused from now on)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        with self.lock:
            conns, self.conns = list(self.conns), set()
        for conn in conns:  # its open connections die with it
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def ok(self) -> list[Got]:
        with self.lock:
            return [g for g in self.got if 200 <= g.status < 300]

    def ids(self) -> set[str]:
        return {g.id for g in self.ok()}
