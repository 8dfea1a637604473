"""The one error type on the HTTP side: a `ConfigError` from the ingress or from an engine (which reaches the
ingress wrapped by Ray) is a 400 with OpenAI's error body whose `param` is the request's name of the field;
`UnknownModel` is its 404. The engine names fields as `DecodeConfig` does; the rename happens here only."""

from __future__ import annotations

import asyncio
import json
import pickle

from ray.exceptions import RayTaskError

from mars_ray.core.errors import ConfigError
from mars_ray.serve.http_errors import HANDLERS, UnknownModel, replica_lost


def answer(error: Exception) -> tuple[int, dict]:
    """What the app answers `error` with: the handler Starlette picks (the first class of its MRO)."""
    handler = next(HANDLERS[cls] for cls in type(error).__mro__ if cls in HANDLERS)
    response = asyncio.run(handler(None, error))
    return response.status_code, json.loads(response.body)["error"]


def test_a_config_error_is_a_400_naming_the_requests_field():
    status, body = answer(ConfigError("n", "at most 8 choices per request"))
    assert status == 400
    assert body == {
        "message": "at most 8 choices per request",
        "type": "invalid_request_error",
        "param": "n",
        "code": None,
    }
    assert answer(ConfigError("max_new_tokens", "invalid value 0"))[1]["param"] == "max_tokens"


def test_an_engines_error_arrives_through_ray_as_the_same_400():
    cause = pickle.loads(pickle.dumps(ConfigError("max_new_tokens", "invalid value 0")))  # as Ray ships it
    wrapped = RayTaskError("EngineDeployment.chat", "traceback", cause).as_instanceof_cause()
    assert isinstance(wrapped, ConfigError)
    assert answer(wrapped) == (400, answer(ConfigError("max_new_tokens", "invalid value 0"))[1])
    lost = RayTaskError("EngineDeployment.chat", "traceback", RuntimeError("boom")).as_instanceof_cause()
    response = asyncio.run(replica_lost(None, lost))  # any other failure of the replica: retry
    assert response.status_code == 503 and response.headers["retry-after"] == "1"


def test_an_unknown_model_is_a_404():
    error = pickle.loads(pickle.dumps(UnknownModel("model", "The model `gpt-9` does not exist.")))
    assert answer(error) == (
        404,
        {
            "message": "The model `gpt-9` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        },
    )
