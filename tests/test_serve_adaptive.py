"""Load-adaptive tau on a real cluster: live knobs through `serve deploy`, and replicas only after tau.

A `ray start --head` of its own (own temp dir and ports), apps deployed with the `serve deploy` CLI from
YAML built on serve_configs/tiny-adaptive.yaml, load over real HTTP, state read from `GET /v1/status`.
"""

from __future__ import annotations

import asyncio
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
DASHBOARD_PORT, HTTP_PORT = 8276, 8146
BIN = Path(sys.executable).parent
ENV = {
    **os.environ,
    "RAY_AUTH_MODE": "disabled",
    "RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",  # replicas report twice a second
}


@pytest.fixture(scope="module")
def dashboard():
    temp_dir = Path(tempfile.mkdtemp(prefix="ray-adaptive-", dir="/tmp"))
    subprocess.run(
        [
            str(BIN / "ray"), "start", "--head", "--num-cpus", "4", "--disable-usage-stats",
            "--temp-dir", str(temp_dir), "--port", "6396", "--ray-client-server-port", "23106",
            "--dashboard-host", "127.0.0.1", "--dashboard-port", str(DASHBOARD_PORT),
            "--dashboard-agent-listen-port", "52396",
        ],
        env=ENV, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    url = f"http://127.0.0.1:{DASHBOARD_PORT}"
    try:
        # `ray start` returns before the dashboard serves Serve's REST API, later still on a busy machine
        wait_for(lambda: serve_api_answers(url), 120, "the dashboard's Serve API")
        yield url
    finally:
        for process in psutil.process_iter(["cmdline"]):
            if any(str(temp_dir) in part for part in process.info["cmdline"] or ()):
                for child in [*process.children(recursive=True), process]:
                    child.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)


def base_config() -> dict:
    config = yaml.safe_load((REPO / "serve_configs" / "tiny-adaptive.yaml").read_text())
    config["http_options"]["port"] = HTTP_PORT
    return config


def serve_api_answers(dashboard: str) -> bool:
    try:
        return httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


def deploy(config: dict, dashboard: str, tmp_path: Path) -> None:
    path = tmp_path / f"serve-{time.monotonic_ns()}.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [str(BIN / "serve"), "deploy", str(path), "--address", dashboard],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"serve deploy failed: {done.stderr[-2000:]}"


def replicas(app_prefix: str = "") -> dict[str, dict]:
    """The live replicas of the `tiny` model as `/v1/status` shows them; {} while the app is not up."""
    try:
        response = httpx.get(f"http://127.0.0.1:{HTTP_PORT}{app_prefix}/v1/status", timeout=10)
        return response.json()["models"].get("tiny", {}) if response.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):
        return {}


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(1)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_changed_knobs_reach_running_replicas_without_restart(dashboard, tmp_path):
    config = base_config()
    deploy(config, dashboard, tmp_path)
    before = wait_for(
        lambda: {r: s for r, s in replicas().items() if "objective" in s}, 180, "the replica's first status"
    )
    assert [s["objective"]["tau_min"] for s in before.values()] == [0.7]

    changed = copy.deepcopy(config)
    changed["applications"][0]["deployments"][0]["user_config"].update(tau_min=0.6, tau_max=0.9)
    deploy(changed, dashboard, tmp_path)
    after = wait_for(
        lambda: {r: s for r, s in replicas().items() if s["objective"]["tau_min"] == 0.6}, 60, "the new knobs"
    )
    assert after.keys() == before.keys()  # the same replicas...
    assert [s["pid"] for s in after.values()] == [s["pid"] for s in before.values()]  # ...and processes
    assert all(s["controller"]["tau"] <= 0.9 for s in after.values())  # clamped into the new range at once


async def overload(prefix: str, clients: int, stop: asyncio.Event) -> int:
    """`clients` streaming chats back to back until `stop`; returns how many completed."""
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Count from 3 to 9."}],
        "max_tokens": 32,
        "stream": True,
    }
    done = 0
    async with httpx.AsyncClient(timeout=120) as client:

        async def one_client() -> None:
            nonlocal done
            while not stop.is_set():
                url = f"http://127.0.0.1:{HTTP_PORT}{prefix}/v1/chat/completions"
                async with client.stream("POST", url, json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
                done += response.status_code == 200

        await asyncio.gather(*(one_client() for _ in range(clients)))
    return done


def test_replicas_are_added_only_once_tau_is_spent(dashboard, tmp_path):
    """Two apps under the same overload: `spent` sits at its floor (tau_min = tau_max), `trading` still has
    tau to give (its controller is far from its floor). Only `spent` scales out; both start with one."""
    template = base_config()["applications"][0]
    template["args"]["models"][0].update(
        max_batch_size=2, max_replicas=2, upscale_delay_s=1, downscale_delay_s=3, look_back_period_s=2
    )
    knobs = dict(metric="queue_depth", target=1, patience=1, interval_s=0.5)
    spent, trading = copy.deepcopy(template), copy.deepcopy(template)
    spent.update(name="spent", route_prefix="/spent")
    spent["deployments"][0]["user_config"] = dict(knobs, tau_min=1.0, tau_max=1.0)
    trading.update(name="trading", route_prefix="/trading")
    trading["deployments"][0]["user_config"] = dict(knobs, tau_min=0.05, tau_step=0.01, patience=10**6)
    deploy({**base_config(), "applications": [spent, trading]}, dashboard, tmp_path)
    for prefix in ("/spent", "/trading"):
        wait_for(lambda p=prefix: replicas(p), 180, f"{prefix} up")

    async def load_and_watch() -> tuple[list[int], list[dict], int]:
        """Overload both apps the same until `spent` runs a second replica (a new one starts slowly on 2
        busy cores), for at least 30 s and at most 150 s."""
        spent_counts, trading_states, stop = [], [], asyncio.Event()
        loads = [asyncio.create_task(overload(p, 8, stop)) for p in ("/spent", "/trading")]
        started = time.monotonic()
        while (elapsed := time.monotonic() - started) < 150 and not (elapsed > 30 and 2 in spent_counts):
            await asyncio.sleep(1)
            spent_counts.append(len(await asyncio.to_thread(replicas, "/spent")))
            trading_states.append(await asyncio.to_thread(replicas, "/trading"))
        stop.set()
        return spent_counts, trading_states, sum(await asyncio.gather(*loads))

    spent_counts, trading_states, completed = asyncio.run(load_and_watch())
    assert completed > 0
    assert max(spent_counts) == 2, spent_counts  # tau had nothing left: a replica was added
    assert max(len(s) for s in trading_states) == 1  # same load, tau above its floor: no replica
    controllers = [s["controller"] for state in trading_states for s in state.values()]
    assert any(c["over_objective"] for c in controllers) and not any(c["at_floor"] for c in controllers)
    # load gone, tau at tau_max: the extra replica goes away again
    wait_for(lambda: len(replicas("/spent")) == 1, 90, "scale-in of /spent")
