"""The official A2A SDK's own client (asyncio, httpx), run as a separate process by
tests/test_a2a_expose.py against our real server.

    python tests/a2a_sdk_client.py URL TOKEN COMMAND [ARG...]

TOKEN ``-`` sends none. Each result is one JSON line on standard output (a streaming
command prints one line per event, flushed, so the test can kill it mid-stream); an A2A
error is ``{"error": CLASS, "message": TEXT}``. Commands: ``card``, ``send TEXT [CONTEXT]
[SKILL]``, ``send-now TEXT [CONTEXT] [SKILL]``, ``stream TEXT``, ``get TASK [HISTORY]``,
``list [CONTEXT [STATUS [PAGE_SIZE [TOKEN]]]]``, ``cancel TASK``, ``subscribe TASK``, ``answer TASK GRANT``,
``extended``, ``agent-card NAME`` (the agent's own card, then a send through it: TEXT),
``send-push TEXT URL TOKEN``, ``push-set TASK URL TOKEN``, ``push-get TASK ID``,
``push-list TASK``, ``push-delete TASK ID``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

import httpx
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.types import (
    CancelTaskRequest,
    DeleteTaskPushNotificationConfigRequest,
    GetExtendedAgentCardRequest,
    GetTaskPushNotificationConfigRequest,
    GetTaskRequest,
    ListTaskPushNotificationConfigsRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    SubscribeToTaskRequest,
    TaskPushNotificationConfig,
    TaskState,
)
from a2a.utils.errors import A2AError
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.struct_pb2 import Struct, Value


def out(value: object) -> None:
    print(json.dumps(value), flush=True)


def message(text: str, context: str = "", skill: str = "") -> Message:
    msg = Message(message_id=str(uuid.uuid4()), role=Role.ROLE_USER, parts=[Part(text=text)])
    if context:
        msg.context_id = context
    if skill:
        meta = Struct()
        meta.update({"skill": skill})
        msg.metadata.CopyFrom(meta)
    return msg


async def main(url: str, token: str, command: str, *args: str) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token != "-" else {}
    async with httpx.AsyncClient(headers=headers, timeout=60) as http:
        card_path = "/.well-known/agent-card.json"
        if command == "agent-card":
            card_path = f"/a2a/agents/{args[0]}/agent-card.json"
        card = await A2ACardResolver(http, url, agent_card_path=card_path).get_agent_card()
        if command in ("card", "agent-card"):
            out(MessageToDict(card))
            if command == "card":
                return
        streaming = command in ("stream", "subscribe")
        client = ClientFactory(ClientConfig(httpx_client=http, streaming=streaming)).create(card)
        try:
            if command in ("send", "send-now", "agent-card"):
                text = args[1] if command == "agent-card" else args[0]
                rest = list(args[1:]) if command != "agent-card" else []
                request = SendMessageRequest(
                    message=message(text, *rest),
                    configuration=SendMessageConfiguration(
                        return_immediately=command == "send-now"
                    ),
                )
                async for event in client.send_message(request):
                    out(MessageToDict(event))
            elif command == "stream":
                request = SendMessageRequest(message=message(args[0]))
                async for event in client.send_message(request):
                    out(MessageToDict(event))
            elif command == "subscribe":
                async for event in client.subscribe(SubscribeToTaskRequest(id=args[0])):
                    out(MessageToDict(event))
            elif command == "get":
                request = GetTaskRequest(id=args[0])
                if len(args) > 1:
                    request.history_length = int(args[1])
                out(MessageToDict(await client.get_task(request)))
            elif command == "list":  # [CONTEXT [STATUS [PAGE_SIZE [PAGE_TOKEN]]]]
                context, status, size, token = (*args, "", "", "", "")[:4]
                request = ListTasksRequest(context_id=context, page_token=token)
                if status:
                    request.status = TaskState.Value(status)
                if size:
                    request.page_size = int(size)
                out(MessageToDict(await client.list_tasks(request)))
            elif command == "cancel":
                out(MessageToDict(await client.cancel_task(CancelTaskRequest(id=args[0]))))
            elif command == "answer":
                data = ParseDict({"grant": args[1] == "true", "reason": "ok"}, Value())
                msg = Message(
                    message_id=str(uuid.uuid4()),
                    role=Role.ROLE_USER,
                    task_id=args[0],
                    parts=[Part(data=data)],
                )
                request = SendMessageRequest(
                    message=msg,
                    configuration=SendMessageConfiguration(return_immediately=True),
                )
                async for event in client.send_message(request):
                    out(MessageToDict(event))
            elif command == "send-push":
                config = TaskPushNotificationConfig(url=args[1], token=args[2])
                request = SendMessageRequest(
                    message=message(args[0], "", "assistant"),
                    configuration=SendMessageConfiguration(task_push_notification_config=config),
                )
                async for event in client.send_message(request):
                    out(MessageToDict(event))
            elif command == "push-set":
                config = TaskPushNotificationConfig(task_id=args[0], url=args[1], token=args[2])
                out(MessageToDict(await client.create_task_push_notification_config(config)))
            elif command == "push-get":
                request = GetTaskPushNotificationConfigRequest(task_id=args[0], id=args[1])
                out(MessageToDict(await client.get_task_push_notification_config(request)))
            elif command == "push-list":
                request = ListTaskPushNotificationConfigsRequest(task_id=args[0])
                out(MessageToDict(await client.list_task_push_notification_configs(request)))
            elif command == "push-delete":
                request = DeleteTaskPushNotificationConfigRequest(task_id=args[0], id=args[1])
                await client.delete_task_push_notification_config(request)
                out({"deleted": args[1]})
            elif command == "extended":
                card = await client.get_extended_agent_card(GetExtendedAgentCardRequest())
                out(MessageToDict(card))
            else:
                raise SystemExit(f"unknown command {command!r}")
        except A2AError as exc:
            out({"error": type(exc).__name__, "message": str(exc)})


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
