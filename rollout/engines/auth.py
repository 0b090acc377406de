"""The engine API key: who may call an inference server.

Mirrors the pinned SGLang 0.5.10.post1 `--api-key` (sglang/srt/utils/auth.py, decide_request_auth)
so our hf server and the test fake refuse exactly what a real SGLang refuses: with a key set, every
request needs `Authorization: Bearer <key>` (scheme case-insensitive, constant-time compare), except
OPTIONS and paths under /health or /metrics (the kubelet's probes carry no key); a refusal is 401.
Without a key everything is open, as before. The adapters send the header (base.HTTPEngine).
"""

from __future__ import annotations

import secrets
from typing import Any

OPEN_PREFIXES = ("/health", "/metrics")


def auth_header(api_key: str | None) -> dict[str, str]:
    """The header the adapters send; none without a key."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def request_allowed(api_key: str | None, method: str, path: str, authorization: str | None) -> bool:
    """Whether a request may pass a server configured with `api_key` (None or "": open server)."""
    if not api_key or method.upper() == "OPTIONS" or path.startswith(OPEN_PREFIXES):
        return True
    return bearer_matches(api_key, authorization)


def bearer_matches(api_key: str, authorization: str | None) -> bool:
    """Whether an `Authorization` header is `Bearer <api_key>` (scheme case-insensitive, constant time)."""
    scheme, _, token = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return secrets.compare_digest(token.strip().encode(), api_key.encode())


def require_api_key(app: Any, api_key: str | None) -> None:
    """Make the Starlette/FastAPI `app` refuse unauthenticated requests with 401 (no-op without a key)."""
    if not api_key:
        return
    from starlette.requests import Request
    from starlette.responses import JSONResponse

    @app.middleware("http")
    async def _check(request: Request, call_next: Any) -> Any:
        if request_allowed(api_key, request.method, request.url.path, request.headers.get("authorization")):
            return await call_next(request)
        return JSONResponse({"error": "Unauthorized"}, status_code=401)
