"""Errors as application/problem+json (RFC 9457), each class with a stable type."""
from fastapi.responses import JSONResponse


def problem(status: int, kind: str, title: str, detail: str | None = None) -> JSONResponse:
    body = {"type": f"/problems/{kind}", "title": title, "status": status}
    if detail:
        body["detail"] = detail
    return JSONResponse(body, status_code=status, media_type="application/problem+json")
