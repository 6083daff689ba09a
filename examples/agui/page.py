"""Serves the example's page (index.html, app.js) and passes its AG-UI requests on to
the agent server, so the page and the API share one origin (the server sends no CORS
headers: a page of another origin cannot call it, which is what keeps other sites' pages
away from a local server's agents).

    python page.py [--port PORT] [--server URL]
    (defaults: $AGUI_PAGE_PORT else 7472; $AGENTSERVER_HTTP_URL else http://127.0.0.1:7471)

It prints ``agui page on http://127.0.0.1:PORT/``. ``POST /agui/...`` is forwarded as it
came (body and ``Authorization`` header) and the answer streamed back line by line, as
the server sends it. Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import os
import pathlib
import signal
import sys
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HERE = pathlib.Path(__file__).parent
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/index.html": ("index.html", "text/html; charset=utf-8"),
    "/app.js": ("app.js", "text/javascript; charset=utf-8"),
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_url = "http://127.0.0.1:7471"

    def do_GET(self) -> None:
        found = FILES.get(self.path.split("?")[0])
        if found is None:
            self.send_error(404)
            return
        body = (HERE / found[0]).read_bytes()
        self.send_response(200)
        self.send_header("content-type", found[1])
        self.send_header("content-length", str(len(body)))
        # The page runs its own script only, and talks to its own origin only.
        self.send_header(
            "content-security-policy",
            "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'",
        )
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if not self.path.startswith("/agui/"):
            self.send_error(404)
            return
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length)
        target = urllib.parse.urlsplit(self.server_url)
        upstream = http.client.HTTPConnection(target.hostname, target.port, timeout=300)
        headers = {"content-type": "application/json", "accept": "text/event-stream"}
        if self.headers.get("authorization"):
            headers["authorization"] = self.headers["authorization"]
        upstream.request("POST", self.path, body, headers)
        answer = upstream.getresponse()
        self.send_response(answer.status)
        self.send_header("content-type", answer.getheader("content-type") or "text/plain")
        self.send_header("cache-control", "no-cache")
        self.send_header("connection", "close")
        self.end_headers()
        # Line by line: each event reaches the page as soon as the server sent it.
        while line := answer.readline():
            self.wfile.write(line)
            self.wfile.flush()
        upstream.close()
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("AGUI_PAGE_PORT") or 7472))
    parser.add_argument(
        "--server", default=os.environ.get("AGENTSERVER_HTTP_URL") or "http://127.0.0.1:7471"
    )
    args = parser.parse_args(argv)
    Handler.server_url = args.server.rstrip("/")
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"agui page on http://127.0.0.1:{server.server_port}/", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
