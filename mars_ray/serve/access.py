"""Who may call the API and how much they may send: the key on every /v1 route, the browser origins allowed
(CORS), and the largest request body (checked before it is read, so a huge body costs nothing).

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

PROTECTED = ("/v1", "/tokenize", "/detokenize")  # every route but /health and the schema needs the key
CORS_HEADERS = {
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type",
    "Access-Control-Max-Age": "600",
}


@dataclasses.dataclass
class Access:
    key: bytes | None = None
    origins: frozenset[str] = frozenset()
    max_body_bytes: int | None = None


# One ingress replica serves one app: its constructor sets this for the process.
ACCESS = Access()


def configure(key: str | None, origins: Sequence[str], max_body_bytes: int | None = None) -> None:
    ACCESS.key = key.encode() if key else None
    ACCESS.origins = frozenset(origins)
    ACCESS.max_body_bytes = max_body_bytes


def _too_large(request: Request) -> bool:
    """A declared body over the limit; a body without a length (chunked) is refused too once read past it."""
    declared = request.headers.get("content-length")
    return declared is not None and declared.isdigit() and int(declared) > ACCESS.max_body_bytes


async def check_access(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The API key on every /v1 route and vLLM's /tokenize and /detokenize, compared in constant time (401
    with an OpenAI error when missing or wrong; /health stays open for load balancers); CORS headers only
    for configured origins; a body over the limit is a 413."""
    origin = request.headers.get("origin")
    cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin in ACCESS.origins else {}
    if request.method == "OPTIONS" and cors:  # a browser's preflight
        return JSONResponse({}, headers={**cors, **CORS_HEADERS})
    if ACCESS.key is not None and request.url.path.startswith(PROTECTED):
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), ACCESS.key):
            headers = {"WWW-Authenticate": "Bearer", **cors}
            body = error_body("Missing or invalid API key", code="invalid_api_key")
            return JSONResponse(body, status_code=401, headers=headers)
    if ACCESS.max_body_bytes is not None and request.method == "POST":
        too_large = _too_large(request)
        if not too_large and "content-length" not in request.headers:
            too_large = len(await request.body()) > ACCESS.max_body_bytes  # chunked: read, then cached
        if too_large:
            message = f"the request body exceeds {ACCESS.max_body_bytes} bytes"
            return JSONResponse(error_body(message, "body", code="request_too_large"), 413, headers=cors)
    response = await call_next(request)
    response.headers.update(cors)
    return response
