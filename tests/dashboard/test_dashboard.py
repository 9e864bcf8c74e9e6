"""The dashboard: GET / and its JSON, then the page itself in headless Chromium (Debian's
`chromium` + `chromium-driver`, driven by Selenium) against a served instance.

Never skipped: without Chromium the browser test fails and says what to install
(`apt-get install -y chromium chromium-driver`, `pip install -e ".[dev]"` for selenium).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from asgi_lifespan import LifespanManager

from app.main import create_app
from app.routes.dashboard import HISTORY_SECONDS, History, sample
from app.settings import Settings
from tests.guard_process import clean_env, guard_serve

ROOT = Path(__file__).resolve().parents[2]
INSTALL = "install it: apt-get install -y chromium chromium-driver"


async def test_page_and_json_are_served(tmp_path: Path) -> None:
    """The page and its assets come from the package; the JSON has counters and filters."""
    app = create_app(
        Settings(redis_url="memory://", database_url="sqlite:///:memory:", demo_records=10)
    )
    async with LifespanManager(app, startup_timeout=30, shutdown_timeout=30) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            page = await client.get("/")
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            for asset in ("/static/dashboard.js", "/static/dashboard.css"):
                assert (await client.get(asset)).status_code == 200
            assert (await client.get("/static/../settings.py")).status_code == 404
            await client.get("/records/user-1")
            await client.get("/records/nobody")
            data = (await client.get("/dashboard.json")).json()
            assert data["stats"]["blocked"] == 1 and data["stats"]["passed"] == 1
            assert [f["name"] for f in data["filters"]] == ["records"]
            assert data["filters"][0]["items"] == 10
            assert data["window_s"] == HISTORY_SECONDS
            history = app.state.dashboard_history
            assert history.samples  # the lifespan's sampler took the first one at start-up


class TestHistory:
    """The server-side series behind the chart."""

    def test_rates_between_samples(self) -> None:
        """Per-second rates of each counter, at the later sample's time."""
        h = History(seconds=60, every=1.0)
        h.add(100.0, {"blocked": 0, "passed": 0, "db_queries": 0})
        h.add(101.0, {"blocked": 30, "passed": 2, "db_queries": 1})
        h.add(103.0, {"blocked": 40, "passed": 2, "db_queries": 1})
        assert h.rates() == [
            {"t": 101.0, "blocked": 30.0, "passed": 2.0, "db_queries": 1.0},
            {"t": 103.0, "blocked": 5.0, "passed": 0.0, "db_queries": 0.0},
        ]

    def test_gap_becomes_nulls(self) -> None:
        """Samples further apart than a few intervals (the sampler did not run) give nulls, so
        the chart breaks the line instead of drawing one straight across the gap."""
        h = History(seconds=600, every=1.0)
        for t, n in ((0.0, 0), (1.0, 10), (61.0, 20), (62.0, 25)):
            h.add(t, {"blocked": n, "passed": n, "db_queries": n})
        assert [r["blocked"] for r in h.rates()] == [10.0, None, 5.0]
        assert h.rates()[1] == {"t": 61.0, "blocked": None, "passed": None, "db_queries": None}

    def test_bounded_to_the_window(self) -> None:
        """Only the last `seconds` are kept, however long the service runs."""
        h = History(seconds=10, every=1.0)
        for t in range(100):
            h.add(float(t), {"blocked": t, "passed": 0, "db_queries": 0})
        assert [s["t"] for s in h.samples] == [float(t) for t in range(89, 100)]

    async def test_sampler_runs_without_viewers(self) -> None:
        """`sample` adds samples by itself, no request needed."""
        h = History(seconds=60, every=0.01)
        reads = iter(range(1000))
        task = asyncio.create_task(
            sample(h, lambda: dict.fromkeys(("blocked", "passed", "db_queries"), next(reads)))
        )
        try:
            while len(h.samples) < 3:
                await asyncio.sleep(0.01)
        finally:
            task.cancel()
        assert [s["blocked"] for s in h.samples][:3] == [0.0, 1.0, 2.0]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[str]:
    env = clean_env(
        GUARD_REDIS_URL="memory://",
        GUARD_DATABASE_URL=f"sqlite:///{tmp_path}/records.db",
        GUARD_DEMO_RECORDS="200",
    )
    with guard_serve(env) as url:
        yield url


def chrome() -> object:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.fail(f"headless Chromium and chromedriver are needed: {INSTALL}")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail('selenium is needed: pip install -e ".[dev]"')
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--no-first-run",
        "--window-size=1200,900",
        # The network cut: every host but the service's fails to resolve, so a page that
        # needs a CDN (or anything else off this machine) breaks here as it would offline.
        "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    ):
        options.add_argument(flag)  # fmt: skip
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=driver))


