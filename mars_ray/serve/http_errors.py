"""Every error a request can meet, as the HTTP answer OpenAI's clients expect: a status and OpenAI's error
body, never a bare 500.

- a body the schema refuses, or a `ConfigError` from the ingress or an engine: 400, `param` naming the
  request's field (`schema.request_field` renames the engine's names of fields, here and nowhere else);
- a model not served (`UnknownModel`): 404;
- an engine replica that died under a request: 503 with Retry-After (Serve replaces the replica);
- Serve's backpressure: 503 with Retry-After (`overloaded`).

Its own module, imported whole before the ingress: Serve pickles the FastAPI app while the ingress module is
still being imported, and handlers defined here are pickled by reference, not copied by value.
"""

from __future__ import annotations

import logging
import math
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from ray.exceptions import RayError
from ray.serve.exceptions import BackPressureError

from mars_ray.core.errors import ConfigError
from mars_ray.serve.schema import error_body, error_param, request_field

logger = logging.getLogger(__name__)


class UnknownModel(ConfigError):
    """A `model` this app does not serve (HTTP 404, not 400)."""


async def invalid_request(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    if first["type"] == "json_invalid":
        reason = first.get("ctx", {}).get("error") or first["msg"]
        return JSONResponse(error_body(f"invalid JSON body: {reason}"), status_code=400)
    param = error_param(first["loc"])
    return JSONResponse(error_body(f"{param}: {first['msg']}", param), status_code=400)


async def unservable_request(request: Request, error: ConfigError) -> JSONResponse:
    # An engine's error arrives wrapped in a RayTaskError that also is a ConfigError and reads its fields.
    return JSONResponse(error_body(error.message, request_field(error.field)), status_code=400)


async def unknown_model(request: Request, error: UnknownModel) -> JSONResponse:
    return JSONResponse(error_body(error.message, error.field, code="model_not_found"), status_code=404)


async def replica_lost(request: Request, error: RayError) -> JSONResponse:
    """An engine replica that died (or an actor call that failed) under a request: a 503 with an OpenAI
    body (the client may retry: Serve replaces the replica), not a bare 500."""
    if isinstance(error, ConfigError):  # the engine's 400, wrapped by Ray in a class that is both
        return await unservable_request(request, error)
    message = logged("the model's replica failed", error)
    body = error_body(message, kind="server_error", code="replica_failed")
    return JSONResponse(body, status_code=503, headers={"Retry-After": "1"})


# For `FastAPI(exception_handlers=...)`; Starlette picks the first class of an error's MRO found here.
HANDLERS = {
    RequestValidationError: invalid_request,
    ConfigError: unservable_request,
    UnknownModel: unknown_model,
    RayError: replica_lost,
}


def logged(what: str, error: BaseException) -> str:
    """What a client is told of an internal error: `what` and an id. The error itself (Ray's pid, address and
    actor, a torch message, the remote traceback) goes to the log only, under that id."""
    error_id = uuid.uuid4().hex[:16]
    logger.error("%s (error id %s)", what, error_id, exc_info=error)
    return f"{what} (error id {error_id})"


def overloaded(error: BackPressureError) -> JSONResponse:
    """Serve's backpressure as an OpenAI error (Serve would answer a bare-text 503 itself)."""
    headers = {} if error.retry_after_s is None else {"Retry-After": str(math.ceil(error.retry_after_s))}
    body = error_body(f"The server is overloaded: {error.message}", kind="server_error", code="overloaded")
    return JSONResponse(body, status_code=error.status_code, headers=headers)
