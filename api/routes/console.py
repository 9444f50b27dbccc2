"""The web console at /console (a static page, no build step) and GET /v1/status, the data it shows."""
import base64
import hashlib
import re
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import HTMLResponse
from prometheus_client import Counter

from api.auth import api_key, require
from api.problems import RESPONSES
from broker.api_keys import ApiKey
from broker.metrics import RELAY_ACKNOWLEDGED, RELAY_FAILURES, RELAY_SENT
from broker.status import node_status

router = APIRouter()
CONSOLE_PAGE = (Path(__file__).parent.parent / "console.html").read_text()


def _inline_source(tag: str) -> str:
    """The page's one inline <script> or <style>, allowed by its hash and nothing else."""
    content = re.search(rf"<{tag}>(.*?)</{tag}>", CONSOLE_PAGE, re.S).group(1)
    return f"'sha256-{base64.b64encode(hashlib.sha256(content.encode()).digest()).decode()}'"


# The page runs its own script and talks to this node alone; no other page may frame it.
CONSOLE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_inline_source('script')}; "
                               f"style-src {_inline_source('style')}; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


def _total(counter: Counter) -> float:
    return sum(sample.value for metric in counter.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


@router.get("/v1/status", tags=["catalog"], responses=RESPONSES,
            summary="What the node is doing: queues, endpoints, transmission queue, ingests, dead letters, relay")
async def status(request: Request, key: ApiKey = Depends(api_key)) -> dict[str, Any]:
    require(key, "admin")

    def read() -> dict[str, Any]:
        with request.app.state.engine.connect() as connection:
            return node_status(connection)

    report = await run_in_threadpool(read)
    report["relay"] = {"sent_total": _total(RELAY_SENT), "acknowledged_total": _total(RELAY_ACKNOWLEDGED),
                       "failures_total": _total(RELAY_FAILURES)}
    return report


@router.get("/console", include_in_schema=False, response_class=HTMLResponse)
def console() -> HTMLResponse:
    return HTMLResponse(CONSOLE_PAGE, headers=CONSOLE_HEADERS)
