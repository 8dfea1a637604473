"""`ray job submit` of the training entrypoint, exactly as the README shows it, against a local
`ray start --head` (slow). The head has its own temp dir and ports, and is torn down by killing its own
processes: a bare `ray stop` would stop every Ray cluster on the machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
DASHBOARD_PORT = 8271


def kill_cluster(temp_dir: Path) -> None:
    """Every process of the cluster rooted in `temp_dir`: its daemons name it, the rest descend from them."""
    roots = [
        process
        for process in psutil.process_iter(["cmdline"])
        if any(str(temp_dir) in arg for arg in process.info["cmdline"] or ()) and process.pid != os.getpid()
    ]
    victims = set(roots)
    for root in roots:
        with contextlib.suppress(psutil.NoSuchProcess):
            victims.update(root.children(recursive=True))
    for process in victims:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(list(victims), timeout=10)


@pytest.fixture
def ray_head():
    """A fresh head started from this venv (so a job's `python` is this venv's), auth off for the test."""
    temp_dir = Path(
        tempfile.mkdtemp(prefix="ray-train-tests-", dir="/tmp")
    )  # short: socket paths are limited
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    env.pop("RAY_ADDRESS", None)
    start = [
        *(str(BIN / "ray"), "start", "--head", "--num-cpus", "2", "--disable-usage-stats"),
        *("--temp-dir", str(temp_dir), "--port", "6391", "--ray-client-server-port", "23101"),
        *("--dashboard-host", "127.0.0.1", "--dashboard-port", str(DASHBOARD_PORT)),
        *("--dashboard-agent-listen-port", "52391"),
    ]
    try:
        subprocess.run(start, env=env, check=True, capture_output=True, timeout=120)
        yield env
    finally:
        kill_cluster(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_ray_job_submit_trains_both_stages(ray_head, tmp_path):
    submit = [
        *(str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{DASHBOARD_PORT}"),
        *("--working-dir", ".", "--", "python", "jobs/train_mars.py", "--config", "configs/quickstart.yaml"),
        *(
            f"output_dir={tmp_path}",
            "name=job",
            "datasets=tasks",
            "tasks_count=64",
            "steps=2",
            "batch_size=2",
        ),
    ]
    job = subprocess.run(submit, cwd=REPO, env=ray_head, capture_output=True, text=True, timeout=600)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert "succeeded" in job.stdout
    for stage in ("ar-sft", "mars"):
        assert (tmp_path / "job" / stage / "final" / "model.safetensors").exists()
        assert f"{stage}: {tmp_path / 'job' / stage / 'final'}" in job.stdout
