"""The web console in a real headless Chromium (Debian's), driven by Playwright; the test takes a screenshot."""
import re
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from sqlalchemy import text

import broker
from tests.factories import WAREHOUSE_QUEUE, begin
from tests.rest import ApiServer, new_key


CHROMIUM = Path("/usr/bin/chromium")
# As the machine's own probe starts it: no sandbox as root, and no calls home on a closed network.
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


def test_the_console_may_run_only_its_own_script_and_may_not_be_framed(database_url):
    with ApiServer(database_url) as api:
        headers = httpx.get(f"{api.url}/console").headers
    policy = headers["content-security-policy"]
    assert "default-src 'none'" in policy and "script-src 'sha256-" in policy and "frame-ancestors 'none'" in policy
    assert headers["x-frame-options"] == "DENY" and headers["x-content-type-options"] == "nosniff"


@pytest.fixture
def browser():
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.mark.slow  # needs Debian's chromium: skipped with --skip-slow
def test_the_console_shows_queues_conversations_the_transmission_queue_and_dead_letters(
        browser, engine, orders, database_url, tmp_path):
    with engine.begin() as c:
        broker.create_route(c, "far_away", "http://127.0.0.1:9", uuid4(), "a-secret-of-16-chars")
        far = broker.begin_dialog(c, "shop", "far_away", "orders")
        broker.send(c, far, "order.submit", '{"sku": 1}')
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=1)
        poisoned = begin(c)
        broker.send(c, poisoned, "order.note", "cannot be processed")
    with engine.begin() as c:
        [message] = broker.receive(c, WAREHOUSE_QUEUE, 1)
        c.rollback()
    with engine.begin() as c:
        assert broker.report_processing_failure(c, WAREHOUSE_QUEUE, message.conversation_group_id, "no such sku")
    with engine.begin() as c:  # an ingest's checkpoint, with a message waiting above it
        c.execute(text("SELECT broker.start_ingest(:queue, 'file:/lake/warehouse')"), {"queue": WAREHOUSE_QUEUE})
        broker.send(c, begin(c), "order.note", "waiting for the ingest")
    admin = new_key(engine, "admin")

    with ApiServer(database_url) as api:
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: "Content Security Policy" in message.text and errors.append(message.text))
        page.goto(f"{api.url}/console")
        page.fill("#key", "bk_000000000000_not-a-key")
        page.click("button[type=submit]")
        expect(page.locator("#message")).to_contain_text("API key")
        expect(page.locator("#view")).to_be_hidden()

        page.fill("#key", admin)
        page.click("button[type=submit]")
        expect(page.locator("#queues")).to_contain_text("warehouse_queue")
        expect(page.locator("#transmission")).to_contain_text("http://127.0.0.1:9")
        expect(page.locator("#transmission")).to_contain_text("waiting for its first transmission")
        expect(page.locator("#dead")).to_contain_text("no such sku")
        expect(page.locator("#conversations")).to_contain_text("conversing")
        ingest = page.locator("#ingests tbody tr td")
        expect(ingest.nth(1)).to_have_text("file:/lake/warehouse")
        expect(ingest.nth(5)).to_have_text(re.compile(r"^[1-9]\d*$"))  # messages above the checkpoint
        expect(ingest.nth(6)).to_have_text(re.compile(r"^[\d.]+ s$"))  # the oldest one's age
        # diagnose's findings: nothing relays here, and the far node does not answer
        expect(page.locator("#diagnose")).to_contain_text("no relay is running for it")
        expect(page.locator("#diagnose")).to_contain_text("does not answer")
        expect(page.locator("#diagnose-summary")).to_contain_text("problems found")
        page.fill("#handle", str(far))  # one conversation's messages, and why each waits
        page.click("#follow button[type=submit]")
        expect(page.locator("#life")).to_contain_text("shop to far_away, conversing: sent 1 (0 acknowledged")
        expect(page.locator("#messages")).to_contain_text("waiting for its first transmission")

        page.select_option("#state", "error")
        expect(page.locator("#conversations tbody tr")).to_have_count(2)  # both sides of the quarantined one
        expect(page.locator("#conversations")).not_to_contain_text("conversing")
        page.wait_for_timeout(4500)  # two more refreshes: the chart has points
        lines = page.locator("#chart polyline")
        assert lines.count() == 2 and all(lines.nth(i).get_attribute("points") for i in range(2))
        assert errors == []  # no script error on the page, nothing its security policy refused
        screenshot = tmp_path / "console.png"
        page.screenshot(path=str(screenshot), full_page=True)
    assert screenshot.stat().st_size > 10_000
