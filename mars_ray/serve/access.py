"""Who may call the API and how much they may send: the key on every route but the open ones, the browser
origins allowed (CORS), and the largest request body (refused as soon as more than that arrived, so a huge or
endless body costs at most the limit).

Its own module for a reason: Serve freezes (pickles) the FastAPI app while `app.py` is still being imported,
which copies a middleware defined there by value, globals and all, so the replica's constructor would set
state the middleware never reads. Defined here, in a module imported whole beforehand, the middlewares are
pickled by reference and read the `ACCESS` the constructor set.
"""

from __future__ import annotations

import dataclasses
import hmac
from collections.abc import Awaitable, Callable, Sequence

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mars_ray.serve.schema import error_body

# Open without the key: load balancers' probe and the API's schema. Every other path, a route or not, needs
# it (a new route is protected without anyone remembering to list it).
OPEN = frozenset({"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})
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


async def check_access(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    """The API key on every path but `OPEN`, under any route prefix, compared in constant time (401 with an
    OpenAI error when missing or wrong); CORS headers only for configured origins (on every answer, a 413
    included)."""
    origin = request.headers.get("origin")
    cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin in ACCESS.origins else {}
    if request.method == "OPTIONS" and cors:  # a browser's preflight
        return JSONResponse({}, headers={**cors, **CORS_HEADERS})
    if ACCESS.key is not None and route_path(request.scope) not in OPEN:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), ACCESS.key):
            headers = {"WWW-Authenticate": "Bearer", **cors}
            body = error_body("Missing or invalid API key", code="invalid_api_key")
            return JSONResponse(body, status_code=401, headers=headers)
    response = await call_next(request)
    response.headers.update(cors)
    return response


def route_path(scope: Scope) -> str:
    """The path as the router matches it, the route prefix (Serve's `root_path`) taken off: what is open
    must not depend on where the app is mounted."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class BodyLimit:
    """A request body over `max_body_bytes` is a 413: at once when its Content-Length says so, else (chunked)
    as soon as more than that arrived. The body is read here piece by piece and handed on whole, so nothing
    past the limit is ever held; refused, the rest is never read (the server closes the connection)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = ACCESS.max_body_bytes
        if scope["type"] != "http" or limit is None:
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(scope, receive, send, limit)
            return
        received: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            received.append(message)
            size += len(message.get("body", b""))
            if size > limit:
                await self._refuse(scope, receive, send, limit)
                return
            more = message["type"] == "http.request" and message.get("more_body", False)

        async def replay() -> Message:
            return received.pop(0) if received else await receive()  # then a disconnect, when it comes

        await self.app(scope, replay, send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        body = error_body(f"the request body exceeds {limit} bytes", "body", code="request_too_large")
        await JSONResponse(body, status_code=413)(scope, receive, send)
