"""Access to the API: the key on every route (but the probe and the schema) under a route prefix, CORS only
for configured origins, the body limit enforced while the body streams in, the key never shown.

A Serve app of its own on 127.0.0.1 (the tiny preset) under the route prefix `/mars`, with an API key, one
allowed browser origin and a 64 KiB body limit.
"""

from __future__ import annotations

import re
import select
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from serving import free_port, local_app

pytestmark = pytest.mark.slow

KEY = "sk-test-7f3c9a1e5d"
ALLOWED = "http://allowed.example"
PREFIX = "/mars"
LIMIT = 64 << 10
OPEN = {"/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"}  # the probe and the schema
METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")


@pytest.fixture(scope="module")
def server():
    import ray

    app = {
        "models": [{"model": "tiny", "num_cpus": 0.5}],
        "api_key": KEY,
        "cors_origins": [ALLOWED],
        "max_body_bytes": LIMIT,
    }
    with local_app(app, 8133, route_prefix=PREFIX, _metrics_export_port=free_port(9481)) as url:
        yield url + PREFIX, ray.get_runtime_context().get_node_id()


def test_every_route_and_method_needs_the_key_under_a_route_prefix(server):
    """Each route the FastAPI app has, with each method, and a path it does not have: 401 without the right
    key (a prefix in front changes nothing); only the load balancers' probe and the schema are open."""
    from mars_ray.serve.ingress import api

    url, _ = server
    paths = {route.path.replace("{model:path}", "tiny") for route in api.routes} | {"/v2/unrouted"}
    assert {"/v1/chat/completions", "/v1/completions", "/v1/models/tiny", "/tokenize", "/detokenize"} <= paths
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": KEY},
        {"Authorization": "Basic x"},
    ):
        for path in sorted(paths - OPEN):
            for method in METHODS:
                response = httpx.request(method, url + path, json={}, headers=headers, timeout=60)
                assert response.status_code == 401, (headers, method, path)
                assert response.headers["www-authenticate"] == "Bearer"
                if method != "HEAD":
                    assert response.json()["error"]["code"] == "invalid_api_key"
    for path in OPEN:  # open: load balancers probe /health, clients read the schema
        assert httpx.get(url + path, timeout=60).status_code == 200, path
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/v1/models/tiny", headers=auth, timeout=60).status_code == 200


def test_the_official_client_needs_the_key(server):
    url, _ = server
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4)
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


def send_chunked(
    url: str, path: str, headers: dict[str, str], total: int, piece: int = 8 << 10
) -> tuple[bytes, int]:
    """POST a chunked body of up to `total` bytes, `piece` bytes at a time, at a pace the server can follow,
    and stop as soon as it answers (or drops the connection): its answer, and how much of the body went."""
    host, port = url.removeprefix("http://").split("/")[0].split(":")
    head = f"POST {path} HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
    chunk = b"%x\r\n%s\r\n" % (piece, b"y" * piece)
    sent, answer = 0, b""
    with socket.create_connection((host, int(port)), timeout=120) as connection:
        connection.sendall(head.encode())
        try:
            while sent < total and not select.select([connection], [], [], 0.005)[0]:
                connection.sendall(chunk)
                sent += piece
            if sent >= total:
                connection.sendall(b"0\r\n\r\n")
            while b"\r\n\r\n" not in answer and (data := connection.recv(1 << 16)):
                answer += data
        except ConnectionError:
            pass  # refused and closed: what arrived before is the answer
    return answer, sent


def test_a_chunked_body_is_refused_at_the_limit_while_it_streams(server):
    """A chunked body 512 times the limit, sent at a pace the server can follow: a 413 (or, after it, the
    connection dropped) arrives long before the body ends, so the ingress never holds more than the limit.
    A server that read the body whole first would answer only after all of it; with or without the key."""
    url, _ = server
    total = 512 * LIMIT  # 32 MiB
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    for path, headers in (("/v1/chat/completions", auth), ("/health", {})):
        answer, sent = send_chunked(url, PREFIX + path, headers, total)
        assert sent < total // 4, (path, sent)
        assert not answer or re.match(rb"HTTP/1\.1 413 ", answer), (path, answer[:200])
    answer, _ = send_chunked(
        url, PREFIX + "/v1/chat/completions", {}, total
    )  # no key: refused before the body
    assert re.match(rb"HTTP/1\.1 401 ", answer), answer[:200]
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(f"{url}/v1/models", headers=auth, timeout=60).status_code == 200  # still serving


def test_the_key_is_in_no_metric(server):
    """Ray's Prometheus endpoint, once it reports this app's requests (with the key, without, wrong): the key
    is in no metric name, label or value."""
    import ray

    url, _ = server
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"Authorization": KEY}, {}):
        httpx.get(f"{url}/v1/models", headers=headers, timeout=60)
        httpx.post(
            f"{url}/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            headers=headers,
            timeout=60,
        )
    port = ray.nodes()[0]["MetricsExportPort"]
    deadline, text = time.monotonic() + 150, ""
    while time.monotonic() < deadline and not re.search(r'ray_serve_num_http_requests\S*\{[^}]*"401"', text):
        time.sleep(2)  # replicas and proxies report every few seconds
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    assert 'application="mars"' in text and "ray_mars_generation_tokens" in text, "the app's metrics"
    assert KEY not in text
