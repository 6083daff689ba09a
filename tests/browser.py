"""A real browser for the web console's tests (helpers, not tests): Debian's chromium
driven by its chromedriver through selenium, headless and offline.

Selenium is given the system driver and browser explicitly, so selenium-manager never
runs (it would try to download a driver). Where chromium, chromedriver or selenium is
missing the tests skip, saying which.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile

#: The browser (``AGENTSERVER_TEST_CHROMIUM`` names another; tests/test_no_silent_skips.py
#: names a missing one to see the skip fail in CI).
CHROMIUM = os.environ.get("AGENTSERVER_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMEDRIVER = "/usr/bin/chromedriver"

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1280,900",
)


def missing() -> str | None:
    """Why a browser test cannot run here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[dev]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not os.access(path, os.X_OK):
            return f"{path} is missing (apt-get install {package})"
    return None


def open_browser(profile_root: pathlib.Path):
    """A new headless chromium with a fresh profile under ``profile_root``. The caller
    quits it."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in FLAGS:
        options.add_argument(flag)
    # The page's console (script errors, CSP violations) is read back by the tests.
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    profile_root.mkdir(parents=True, exist_ok=True)
    profile = tempfile.mkdtemp(prefix="chromium-", dir=profile_root)
    options.add_argument(f"--user-data-dir={profile}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    return driver


def screenshot_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """Where screenshots go: ``$AGENTSERVER_SCREENSHOTS`` if set, else the test's
    output folder."""
    root = os.environ.get("AGENTSERVER_SCREENSHOTS")
    path = pathlib.Path(root) if root else tmp_path / "screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


def remove_profile(profile_root: pathlib.Path) -> None:
    shutil.rmtree(profile_root, ignore_errors=True)


def page_errors(driver) -> list[str]:
    """The errors the page's console logged since the last call (script errors, CSP
    violations, failed loads), the browser's own favicon request left out."""
    return [
        entry["message"]
        for entry in driver.get_log("browser")
        if entry["level"] == "SEVERE" and "favicon.ico" not in entry["message"]
    ]
