"""The web console in a real headless Chromium (Debian's), driven by Playwright; the test takes a screenshot."""
import re
from pathlib import Path
from uuid import uuid4

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from sqlalchemy import text

import broker
from broker import queries
from tests.factories import WAREHOUSE_QUEUE, begin, endpoint_state, target_handle
from tests.nodes import Node
from tests.rest import ApiServer, new_key


CHROMIUM = Path("/usr/bin/chromium")
# The console refreshes every two seconds and its diagnose waits out a peer that does not answer: on a loaded
# machine an expectation may take several refreshes.
expect.set_options(timeout=20_000)
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
        expect(page.locator("#version")).to_have_text(broker.__version__)
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
        expect(page.locator("#diagnose-summary")).to_have_text("2 problems found")
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


def _poisoned(engine, body: str, reason: str):
    """A conversation whose message to the warehouse failed once at a poison threshold of 1: its side there is in
    error and the message a dead letter. The warehouse side's handle."""
    with engine.begin() as c:
        handle = target_handle(c, _sent(c, ("order.note", body)))
        group = c.execute(queries.QUERIES["endpoint"], {"handle": handle}).one().conversation_group_id
    with engine.begin() as c:
        assert broker.report_processing_failure(c, WAREHOUSE_QUEUE, group, reason)
    return handle


def _sent(c, *messages):
    handle = begin(c)
    for message_type, body in messages:
        broker.send(c, handle, message_type, body)
    return handle


def _answer(page, names: str, verb: str, outcome) -> None:
    """The confirmation names what will change; the operator cancels (outcome None), or goes on and the page
    tells the outcome."""
    dialog = page.locator("#confirm")
    expect(dialog).to_be_visible()
    expect(page.locator("#confirm-text")).to_contain_text(names)
    expect(page.locator("#confirm-ok")).to_have_text(verb)
    page.click("#confirm-cancel" if outcome is None else "#confirm-ok")
    expect(dialog).to_be_hidden()
    expect(page.locator("#notice")).to_have_text(outcome or "Cancelled: nothing was changed.")


