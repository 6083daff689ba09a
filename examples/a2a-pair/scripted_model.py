"""A scripted stand-in for an LLM: a tiny OpenAI-compatible chat-completions server, so
the example runs with no API key and no network. Both servers of the example think with
it.

    python scripted_model.py [--port PORT]   (default: $SCRIPTED_MODEL_PORT, else 8399)

It prints ``scripted model on http://127.0.0.1:PORT/v1`` and answers every
``POST /v1/chat/completions`` (plain JSON, or SSE with ``"stream": true``) by rule:

1. the conversation holds the helpers' answer (``helpers-assistant``'s
   ``<answer xmlns="urn:agentserver:a2a">``): report it, in plain text;
2. else, the task asks to "ask the helpers": call the remote agent over A2A,
   ``<assistant xmlns="urn:agentserver:a2a:helpers"><text>...</text></assistant>``;
3. else (the helpers' own agent, asked a question): answer it.

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

HELPERS = "urn:agentserver:a2a:helpers"
ANSWER = re.compile(r'<answer xmlns="urn:agentserver:a2a"[^>]*>\s*<text>(?P<text>[^<]*)</text>')
CAPITALS = {"france": "Paris", "italy": "Rome", "japan": "Tokyo"}


def decide(messages: list[dict]) -> str:
    """The scripted model's reply to a conversation."""
    # (not the system prompt: its usage instructions show the payloads)
    everything = "\n".join(str(m.get("content", "")) for m in messages[1:])
    task = str(messages[-1].get("content", "")) if messages else ""
    answered = ANSWER.search(everything)
    if answered:
        return f"The helpers say: {answered.group('text').strip()}"
    asked = re.search(r"ask the helpers (?:about|for) (\w+)", everything)
    if asked:
        question = f"What is the capital of {asked.group(1).capitalize()}?"
        return f'<assistant xmlns="{HELPERS}"><text>{question}</text></assistant>'
    country = next((c for c in CAPITALS if c in task.lower()), None)
    if country:
        return f"The capital of {country.capitalize()} is {CAPITALS[country]}."
    return "I do not know."


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
