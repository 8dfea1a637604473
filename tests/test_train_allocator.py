"""The workers of a cluster that training starts run on Ray's bundled jemalloc (glibc malloc fragments under
the CPU training step: BENCHMARKS.md, "jemalloc in the training workers"); a user's own LD_PRELOAD wins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from test_train_job import kill_cluster

from mars_ray.train.run import worker_runtime_env

DRIVER = """
import ray
from mars_ray.train.config import TrainConfig
from mars_ray.train.run import start_ray
start_ray(TrainConfig(model="tiny", datasets=["tasks"], num_workers=1))

@ray.remote
def allocator() -> str:
    with open("/proc/self/maps") as maps:
        return "jemalloc" if "libjemalloc" in maps.read() else "glibc"

print("worker allocator:", ray.get(allocator.remote()), flush=True)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_started_cluster_preloads_jemalloc_in_its_workers():
    temp_dir = tempfile.mkdtemp(prefix="ray-alloc-", dir="/tmp")  # short: socket paths are limited
    env = {**os.environ, "RAY_TMPDIR": temp_dir, "RAY_AUTH_MODE": "disabled"}
    env.pop("RAY_ADDRESS", None)
    env.pop("LD_PRELOAD", None)
    try:
        driver = subprocess.run(
            [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=180
        )
    finally:  # a driver that timed out leaves its cluster behind
        kill_cluster(Path(temp_dir))
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert driver.returncode == 0, driver.stderr[-3000:]
    assert "worker allocator: jemalloc" in driver.stdout


def test_a_users_preload_is_left_alone(monkeypatch):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert worker_runtime_env()["env_vars"]["LD_PRELOAD"].endswith("libjemalloc.so")
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc.so")
    assert worker_runtime_env() == {}
