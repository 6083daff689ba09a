"""A scripted stand-in for an LLM: a tiny OpenAI-compatible chat-completions server, so
the example runs with no API key and no network.

    python scripted_model.py [--port PORT]   (default: $SCRIPTED_MODEL_PORT, else 8399)

It prints ``scripted model on http://127.0.0.1:PORT/v1`` and answers every
``POST /v1/chat/completions`` (plain JSON, or SSE with ``"stream": true``) by rule:

1. the conversation holds the text of a note (``notes-read_note``'s result): answer with
   it, in plain text;
2. else, it holds the list of notes (``notes-list_notes``'s result): read the first one,
   ``<read_note xmlns="urn:agentserver:mcp:notes"><name>ideas.txt</name></read_note>``;
3. else: list the notes, ``<list_notes xmlns="urn:agentserver:mcp:notes"/>``.

Standard library only (it is a stand-in process, not part of the server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NOTES = "urn:agentserver:mcp:notes"
RESULT = re.compile(
    r'<result [^>]*tool="notes-(?P<tool>[a-z_]+)"[^>]*>\s*<text>(?P<text>[^<]*)</text>'
)


def decide(messages: list[dict]) -> str:
    """The scripted model's reply to a conversation."""
    everything = "\n".join(str(m.get("content", "")) for m in messages)
    results = {m["tool"]: m["text"] for m in RESULT.finditer(everything)}
    if "read_note" in results:
        # (the last call: the instructions' example comes first)
        names = re.findall(r"<read_note [^>]*><name>([^<]*)</name>", everything)
        lines = "; ".join(results["read_note"].strip().splitlines())
        return f"{names[-1] if names else 'The note'} says: {lines}"
    if "list_notes" in results:
        first = results["list_notes"].split()[0]
        return f'<read_note xmlns="{NOTES}"><name>{first}</name></read_note>'
    return f'<list_notes xmlns="{NOTES}"/>'


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
            for piece in (content[: len(content) // 2], content[len(content) // 2 :]):
                self._event(
                    {"model": model, "choices": [{"index": 0, "delta": {"content": piece}}]}
                )
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
