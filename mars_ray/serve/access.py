"""Who may call the API: the key on every /v1 route and the browser origins allowed (CORS).

Its own module for a reason: Serve freezes (pickles) the FastAPI app while `app.py` is still being imported,
which copies a middleware defined there by value, globals and all, so the replica's constructor would set
state the middleware never reads. Defined here, in a module imported whole beforehand, the middleware is
pickled by reference and reads the `ACCESS` the constructor set.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Request, Response
from fastapi.responses import JSONResponse

from mars_ray.serve.schema import error_body

CORS_HEADERS = {
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type",
    "Access-Control-Max-Age": "600",
}


@dataclasses.dataclass
class Access:
    key: bytes | None = None
    origins: frozenset[str] = frozenset()


# One ingress replica serves one app: its constructor sets this for the process.
ACCESS = Access()


def configure(key: str | None, origins: Sequence[str]) -> None:
    ACCESS.key = key.encode() if key else None
    ACCESS.origins = frozenset(origins)


async def check_access(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The API key on every /v1 route, compared in constant time (401 with an OpenAI error when missing or
    wrong; /health stays open for load balancers); CORS headers only for configured origins."""
    origin = request.headers.get("origin")
    cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin in ACCESS.origins else {}
    if request.method == "OPTIONS" and cors:  # a browser's preflight
        return JSONResponse({}, headers={**cors, **CORS_HEADERS})
    if ACCESS.key is not None and request.url.path.startswith("/v1"):
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), ACCESS.key):
            headers = {"WWW-Authenticate": "Bearer", **cors}
            body = error_body("Missing or invalid API key", code="invalid_api_key")
            return JSONResponse(body, status_code=401, headers=headers)
    response = await call_next(request)
    response.headers.update(cors)
    return response
