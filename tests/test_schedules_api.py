"""``/v1/schedules`` and ``agentserver schedule`` against a real server (docs/runs.md):
make, list (next fire times, last outcome), pause, resume, trigger, delete; bad input is
a clear 400/404/409 and changes nothing."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import trio
from httputil import http_url
from llm_fakes import FakeServer, Script, Seen, openai_ok
from serverproc import DATA, ServerProcess, cli, subprocess_env

T = TypeVar("T")
BOOT = DATA / "schedules-boot.xml"
TASK = '<task xmlns="urn:agentserver:assistant"><text>every two seconds</text></task>'


class Model(FakeServer):
    def __init__(self) -> None:
        super().__init__("openai")

    def default(self, seen: Seen) -> Script:
        return openai_ok("done")


async def test_the_schedules_api_and_cli(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        model = await Model().start(nursery)
        env = subprocess_env(SCHED_LLM_BASE_URL=model.base_url, SCHED_LLM_KEY="k")
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(BOOT, "--http-port", "0", env=env, cwd=tmp_path)
        )
        try:
            await trio.to_thread.run_sync(exercise, server, env, tmp_path)
        finally:
            await trio.to_thread.run_sync(server.stop)
            nursery.cancel_scope.cancel()


def wait_until(read: Callable[[], T], done: Callable[[T], bool], within: float = 60.0) -> T:
    """``read()`` again until ``done`` says its value is there (a bound, not a deadline
    the test checks: a loaded machine only makes it wait longer); its last value."""
    give_up = time.monotonic() + within
    while True:
        got = read()
        if done(got):
            return got
        assert time.monotonic() < give_up, f"still {got!r} after {within:g} s"
        time.sleep(0.1)


def exercise(server: ServerProcess, env: dict[str, str], tmp_path: Path) -> None:
    url = http_url(server)
    env = {**env, "AGENTSERVER_HTTP_URL": url}
    task_file = tmp_path / "task.xml"
    task_file.write_text(TASK)

    def run(*args: str) -> tuple[int, str, str]:
        done = cli("schedule", *args, env=env)
        return done.returncode, done.stdout.decode(), done.stderr.decode()

    with httpx.Client(base_url=url, timeout=10) as http:
        code, out, err = run("add", "two", "assistant", "*/2 * * * * *", "--task", str(task_file))
        assert code == 0, err
        view = http.get("/v1/schedules/two").json()
        first, second, third = (
            time.mktime(time.strptime(t, "%Y-%m-%dT%H:%M:%SZ")) for t in view["next"]
        )
        assert second - first == 2 and third - second == 2
        assert view["overlap"] == "skip" and view["source"] == "api"
        # the same name again, a bad cron, an unknown agent: refused, nothing changes
        again = {"name": "two", "agent": "assistant", "cron": "* * * * *", "task": TASK}
        assert http.post("/v1/schedules", json=again).status_code == 409
        bad = http.post("/v1/schedules", json={**again, "name": "x", "cron": "soon"})
        assert bad.status_code == 400 and "cron" in bad.json()["title"]
        assert (
            http.post("/v1/schedules", json={**again, "name": "y", "task": "<a"}).status_code == 400
        )
        unknown = http.post("/v1/schedules", json={**again, "name": "z", "agent": "nope"})
        assert unknown.status_code == 400 and "nope" in unknown.text, unknown.text
        assert http.get("/v1/schedules/z").status_code == 404
        assert len(http.get("/v1/schedules").json()["schedules"]) == 2

        def listed() -> dict[str, str]:
            code, out, err = run("list")
            assert code == 0, err
            return {line.split()[0]: line for line in out.splitlines()}

        # Bounded waits on what the server did, never on how long it took.
        lines = wait_until(listed, lambda got: "last: fired" in got["every-second"])
        assert "next " in lines["every-second"] and "two" in lines

        def ticks(name: str) -> int:
            view = http.get(f"/v1/schedules/{name}").json()
            return view["fired"] + view["skipped"]

        code, out, err = run("pause", "every-second")
        assert code == 0 and "paused" in out, err
        fired = http.get("/v1/schedules/every-second").json()["fired"]
        # Paused: while "two" (every 2 s) takes two more ticks, every-second takes none.
        two = ticks("two")
        wait_until(lambda: ticks("two"), lambda n: n >= two + 2)
        assert http.get("/v1/schedules/every-second").json()["fired"] == fired
        code, out, err = run("trigger", "every-second")
        assert code == 0 and json.loads(out)["outcome"] == "triggered", (out, err)
        assert http.get("/v1/schedules/every-second").json()["fired"] == fired + 1
        code, out, err = run("resume", "every-second")
        assert code == 0 and "next " in out, err
        # Resumed: its ticks fire again.
        wait_until(
            lambda: http.get("/v1/schedules/every-second").json()["fired"], lambda n: n >= fired + 2
        )

        code, out, err = run("delete", "two")
        assert code == 0, err
        assert http.get("/v1/schedules/two").status_code == 404
        code, out, err = run("delete", "two")
        assert code == 1 and "404" in err
        # A schedule declared in boot.xml is refused, as a declared webhook is (409): the
        # next start would bring it back.
        code, out, err = run("delete", "every-second")
        assert code == 1 and "409" in err, (out, err)
        assert "declared in boot.xml" in err and "{" not in err  # the title, not the JSON
        assert http.get("/v1/schedules/every-second").status_code == 200
        # each run is a task of the agent like any other
        agents = http.get("/v1/agents").json()
        assert "assistant" in json.dumps(agents)