def test_page_in_chromium_shows_live_numbers(served: str) -> None:
    """Loads without console errors; the counters, chart and filter table follow the traffic."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chrome()
    try:
        browser.get(f"{served}/?interval=300")  # type: ignore[attr-defined]
        wait = WebDriverWait(browser, 15)
        text = lambda i: browser.find_element(By.ID, i).text  # type: ignore[attr-defined]  # noqa: E731
        wait.until(lambda _: text("status") == "live")
        assert text("blocked") == "0"
        # Rows and chart lines are redrawn on every poll: read them in one script call.
        js = "const e = document.querySelector(arguments[0]); return e && e.%s;"
        row = browser.execute_script(js % "textContent", "#filters tr[data-filter=records]")  # type: ignore[attr-defined]
        assert "200" in row
        # The page must show what the service answered. A ghost key is blocked unless it is a
        # false positive (about 1 in 50,000 here, with a new seed each run), so count the answers.
        with httpx.Client(base_url=served) as client:
            guarded = lambda key: client.get(f"/records/{key}").headers["x-guard"]  # noqa: E731
            answers = [guarded(k) for i in range(60) for k in (f"ghost-{i}", f"user-{i + 1}")]
            first = answers.count("blocked")
            assert first >= 58
            wait.until(lambda _: text("blocked") == str(first))
            time.sleep(1.2)  # a second sample, so the chart has a rate to draw
            answers += [guarded(f"ghost2-{i}") for i in range(30)]
        blocked = answers.count("blocked")
        wait.until(lambda _: text("blocked") == str(blocked))
        assert text("passed") == str(len(answers) - blocked)
        assert int(text("db_queries").replace(",", "")) >= 60
        assert text("saved") == str(blocked)
        wait.until(
            lambda _: browser.execute_script(  # type: ignore[attr-defined]
                js % "getAttribute('d')", "#chart path[data-series=blocked]"
            )
        )
        if os.environ.get("GUARD_DASHBOARD_SCREENSHOT"):
            browser.save_screenshot(os.environ["GUARD_DASHBOARD_SCREENSHOT"])  # type: ignore[attr-defined]
        errors = [
            e for e in browser.get_log("browser")  # type: ignore[attr-defined]
            if e["level"] in ("SEVERE", "ERROR")
        ]  # fmt: skip
        assert not errors, errors
    finally:
        browser.quit()  # type: ignore[attr-defined]


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_api_docs_render_offline(served: str, page: str) -> None:
    """/docs (Swagger UI) and /redoc render with the network cut: their JavaScript and CSS
    come from the service, and the page lists the API's operations."""
    from selenium.webdriver.support.ui import WebDriverWait

    browser = chrome()
    try:
        browser.get(served + page)  # type: ignore[attr-defined]
        # Swagger UI draws one .opblock per operation; ReDoc one [data-section-id] per section.
        selector = ".opblock-summary-path" if page == "/docs" else "[data-section-id^='operation']"
        count = "return document.querySelectorAll(arguments[0]).length"
        WebDriverWait(browser, 20).until(
            lambda b: b.execute_script(count, selector) >= 10  # type: ignore[attr-defined]
        )
        html = browser.page_source  # type: ignore[attr-defined]
        assert "/filters/{name}" in html
        assert "cdn.jsdelivr.net" not in html
    finally:
        browser.quit()  # type: ignore[attr-defined]


def test_chart_has_points_on_first_open(served: str) -> None:
    """Traffic while nobody watches, then the page is opened: its first view already charts
    that traffic (the service sampled it), with labelled axes and the filters' capacity."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with httpx.Client(base_url=served) as client:
        for i in range(100):
            client.get(f"/records/ghost-{i}")
    time.sleep(2.5)  # let the sampler take samples after the traffic; nothing polled meanwhile
    browser = chrome()
    try:
        browser.get(f"{served}/?interval=600000")  # type: ignore[attr-defined]  # one poll only
        text = lambda i: browser.find_element(By.ID, i).text  # type: ignore[attr-defined]  # noqa: E731
        WebDriverWait(browser, 15).until(lambda _: text("status") == "live")
        line = browser.execute_script(  # type: ignore[attr-defined]
            "const e = document.querySelector('#chart [data-series=blocked]');"
            "return e.getAttribute('d') || e.getAttribute('points') || ''"
        )
        assert len(re.findall(r"[\d.]+,[\d.]+", line)) >= 2, line  # a line needs two points
        chart = text("chart")
        assert "per second" in chart and "time (minutes ago)" in chart and "now" in chart
        headers = [th.text for th in browser.find_elements(By.CSS_SELECTOR, "#filters th")]  # type: ignore[attr-defined]
        assert headers[2:4] == ["capacity", "sub-filters"]
        row = browser.find_element(By.CSS_SELECTOR, "#filters tr[data-filter=records]").text  # type: ignore[attr-defined]
        assert row.split()[:2] == ["records", "(records)"]
    finally:
        browser.quit()  # type: ignore[attr-defined]
