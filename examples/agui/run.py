"""An AG-UI run from the command line: posts AG-UI's ``RunAgentInput`` to the server's
``/agui/agents/assistant`` and prints the run's events as they come, one line each (the
text of each message once it ended). An approval interrupt is answered by a second run
that resumes it, with ``--approve`` (or ``--deny``).

    python run.py [--approve | --deny] [--thread ID] TEXT
    (the server: $AGENTSERVER_HTTP_URL else http://127.0.0.1:7471; the token:
     $AGUI_ALICE_TOKEN)

Standard library only: the AG-UI wire is JSON lines over Server-Sent Events.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request

#: What was printed (message, tool call and result ids): a run resuming another begins
#: with a snapshot of the conversation, of which only what is new is printed.
PRINTED: set[str] = set()


def show(key: str, line: str) -> None:
    if key not in PRINTED:
        PRINTED.add(key)
        print(line)


def run(url: str, token: str, body: dict) -> list[dict]:
    """Post one run; print its events; return the interrupts it ended with."""
    request = urllib.request.Request(
        url,
        json.dumps(body).encode(),
        {
            "content-type": "application/json",
            "accept": "text/event-stream",
            "authorization": f"Bearer {token}",
        },
    )
    texts: dict[str, str] = {}
    interrupts: list[dict] = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode("utf-8").rstrip("\n")
            if not line.startswith("data: "):
                continue
            event = json.loads(line[len("data: ") :])
            kind = event["type"]
            if kind == "RUN_STARTED":
                print(f"run {event['runId']} started")
            elif kind == "TEXT_MESSAGE_CONTENT":
                texts[event["messageId"]] = texts.get(event["messageId"], "") + event["delta"]
            elif kind == "TEXT_MESSAGE_END":
                show(event["messageId"], f"assistant: {texts.get(event['messageId'], '')}")
            elif kind == "TOOL_CALL_START":
                show(event["toolCallId"], f"tool call: {event['toolCallName']}")
            elif kind == "TOOL_CALL_RESULT":
                show(event["messageId"], f"tool result: {event['content']}")
            elif kind == "MESSAGES_SNAPSHOT":
                for message in event["messages"]:
                    if message["role"] == "assistant":
                        if message.get("content"):
                            show(message["id"], f"assistant: {message['content']}")
                        for call in message.get("toolCalls") or []:
                            show(call["id"], f"tool call: {call['function']['name']}")
                    elif message["role"] == "tool":
                        show(message["id"], f"tool result: {message['content']}")
            elif kind == "RUN_FINISHED":
                outcome = event.get("outcome") or {"type": "success"}
                if outcome["type"] == "interrupt":
                    interrupts = outcome["interrupts"]
                    for interrupt in interrupts:
                        print(f"interrupt: {interrupt['message']}")
                else:
                    answer = (event.get("result") or {}).get("answer", "")
                    print(f"finished ({outcome['type']}): {answer}")
            elif kind == "RUN_ERROR":
                print(f"error: {event['message']}")
    return interrupts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("text")
    choice = parser.add_mutually_exclusive_group()
    choice.add_argument("--approve", action="store_true")
    choice.add_argument("--deny", action="store_true")
    parser.add_argument("--thread", default="example-thread")
    args = parser.parse_args(argv)
    base = os.environ.get("AGENTSERVER_HTTP_URL") or "http://127.0.0.1:7471"
    url = base.rstrip("/") + "/agui/agents/assistant"
    token = os.environ.get("AGUI_ALICE_TOKEN", "")
    message = {"id": "m-1", "role": "user", "content": args.text}
    body = {"threadId": args.thread, "runId": "run-1", "messages": [message]}
    interrupts = run(url, token, body)
    if interrupts and (args.approve or args.deny):
        resume = [
            {"interruptId": i["id"], "status": "resolved", "payload": {"grant": args.approve}}
            for i in interrupts
        ]
        run(
            url,
            token,
            {"threadId": args.thread, "runId": "run-2", "messages": [], "resume": resume},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
