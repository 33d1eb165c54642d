"""Fixtures for the real-browser tests: one JupyterLab and one headless Chromium for the whole
session, a fresh browser context per lesson; the report is written and its table printed at the
end (pytest_terminal_summary), whatever passed or failed.

Not collected by `make test` (pytest's testpaths is tests/); run with `make test-browser`.
"""
import os
import time
from pathlib import Path

import pytest

from lab_server import ROOT, LabServer
import report

BUILD = ROOT / "build"
SCREENS = BUILD / "screens"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
ROWS = []                                        # one dict per lesson, in the order run
STARTED = time.monotonic()
BROWSER_VERSION = {"version": "?"}
BUDGET_S = float(os.environ.get("BROWSER_BUDGET_S", "1080"))   # CI allows it about 20 min


@pytest.fixture(scope="session")
def lab():
    server = LabServer(BUILD / "jupyter-lab.log")
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; or set "
                    "CHROMIUM=/path/to/chromium): browser tests skipped")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="playwright missing: pip install -e '.[browser]'")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM),      # Debian's Chromium: playwright downloads nothing
            args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync"])
        BROWSER_VERSION["version"] = chromium.version
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser, lab):
    """A page in its own browser context; the lesson's kernel is shut down afterwards."""
    SCREENS.mkdir(parents=True, exist_ok=True)
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    page.set_default_timeout(60_000)
    yield page
    context.close()
    lab.shut_down_kernels()


@pytest.fixture
def record():
    """Keep a lesson's row for the report."""
    return ROWS.append


@pytest.fixture
def screens():
    """The folder for screenshots."""
    return SCREENS


@pytest.fixture
def time_left():
    """Seconds left of the whole run's budget (BROWSER_BUDGET_S); a lesson that would start
    after it is spent fails instead, so a slow machine shows up and CI stays bounded."""
    left = BUDGET_S - (time.monotonic() - STARTED)
    if left <= 0:
        pytest.fail(f"not run: the browser run's budget of {BUDGET_S:.0f} s is spent "
                    "(BROWSER_BUDGET_S)")
    return left


def pytest_terminal_summary(terminalreporter):
    if not ROWS:
        return
    text = report.write(ROWS, BUILD, BROWSER_VERSION["version"], time.monotonic() - STARTED)
    terminalreporter.write_sep("=", "lessons in a real browser")
    terminalreporter.write_line(text.split("\n\n", 1)[1].rstrip())
    terminalreporter.write_line(f"report: {BUILD / 'browser-report.json'} (and .md), "
                                f"screenshots: {SCREENS}/")
