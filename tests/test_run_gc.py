"""``agentserver run`` takes what start-up made out of the cyclic collector's reach once it
listens (a full collection walking it paused every request in flight for ~45 ms)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading

from serverproc import REPO, scratch_dir, subprocess_env

# Runs the CLI in this interpreter, with a thread that reports when objects get frozen.
WRAPPER = """
import gc, runpy, sys, threading, time

def watch():
    while gc.get_freeze_count() == 0:
        time.sleep(0.005)
    print("frozen", gc.get_freeze_count(), file=sys.stderr, flush=True)

threading.Thread(target=watch, daemon=True).start()
sys.argv = ["agentserver", "--log-level", "warning", "run", "boot.xml", "--port", "0"]
runpy.run_module("agentserver", run_name="__main__", alter_sys=True)
"""


def test_run_freezes_what_start_up_made_once_listening():
    work = scratch_dir()
    shutil.copy(REPO / "boot.xml", work / "boot.xml")
    proc = subprocess.Popen(
        [sys.executable, "-c", WRAPPER],
        cwd=work,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen: list[str] = []
    done = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if line.startswith("frozen") and any("listening on" in s for s in seen):
                break
        done.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        done.wait(60)
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    frozen = [s for s in seen if s.startswith("frozen")]
    assert frozen, f"nothing was frozen: {seen[-5:]}"
    # Start-up's objects, not a handful: tens of thousands of modules' objects.
    assert int(frozen[0].split()[1]) > 10_000
