"""The web console (issue 27) in a real browser: Debian's chromium, headless, driven by
selenium, against the real server (a subprocess) and the scripted model on loopback.

One server and one browser go through what an operator does: sign in, see the agents,
send a task and watch the streamed answer arrive without a reload, approve a payment
(the tool runs once and the Turn answers), deny one (the model is told why), and see a
model's hostile answer rendered as text. A screenshot of each page is written to the
test's output folder (or ``$AGENTSERVER_SCREENSHOTS``). Skipped, saying why, where
chromium, chromedriver or selenium is missing.
"""

from __future__ import annotations

import pathlib

import httpx
import pytest
import trio
from browser import missing, open_browser, page_errors, screenshot_dir
from llm_fakes import openai_ok, openai_stream
from ui_support import TOKENS, ConsoleServer, pay

#: Needs the browser: in CI (``AGENTSERVER_TEST_NO_SKIP``) a skip fails (tests/conftest.py).
#: Skipped at setup (a skip raised inside a trio test loses its reason).
pytestmark = [pytest.mark.browser, pytest.mark.skipif(missing() is not None, reason=f"{missing()}")]

#: Bound on every wait for the page (the server, the model and the browser share 2 cores).
PATIENCE = 30

PIECES = ["Hello", " from", " the", " console", "."]
# Prose to the agent (tags it only mentions: never closed), markup to a careless page.
EVIL = 'Run <script>window.__xss = 1; and look: <img src="x" onerror="window.__xss = 2">'