@pytest.mark.slow  # a node process and Debian's chromium: skipped with --skip-slow
def test_an_operator_browses_resubmits_purges_and_ends_a_conversation_from_the_console(
        browser, engine, orders, database_url, tmp_path):
    with engine.begin() as c:
        broker.alter_queue(c, WAREHOUSE_QUEUE, poison_threshold=1)
        broker.create_route(c, "far_away", "http://127.0.0.1:9", uuid4(), "a-secret-of-16-chars")  # not answering
    with engine.begin() as c:
        stuck = target_handle(c, _sent(c, ("order.note", "<script>alert(1)</script>"),
                                       ("order.note", "<img src=x onerror=alert(2)>"), ("order.note", "x" * 3000)))
    resubmitted = _poisoned(engine, "try me again", "<img src=x onerror=alert(3)>")
    purged = _poisoned(engine, "give up on me", "no such sku")
    with engine.begin() as c:
        _sent(c, ("order.submit", '{"sku": 7}'))
    reader, admin = new_key(engine, "receive:warehouse_queue", name="reader"), new_key(engine, "admin", name="ops")
    node = Node("console", database_url, tmp_path)
    node.start()
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        errors, alerts = [], []
        page.on("pageerror", lambda error: errors.append(str(error)))
        page.on("console", lambda message: "Content Security Policy" in message.text and errors.append(message.text))
        page.on("dialog", lambda dialog: (alerts.append(dialog.message), dialog.dismiss()))
        page.goto(f"{node.address}/console")
        page.fill("#key", reader)  # a key without the admin scope: the node's 403, in words
        page.click("#login button[type=submit]")
        expect(page.locator("#message")).to_have_text(
            "The API key lacks the scope for this: needs admin; the key 'reader' has receive:warehouse_queue")
        expect(page.locator("#view")).to_be_hidden()
        page.fill("#key", admin)
        page.click("#login button[type=submit]")
        queue_row = page.locator("#queues tbody tr", has_text="warehouse_queue")
        expect(queue_row.locator("td").nth(2)).to_have_text("6")  # with the notices of the two quarantined
        expect(page.locator("#diagnose-summary")).to_have_text("1 problem found")  # the far node does not answer

        # Browse: the bodies as text, the long one cut at 1 KB, nothing locked or received
        queue_row.get_by_role("button", name="Browse").click()
        rows = page.locator("#waiting tbody tr")
        expect(rows).to_have_count(6)
        expect(rows.nth(0).locator("td.preview")).to_have_text("<script>alert(1)</script>")
        expect(rows.nth(1).locator("td.preview")).to_have_text("<img src=x onerror=alert(2)>")
        assert page.locator("#view img, #view script").count() == 0
        rows.nth(2).get_by_role("button", name="Show body").click()
        expect(page.locator("#body-about")).to_contain_text("the first 1,024 bytes of 3,000 bytes")
        expect(page.locator("#body")).to_have_text("x" * 1024)
        page.screenshot(path=str(tmp_path / "console-browse.png"), full_page=True)
        with engine.connect() as c:
            assert c.execute(text("SELECT count(*) FROM broker.leases")).scalar() == 0
            assert c.execute(text("SELECT count(*) FROM broker.queue_messages WHERE received_at IS NULL"
                                  " AND queue_id = (SELECT queue_id FROM broker.queues WHERE name = :q)"),
                             {"q": WAREHOUSE_QUEUE}).scalar() == 6

        # End the stuck conversation with an error: its handle from the browsed message
        rows.nth(0).get_by_role("button", name=str(stuck)).click()
        expect(page.locator("#handle")).to_have_value(str(stuck))
        expect(page.locator("#life")).to_contain_text("warehouse to shop, conversing")
        page.fill("#error-code", "42")
        page.fill("#error-description", "stuck since Monday")
        for outcome in (None, f"Ended conversation {stuck} with error 42: it is closed."):
            page.click("#end button[type=submit]")
            _answer(page, f"End conversation {stuck} (warehouse to shop, conversing) with error 42, \u201cstuck since "
                          "Monday\u201d? This side closes, 3 messages of it still here are deleted", "End it", outcome)
            with engine.connect() as c:
                assert endpoint_state(c, stuck) == ("closed" if outcome else "conversing")
        page.click("#end button[type=submit]")  # again: the node's refusal, in words
        _answer(page, "(warehouse to shop, closed)", "End it", re.compile(
            r"^Refused: The conversation's state does not allow this: conversation .* is already ended \(closed\)$"))

        # Resubmit one quarantined conversation's dead letters, in order
        dead_row = page.locator("#dead tbody tr", has_text=str(resubmitted))
        expect(dead_row).to_contain_text("<img src=x onerror=alert(3)>")  # the reason, as text
        for outcome in (None, f"Resubmitted 1 dead letter of conversation {resubmitted} to warehouse_queue."):
            dead_row.get_by_role("button", name="Resubmit\u2026").click()
            _answer(page, f"Put the 1 dead letter of conversation {resubmitted} (warehouse to shop, error) back into "
                          "queue warehouse_queue, in order", "Resubmit", outcome)
            with engine.connect() as c:
                assert _dead_letters(c, resubmitted) == (0 if outcome else 1)

        # Purge the dead letters that are left, then the queue
        for outcome in (None, "Purged 1 dead letter of warehouse_queue."):
            queue_row.get_by_role("button", name="Purge dead letters\u2026").click()
            _answer(page, "Delete the 1 dead letter of queue warehouse_queue?", "Purge", outcome)
            with engine.connect() as c:
                assert _dead_letters(c, purged) == (0 if outcome else 1)
        expect(queue_row.locator("td").nth(2)).to_have_text("4")  # two notices, an order, the resubmitted letter
        for outcome in (None, "Purged 4 waiting messages from warehouse_queue."):
            queue_row.get_by_role("button", name="Purge\u2026", exact=True).click()
            _answer(page, "Delete every message waiting in queue warehouse_queue (4 messages now)", "Purge",
                    outcome)
            with engine.connect() as c:
                assert queries.queue_statuses(c, WAREHOUSE_QUEUE)[0].depth == (0 if outcome else 4)
        expect(page.locator("#waiting tbody")).to_have_text("none")  # the browse, looked at again
        assert errors == [] and alerts == []  # nothing ran that the page did not mean to
        page.screenshot(path=str(tmp_path / "console-actions.png"), full_page=True)
    finally:
        node.stop()
    log = node.log.read_text()
    who = f"INFO broker.api.audit: key 'ops' ({admin.split('_')[1]})"
    for line in (f"{who} browse queue 'warehouse_queue': waiting messages shown: 6",
                 f"{who} end with error 42 conversation {stuck}: ended, now closed",
                 f"{who} end with error 42 conversation {stuck}: refused, 409 conversation-state (BR020)",
                 f"{who} resubmit the dead letters of conversation {resubmitted} in queue 'warehouse_queue': "
                 "dead letters put back in order: 1",
                 f"{who} purge the dead letters of queue 'warehouse_queue': dead letters deleted: 1",
                 f"{who} purge queue 'warehouse_queue': waiting messages deleted: 4"):
        assert log.count(line) == 1, (line, log)
    assert admin.split("_", 2)[2] not in log and reader.split("_", 2)[2] not in log


def _dead_letters(c, handle) -> int:
    return c.execute(text("SELECT count(*) FROM broker.dead_letters WHERE conversation_handle = :h"),
                     {"h": handle}).scalar()
