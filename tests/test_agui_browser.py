"""examples/agui/ in a real browser: Debian's chromium, headless, driven by selenium, on
the example's own files (a copy): its scripted model, its boot.xml on the real server (a
subprocess), and its page served by its page.py, which passes the page's AG-UI requests
on to the server.

The page is driven as a person would: the token typed, a booking asked for; the model's
words arrive one by one (seen mid-stream, before the run ends), the tool call shows with
its arguments, the pending approval shows as an interrupt with Approve / Deny; Approve
resumes the run: the tool's result and the answer arrive and the tool ran once. A second
booking is denied. The page logs no script error and breaks no rule of its CSP. Skipped,
saying why, where chromium, chromedriver or selenium is missing (a failure in CI).
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import httpx
import pytest
import trio
from browser import missing, open_browser, page_errors, screenshot_dir
from httputil import http_url
from serverproc import REPO, ServerProcess, subprocess_env

pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing() is not None, reason=f"{missing()}")]

PATIENCE = 30
TOKEN = "browser-demo-token"
EXAMPLE = REPO / "examples" / "agui"


class Helper:
    """One of the example's stand-in processes (``scripted_model.py``, ``page.py``),
    started on a free port; its URL read from the line it prints."""

    def __init__(self, cwd: pathlib.Path, script: str, *args: str, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, script, "--port", "0", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        line = self.proc.stdout.readline()
        found = re.search(r"(http://127\.0\.0\.1:\d+)", line)
        assert found, line + self.proc.stdout.read()
        self.url = found.group(1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def scenario(page_url: str, shots: pathlib.Path, profiles: pathlib.Path, ledger) -> None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = open_browser(profiles)
    wait = WebDriverWait(
        driver,
        PATIENCE,
        poll_frequency=0.02,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    )

    def text(selector: str) -> str:
        return driver.find_element(By.CSS_SELECTOR, selector).text

    def shot(name: str) -> None:
        driver.save_screenshot(str(shots / f"agui-{name}.png"))
        assert page_errors(driver) == [], name

    def ask(words: str) -> None:
        box = driver.find_element(By.ID, "task")
        box.send_keys(words)
        driver.find_element(By.ID, "send").click()

    try:
        driver.get(page_url)
        assert text("#state") == "idle"
        driver.find_element(By.ID, "token").send_keys(TOKEN)
        ask("a table for two at eight")
        assert text("#messages li.user") == "a table for two at eight"
        # The words arrive one by one: the message is seen while it streams, part-way.
        partial = wait.until(
            lambda d: (
                (el := d.find_elements(By.CSS_SELECTOR, "#messages li.assistant.streaming"))
                and el[0].text
                and "<book" not in el[0].text
                and el[0].text
            )
        )
        assert "Booking it now.".startswith(partial), partial
        shot("streaming")
        # The tool call, its arguments, and the interrupt with its buttons.
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#interrupts li.interrupt"))
        assert text("#messages li.assistant").startswith("Booking it now. <book")
        call = driver.find_element(By.CSS_SELECTOR, "#messages li.tool-call")
        assert call.find_element(By.CSS_SELECTOR, ".name").text == "tables("
        assert "a table for two at eight" in call.find_element(By.CSS_SELECTOR, ".args").text
        assert "needs an approval" in text("#interrupts li.interrupt .message")
        assert text("#state").startswith("waiting for approval")
        assert ledger() == 0
        shot("interrupt")
        driver.find_element(By.CSS_SELECTOR, "#interrupts li.interrupt button.approve").click()
        wait.until(lambda d: d.find_element(By.ID, "answer").text)
        assert text("#answer") == "Done: booked a table for two at eight (ref T-42)."
        result = driver.find_element(By.CSS_SELECTOR, "#messages li.tool-call .result").text
        assert "booked a table for two at eight" in result
        assert not driver.find_elements(By.CSS_SELECTOR, "#interrupts li")
        assert text("#state").startswith("succeeded")
        assert ledger() == 1
        shot("approved")
        # Another booking, denied: the model is told, the tool never runs.
        ask("a table for six")
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#interrupts li.interrupt"))
        driver.find_element(By.CSS_SELECTOR, "#interrupts li.interrupt button.deny").click()
        wait.until(lambda d: d.find_element(By.ID, "answer").text)
        assert text("#answer") == "I did not book it: the booking was not approved."
        assert ledger() == 1
        assert text("#error") == ""
        shot("denied")
    except BaseException:
        driver.save_screenshot(str(shots / "agui-failure.png"))
        (shots / "agui-failure.html").write_text(driver.page_source)
        raise
    finally:
        driver.quit()


async def test_the_agui_example_page_drives_the_agent_in_a_browser(tmp_path):
    work = tmp_path / "agui"
    shutil.copytree(EXAMPLE, work, ignore=shutil.ignore_patterns("state", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTSERVER_")}
    model = await trio.to_thread.run_sync(
        lambda: Helper(work, "scripted_model.py", env={**env, "SCRIPTED_MODEL_PACE": "0.15"})
    )
    server = page = None
    try:
        server_env = subprocess_env(
            OPENAI_BASE_URL=model.url + "/v1", AGUI_ALICE_TOKEN=TOKEN, AGENTSERVER_PORT="0"
        )
        server = await trio.to_thread.run_sync(
            lambda: ServerProcess.start(
                work / "boot.xml", "--http-port", "0", env=server_env, cwd=work, timeout=40
            )
        )
        url = http_url(server)
        page = await trio.to_thread.run_sync(
            lambda: Helper(work, "page.py", "--server", url, env=env)
        )
        # The tool's runs, counted through the API (the store's view of the Turns' cards).
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=PATIENCE
        ) as api:
            assert (await api.get("/v1/agents")).status_code == 200

        def ledger() -> int:
            path = work / "state" / "agents.sqlite3"
            import sqlite3

            with sqlite3.connect(path) as db:
                (count,) = db.execute(
                    "SELECT count(*) FROM cards WHERE card_type = 'tool.result' "
                    "AND json_extract(metadata, '$.failed') = 0"
                ).fetchone()
            return count

        await trio.to_thread.run_sync(
            scenario, page.url + "/", screenshot_dir(tmp_path), tmp_path / "profiles", ledger
        )
    finally:
        for helper in (page, model):
            if helper is not None:
                await trio.to_thread.run_sync(helper.stop)
        if server is not None:
            code = await trio.to_thread.run_sync(server.stop)
            assert code == 0, server.stderr
