"""A scripted stand-in for an LLM: a tiny OpenAI-compatible chat-completions server, so
the example runs with no API key and no network.

    python scripted_model.py [--port PORT]   (default: $SCRIPTED_MODEL_PORT, else 8399)

It prints ``scripted model on http://127.0.0.1:PORT/v1`` and answers every
``POST /v1/chat/completions`` by rule, streaming its reply word by word (SSE, with
``"stream": true``; the words a little apart, so a page shows them arrive):

1. the conversation holds the booking's answer (``<booked>``): say it is done;
2. it holds a failed call (the booking was denied): say it was not booked;
3. else: book what the task asks, by replying with the tool's payload,
   ``<book xmlns="urn:example:tables"><what>…</what></book>``.

Standard library only (it is a stand-in process, not part of the server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BOOKED = re.compile(r"<booked\b.*?<text>(?P<text>.*?)</text>", re.S)
#: Seconds between two streamed words.
PACE = float(os.environ.get("SCRIPTED_MODEL_PACE") or 0.05)


def decide(messages: list[dict]) -> str:
    """The scripted model's reply to a conversation."""
    last = str(messages[-1].get("content", "")) if messages else ""
    found = BOOKED.search(last)
    if found:
        return f"Done: {found['text'].strip()}."
    if "failed" in last:
        return "I did not book it: the booking was not approved."
    task = re.sub(r"<[^>]*>", " ", last)
    what = " ".join(task.split()) or "a table"
    return f'Booking it now. <book xmlns="urn:example:tables"><what>{_escape(what)}</what></book>'


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def pieces(text: str) -> list[str]:
    """The reply in streamed pieces: words (the tool's payload in one piece)."""
    head, sep, payload = text.partition("<book")
    words = head.split(" ")
    out = [w if i == 0 else " " + w for i, w in enumerate(words)]
    return [p for p in out if p] + ([sep + payload] if sep else [])


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        if not self.path.rstrip("/").endswith("/chat/completions"):
            self.send_error(404)
            return
        length = int(self.headers.get("content-length") or 0)
        request = json.loads(self.rfile.read(length) or b"{}")
        content = decide(request.get("messages") or [])
        model = request.get("model") or "scripted"
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        if request.get("stream"):
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            for piece in pieces(content):
                self._event(
                    {"model": model, "choices": [{"index": 0, "delta": {"content": piece}}]}
                )
                time.sleep(PACE)
            self._event(
                {"model": model, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            )
            self._event({"model": model, "choices": [], "usage": usage})
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True
            return
        body = json.dumps(
            {
                "id": "chatcmpl-scripted",
                "object": "chat.completion",
                "created": 0,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": usage,
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _event(self, data: dict) -> None:
        self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        pass  # quiet: the server's own log tells the story


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default = int(os.environ.get("SCRIPTED_MODEL_PORT") or 8399)
    parser.add_argument("--port", type=int, default=default, help="0 picks a free port")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    # SIGTERM (a service manager, a test) stops it cleanly, like Ctrl-C.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"scripted model on http://127.0.0.1:{server.server_port}/v1", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
