"""An A2A 0.3 client: the official SDK at 0.3 (``a2a-sdk==0.3.26``, pydantic types,
asyncio), run by tests/test_a2a_v03.py as a separate process with the interpreter of a
virtual environment of its own (the project's is at 1.x).

    python tests/a2a_v03_client.py URL TOKEN COMMAND [ARG...]

TOKEN ``-`` sends none. Each result is one JSON line on standard output (the SDK's 0.3
models dumped by alias: ``kind``, camelCase; a stream prints one line per event); an A2A
error is ``{"error": CODE, "message": TEXT}``. Commands: ``card``, ``send TEXT SKILL
[CONTEXT]`` (blocking), ``send-now TEXT SKILL``, ``stream TEXT SKILL``, ``get TASK
[HISTORY]``, ``send-push TEXT SKILL URL TOKEN`` (not blocking, a push config on the
message), ``cancel TASK``, ``resubscribe TASK``, ``answer TASK GRANT``, ``push-set
TASK URL TOKEN``, ``push-get TASK ID``; and, where the 0.3 client has no method,
``raw METHOD PARAMS-JSON [A2A-VERSION]``: a plain JSON-RPC request (``-`` as the
version sends no ``A2A-Version`` header), whose answer is printed as it came.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.errors import A2AClientJSONRPCError
from a2a.types import (
    DataPart,
    GetTaskPushNotificationConfigParams,
    Message,
    MessageSendConfiguration,
    Part,
    PushNotificationConfig,
    Role,
    TaskIdParams,
    TaskPushNotificationConfig,
    TaskQueryParams,
    TextPart,
)


def out(value: object) -> None:
    print(json.dumps(value), flush=True)


def dump(model: object) -> dict:
    return model.model_dump(mode="json", by_alias=True, exclude_none=True)  # type: ignore[attr-defined]


def message(text: str, skill: str, context: str = "") -> Message:
    return Message(
        message_id=str(uuid.uuid4()),
        role=Role.user,
        parts=[Part(root=TextPart(text=text))],
        metadata={"skill": skill},
        context_id=context or None,
    )


async def main(url: str, token: str, command: str, *args: str) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token != "-" else {}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        if command == "raw":
            method, params = args[0], json.loads(args[1])
            version = args[2] if len(args) > 2 else "-"
            extra = {"A2A-Version": version} if version != "-" else {}
            body = {"jsonrpc": "2.0", "id": 7, "method": method, "params": params}
            response = await http.post(url + "/a2a", json=body, headers=extra)
            out({"status": response.status_code, "body": response.json()})
            return
        card = await A2ACardResolver(http, url).get_agent_card()
        if command == "card":
            out(dump(card))
            return
        streaming = command in ("stream", "resubscribe")
        client = ClientFactory(ClientConfig(httpx_client=http, streaming=streaming)).create(card)
        try:
            if command in ("send", "send-now", "stream"):
                configuration = (
                    MessageSendConfiguration(blocking=False) if command == "send-now" else None
                )
                async for event in client.send_message(message(*args), configuration=configuration):
                    if isinstance(event, tuple):
                        task, update = event
                        out(dump(update) if update is not None else dump(task))
                    else:
                        out(dump(event))
            elif command == "send-push":
                configuration = MessageSendConfiguration(
                    blocking=False,
                    push_notification_config=PushNotificationConfig(url=args[2], token=args[3]),
                )
                async for event in client.send_message(
                    message(args[0], args[1]), configuration=configuration
                ):
                    out(dump(event[0]) if isinstance(event, tuple) else dump(event))
            elif command == "get":
                query = TaskQueryParams(id=args[0])
                if len(args) > 1:
                    query.history_length = int(args[1])
                out(dump(await client.get_task(query)))
            elif command == "cancel":
                out(dump(await client.cancel_task(TaskIdParams(id=args[0]))))
            elif command == "resubscribe":
                async for task, update in client.resubscribe(TaskIdParams(id=args[0])):
                    out(dump(update) if update is not None else dump(task))
            elif command == "answer":
                answer = Message(
                    message_id=str(uuid.uuid4()),
                    role=Role.user,
                    task_id=args[0],
                    parts=[Part(root=DataPart(data={"grant": args[1] == "true", "reason": "ok"}))],
                )
                configuration = MessageSendConfiguration(blocking=False)
                async for event in client.send_message(answer, configuration=configuration):
                    out(dump(event[0]) if isinstance(event, tuple) else dump(event))
            elif command == "push-set":
                config = TaskPushNotificationConfig(
                    task_id=args[0],
                    push_notification_config=PushNotificationConfig(url=args[1], token=args[2]),
                )
                out(dump(await client.set_task_callback(config)))
            elif command == "push-get":
                params = GetTaskPushNotificationConfigParams(
                    id=args[0], push_notification_config_id=args[1]
                )
                out(dump(await client.get_task_callback(params)))
            else:
                raise SystemExit(f"unknown command {command!r}")
        except A2AClientJSONRPCError as exc:
            out({"error": exc.error.code, "message": exc.error.message})


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
