"""Access to the API: the key on every /v1 route, CORS only for configured origins, the key never shown.

A Serve app of its own on 127.0.0.1 (the tiny preset) with an API key and one allowed browser origin.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from serving import local_app

pytestmark = pytest.mark.slow

KEY = "sk-test-7f3c9a1e5d"
ALLOWED = "http://allowed.example"


@pytest.fixture(scope="module")
def server():
    import ray

    app = {"models": [{"model": "tiny", "num_cpus": 0.5}], "api_key": KEY, "cors_origins": [ALLOWED]}
    with local_app(app, 8133) as url:
        yield url, ray.get_runtime_context().get_node_id()


def test_every_v1_route_needs_the_key(server):
    url, _ = server
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic x"},
    ):
        for method, path, payload in (
            ("POST", "/v1/chat/completions", body),
            ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 4}),
            ("GET", "/v1/models", None),
            ("GET", "/v1/status", None),
        ):
            response = httpx.request(method, url + path, json=payload, headers=headers, timeout=60)
            assert response.status_code == 401, (headers, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{url}/health", timeout=60).status_code == 200  # open: load balancers probe it
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny", messages=body["messages"], max_tokens=4)
    assert reply.usage.completion_tokens == 4


def test_cors_only_for_configured_origins(server):
    url, _ = server
    auth = {"Authorization": f"Bearer {KEY}"}
    allowed = httpx.get(f"{url}/v1/models", headers={**auth, "Origin": ALLOWED}, timeout=60)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    other = httpx.get(f"{url}/v1/models", headers={**auth, "Origin": "http://evil.example"}, timeout=60)
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    preflight = httpx.options(
        f"{url}/v1/chat/completions",
        headers={"Origin": ALLOWED, "Access-Control-Request-Method": "POST"},
        timeout=60,
    )
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ALLOWED
    assert "Authorization" in preflight.headers["access-control-allow-headers"]


def test_the_key_never_appears_in_status_or_logs(server):
    url, _ = server
    status = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert status.status_code == 200 and KEY not in status.text
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    for path in logs.rglob("*"):
        if path.is_file():
            assert KEY not in path.read_text(errors="ignore"), path
