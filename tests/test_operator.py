"""Stop and cancel from outside: the real server, the CLI, a scripted model on loopback."""

from __future__ import annotations

import trio
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import REPO, ServerProcess, cli, subprocess_env

from agentserver.core.threads import new_thread_id
from agentserver.listeners.assistant import Task
from agentserver.net.client import open_client


class SlowOnRequest(FakeServer):
    """Answers at once, except a task saying "slow": that answer would take 600 s, longer
    than the agent's ``llm-timeout`` (300 s): only a stop that cancels the model call lets
    the next task run within the test's bounds."""

    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        # The task itself (the last message): with the client's memory, the earlier tasks
        # are in the context too.
        text = str(seen.body["messages"][-1].get("content", ""))
        delay = 600.0 if "slow" in text else 0.0
        return openai_ok("all done", model="m", delay=delay)


async def run_cli(*args: str, env: dict) -> tuple[int, str]:
    done = await trio.to_thread.run_sync(lambda: cli(*args, env=env))
    return done.returncode, done.stdout.decode() + done.stderr.decode()


async def test_cancel_a_queued_task_and_stop_a_running_one_then_the_next_runs(tmp_path):
    async with trio.open_nursery() as nursery:
        model = await SlowOnRequest().start(nursery)
        env = subprocess_env(
            OPENAI_BASE_URL=model.base_url, OPENAI_API_KEY="test-key", AGENTSERVER_MODEL="m"
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(REPO / "boot.xml", env=env, cwd=tmp_path)
        )
        try:
            connect = f"{server.host}:{server.port}"
            async with open_client(server.host, server.port) as client:
                running, queued, after = new_thread_id(), new_thread_id(), new_thread_id()
                await client.send(Task(text="slow"), to="assistant", thread=running)
                await trio.sleep(0.5)  # the slow task is the active Turn
                await client.send(Task(text="second"), to="assistant", thread=queued)
                await client.send(Task(text="third"), to="assistant", thread=after)
                await trio.sleep(0.3)

                code, out = await run_cli(
                    "cancel", "assistant", "--thread", queued, "--connect", connect, env=env
                )
                assert code == 0, out
                assert 'command="cancel"' in out and 'count="1"' in out
                with trio.fail_after(10):
                    cancelled = await client.receive_on(queued)
                assert cancelled.payload.get("status") == "failed"

                code, out = await run_cli("stop", "assistant", "--connect", connect, env=env)
                assert code == 0, out
                with trio.fail_after(10):
                    stopped = await client.receive_on(running)
                assert stopped.payload.get("status") == "failed"

                # The stop cancelled the model call in flight: the next task does not
                # wait for it (up to llm-timeout) to start.
                with trio.fail_after(20):
                    nxt = await client.receive_on(after)
                assert nxt.payload.get("status") != "failed"
                assert "all done" in nxt.raw.decode()
                # One answer each: nothing more on the cancelled or stopped threads.
                with trio.move_on_after(1):
                    extra = await client.receive()
                    raise AssertionError(f"an extra reply: {extra.raw!r}")

                # The console's /stop and /cancel, on its own (operator) connection.
                slow = new_thread_id()
                await client.send(Task(text="slow again"), to="assistant", thread=slow)
                await trio.sleep(0.5)
                script = f"/stop assistant\n/cancel {new_thread_id()}\n/cancel x\n/quit\n"
                done = await trio.to_thread.run_sync(
                    lambda: cli("console", "--connect", connect, input=script.encode(), env=env)
                )
                lines = done.stdout.decode().splitlines()[1:]
                assert lines == [
                    "stop: 1 task(s) of assistant ended",
                    "cancel: nothing to cancel for assistant",
                    "error: THREAD is the uuid4 the task was sent on",
                    "bye",
                ], done.stdout.decode() + done.stderr.decode()
                with trio.fail_after(10):
                    stopped = await client.receive_on(slow)
                assert stopped.payload.get("status") == "failed"

                # Nothing left to stop; an unknown agent is refused.
                code, out = await run_cli("stop", "assistant", "--connect", connect, env=env)
                assert code == 1 and 'count="0"' in out
                code, out = await run_cli("stop", "nobody", "--connect", connect, env=env)
                assert code == 1 and "huh" in out
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()
