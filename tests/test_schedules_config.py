"""boot.xml's ``<schedules>`` (docs/runs.md): read into typed settings; a bad schedule is
a problem on its line, never a silent default."""

from __future__ import annotations

from serverproc import DATA

from agentserver.config.loader import load_bytes

BASE = (DATA / "schedules-boot.xml").read_bytes()
TASK = '<task xmlns="urn:agentserver:assistant"><text>hi</text></task>'


def with_schedules(*items: str) -> bytes:
    start = BASE.index(b"<schedules>")
    end = BASE.index(b"</schedules>") + len(b"</schedules>")
    body = "<schedules>" + "".join(items) + "</schedules>"
    return BASE[:start] + body.encode() + BASE[end:]


def schedule(body: str = TASK, **attrs: str) -> str:
    base = {"name": "s", "agent": "assistant", "cron": "*/5 * * * *"} | attrs
    text = " ".join(f'{k}="{v}"' for k, v in base.items())
    return f"<schedule {text}>{body}</schedule>"


def errors(data: bytes) -> list[str]:
    return [p.message for p in load_bytes(data, environ={}).errors]


def test_the_declared_schedule_is_typed() -> None:
    topology = load_bytes(BASE, environ={}).topology
    assert topology is not None
    [spec] = topology.schedules
    assert (spec.name, spec.agent, spec.cron, spec.overlap) == (
        "every-second",
        "assistant",
        "* * * * * *",
        "buffer-one",
    )
    assert spec.catchup_window_s == 5.0 and spec.jitter_s == 0.0
    assert spec.payload.startswith(b'<task xmlns="urn:agentserver:assistant">')
    assert b"xml-pipeline.org" not in spec.payload  # boot.xml's namespace left behind


def test_bad_schedules_are_problems_by_line() -> None:
    assert any("not an agent" in e for e in errors(with_schedules(schedule(agent="echo"))))
    assert any("cron" in e for e in errors(with_schedules(schedule(cron="every day"))))
    assert any("time zone" in e for e in errors(with_schedules(schedule(timezone="Mars/X"))))
    assert any("twice" in e for e in errors(with_schedules(schedule(), schedule())))
    # the schema: an unknown overlap, a schedule without its task
    assert errors(with_schedules(schedule(overlap="sometimes")))
    assert errors(with_schedules(schedule(body="")))