def scenario(console: ConsoleServer, shots: pathlib.Path, profiles: pathlib.Path) -> None:
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver = open_browser(profiles)
    # The pages re-render parts of themselves live, and a click navigates: an element may
    # be replaced between finding and reading it. Waits look again.
    wait = WebDriverWait(
        driver,
        PATIENCE,
        poll_frequency=0.1,
        ignored_exceptions=(NoSuchElementException, StaleElementReferenceException),
    )

    def text(selector: str) -> str:
        return driver.find_element(By.CSS_SELECTOR, selector).text

    def shot(name: str) -> None:
        driver.save_screenshot(str(shots / f"{name}.png"))
        # Each page ran its script without an error and broke no rule of its CSP.
        assert page_errors(driver) == [], name

    def send_task(words: str) -> None:
        driver.get(console.url + "/ui/agents/assistant")
        box = driver.find_element(By.CSS_SELECTOR, "#task-text")
        box.send_keys(words)
        driver.find_element(By.CSS_SELECTOR, "form.send button[type=submit]").click()
        wait.until(lambda d: "/ui/agents/assistant/tasks/" in d.current_url)

    def answered() -> str:
        wait.until(lambda d: d.find_element(By.ID, "task-status").text == "succeeded")
        wait.until(lambda d: d.find_element(By.ID, "answer").text)
        return text("#answer")

    def finished_task_page(words: str, answer: str) -> None:
        """A finished task's page reads as done: its text, "succeeded", its answer, and
        no live badge, no Stop, no Cancel (whether it was watched to the end, or opened
        afterwards and so served finished)."""
        assert text("#task-text") == words
        assert text("#task-status") == "succeeded"
        assert text("#answer") == answer
        assert not driver.find_elements(By.ID, "live")
        assert not driver.find_elements(By.CSS_SELECTOR, "#controls, main button.danger")
        assert not driver.find_element(By.ID, "no-answer").is_displayed()

    def pending_approval() -> None:
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#approvals li.approval"))
        wait.until(lambda d: d.find_element(By.ID, "task-status").text == "waiting for approval")
        assert driver.find_elements(By.ID, "live") and driver.find_elements(By.ID, "controls")

    def decide(button: str, reason: str = "") -> None:
        """Type the reason into the approval's form and press ``button`` with the
        keyboard (Tab to it, Enter), as one step (again if the list was re-rendered)."""

        def attempt(d) -> bool:
            form = d.find_element(By.CSS_SELECTOR, "#approvals li.approval form")
            box = form.find_element(By.CSS_SELECTOR, "input[name=reason]")
            box.clear()
            box.send_keys(reason)
            if box.get_attribute("value") != reason:
                return False
            target = form.find_element(By.CSS_SELECTOR, f"button.{button}")
            for _ in range(3):
                if d.switch_to.active_element == target:
                    target.send_keys(Keys.ENTER)
                    return True
                d.switch_to.active_element.send_keys(Keys.TAB)
            return False

        wait.until(attempt)

    try:
        # Signing in: the API's token, once.
        driver.get(console.url + "/ui")
        wait.until(lambda d: "/ui/login" in d.current_url)
        shot("login")
        driver.find_element(By.ID, "token").send_keys(TOKENS["alice"])
        driver.find_element(By.CSS_SELECTOR, "form.login button").click()
        wait.until(lambda d: d.current_url.rstrip("/").endswith("/ui"))
        wait.until(lambda d: text("#agents tr[data-agent=assistant] .state") == "idle")
        agents = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#agents tbody th a")]
        assert agents == ["assistant"]
        assert "fake" in text("#backends") and "closed" in text("#backends")
        assert "signed in as alice" in text("header")
        shot("overview")

        # A task: the answer streams in live, with no reload.
        stream = openai_stream(PIECES, model="m", chunk_delay=0.05)
        stream.delay = 3.0  # the page is open and listening before the first chunk
        console.model.push(stream)
        send_task("Say hello.")
        driver.execute_script("window.__still_here = true;")
        # The streamed text (hidden once the whole answer is shown) came through SSE only.
        streamed = "".join(PIECES)
        wait.until(
            lambda d: d.find_element(By.ID, "streaming").get_attribute("textContent") == streamed
        )
        assert answered() == "Hello from the console."
        assert driver.execute_script("return window.__still_here === true;")
        assert "Say hello." in text("#conversation")
        # Watched to its end: the page took its badge and buttons away as it finished.
        wait.until(lambda d: not d.find_elements(By.ID, "live"))
        finished_task_page("Say hello.", "Hello from the console.")
        # Opened again, finished: served without them, and the updater adds none back.
        hello = driver.current_url
        driver.get(hello)
        finished_task_page("Say hello.", "Hello from the console.")
        assert driver.find_element(By.TAG_NAME, "body").get_attribute("data-finished") == "true"
        assert text("#task-steps") == "1 step" and text("#task-tokens").endswith(" tokens")
        shot("task")

        # An approval: it appears on the task page; Approve runs the tool once.
        console.model.push(
            openai_ok(f"Paying. {pay('bob', '5')}", model="m"), openai_ok("Paid bob.", model="m")
        )
        send_task("pay bob 5")
        pending_approval()
        assert "<to>bob</to>" in text("#approvals pre.payload")
        assert console.paid() == []
        shot("approval")
        decide("approve")
        wait.until(lambda d: "Approved" in d.find_element(By.ID, "notice").text)
        assert answered() == "Paid bob."
        assert console.paid() == ["bob 5"]
        assert "require-approval ledger (payments)" in text("#decisions")

        # Deny with a reason: the model sees the refusal, the tool never runs.
        console.model.push(
            openai_ok(f"Paying. {pay('carol', '7')}", model="m"),
            openai_ok("Carol was not paid.", model="m"),
        )
        calls = len(console.model.requests)
        send_task("pay carol 7")
        pending_approval()
        decide("deny", "not today")
        wait.until(lambda d: "Denied" in d.find_element(By.ID, "notice").text)
        assert answered() == "Carol was not paid."
        assert console.paid() == ["bob 5"]
        told = [console.seen(i) for i in range(calls, len(console.model.requests))]
        assert any("denied by alice: not today" in t for t in told), told
        shot("denied")

        # A hostile answer is shown as text: no script runs, no element is made.
        console.model.push(openai_ok(EVIL, model="m"))
        send_task("say something nasty")
        assert answered() == EVIL
        assert EVIL in text("#conversation")
        assert driver.execute_script("return window.__xss === undefined;")
        assert not driver.find_elements(By.CSS_SELECTOR, "main img, main script")
        shot("xss")

        # A payload to a listener (not an agent): its reply appears on the thread's page.
        driver.get(console.url + "/ui")
        from selenium.webdriver.support.ui import Select

        Select(driver.find_element(By.ID, "send-to")).select_by_value("echo")
        driver.find_element(By.ID, "send-xml").send_keys(
            '<ping xmlns="urn:agentserver:echo"><text>marco &lt;b&gt;</text></ping>'
        )
        driver.find_element(By.CSS_SELECTOR, "form.send button[type=submit]").click()
        wait.until(lambda d: "/ui/threads/" in d.current_url)
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#replies pre.reply-text"))
        assert text("#replies pre.reply-text") == "marco <b>"
        assert text("#replies .reply-from") == "from echo"
        shot("thread")

        # The agent's page lists its tasks by their text and outcome, newest first.
        driver.get(console.url + "/ui/agents/assistant")
        rows = [
            (
                r.find_element(By.CSS_SELECTOR, ".task-summary").text,
                r.find_element(By.CSS_SELECTOR, ".badge").text,
            )
            for r in driver.find_elements(By.CSS_SELECTOR, "#tasks tbody tr")
        ]
        assert rows == [
            ("say something nasty", "succeeded"),
            ("pay carol 7", "succeeded"),
            ("pay bob 5", "succeeded"),
            ("Say hello.", "succeeded"),
        ]
        assert "consumed" not in text("#tasks")
        # A task sent elsewhere (the HTTP API) shows up in the open list with its
        # outcome, without a reload.
        driver.execute_script("window.__still_here = 'agent';")
        console.model.push(openai_ok("Done later.", model="m"))
        sent = httpx.post(
            console.url + "/v1/messages",
            params={"to": "assistant", "wait": "false"},
            content=b'<task xmlns="urn:agentserver:assistant"><text>from the API</text></task>',
            headers={"Authorization": f"Bearer {TOKENS['alice']}"},
            timeout=PATIENCE,
        )
        assert sent.status_code < 300, sent.text

        def first_row() -> tuple[str, str]:
            row = driver.find_element(By.CSS_SELECTOR, "#tasks tbody tr")
            return (
                row.find_element(By.CSS_SELECTOR, ".task-summary").text,
                row.find_element(By.CSS_SELECTOR, ".badge").text,
            )

        wait.until(lambda d: first_row() == ("from the API", "succeeded"))
        assert driver.execute_script("return window.__still_here === 'agent';")
        driver.find_element(By.LINK_TEXT, "Say hello.").click()
        wait.until(lambda d: d.current_url == hello)
        finished_task_page("Say hello.", "Hello from the console.")
        driver.get(console.url + "/ui/agents/assistant")
        shot("agent")
    except BaseException:
        # What the browser showed when it failed, for the person reading the failure.
        driver.save_screenshot(str(shots / "failure.png"))
        (shots / "failure.html").write_text(f"<!-- {driver.current_url} -->\n{driver.page_source}")
        raise
    finally:
        driver.quit()


async def test_the_console_in_a_browser_streams_approves_denies_and_escapes(tmp_path):
    console = ConsoleServer(tmp_path)
    async with trio.open_nursery() as nursery:
        try:
            await console.start(nursery)
            await trio.to_thread.run_sync(
                scenario, console, screenshot_dir(tmp_path), tmp_path / "profiles"
            )
        finally:
            code = await trio.to_thread.run_sync(console.stop)
            nursery.cancel_scope.cancel()
    assert code == 0, console.server.stderr if console.server else ""
