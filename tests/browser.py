"""A real headless browser for page tests: Playwright driving the system's Chromium (Debian's ``chromium``).

No browser is downloaded at test time: Playwright's own browsers are never used, only the executable at
:data:`CHROMIUM` (``.ci/run`` installs Debian's package). Where it or Playwright is missing,
:func:`browser_missing` says why, for a skip that names the cause. Chromium runs headless with its
background networking off (this machine's network is closed: it would retry connections to Google's hosts
at every start) and a fresh profile; Playwright ends its process group when the context manager exits.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tests.waiting import wait_until

CHROMIUM = os.environ.get("SGLANG_GATEWAY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",  # the tests run as root
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def browser_missing() -> str | None:
    """Why no browser test can run here (None: they can)."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"no Chromium at {CHROMIUM} (Debian: apt-get install chromium; .ci/run installs it)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (a dev dependency: make env)"
    return None


@contextmanager
def chromium_page(**page_options: Any) -> Iterator[Any]:
    """A new page of a new headless Chromium; its console errors and page errors are in ``page.problems``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        try:
            page = browser.new_page(**page_options)
            page.problems = []
            page.on("pageerror", lambda error: page.problems.append(f"page error: {error}"))
            yield page
        finally:
            browser.close()


def expect_text(locator: Any, wanted: str | re.Pattern[str], timeout_s: float = 30) -> None:
    """Until ``locator``'s text is ``wanted`` (or matches it): the page refreshes every few seconds."""

    def text() -> str | None:
        return (locator.text_content(timeout=timeout_s * 1000) or "").strip() if locator.count() else None

    def shown() -> bool:
        found = text()
        return found is not None and bool(wanted.search(found) if isinstance(wanted, re.Pattern) else found == wanted)

    wait_until(shown, lambda: f"{locator}: {text()!r}, not {wanted!r}", timeout_s, every_s=0.2)
