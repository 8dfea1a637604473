"""`mars-ray bench decode --engine vllm`: the MARS methods decoded by vLLM beside HF generate, measured the
same way; vLLM's verified rows equal vLLM's AR at every tau, and its AR equals HF generate (fp32).

Real vLLM (the CPU build) in a `mars-ray` process of its own (each `vllm.LLM` in the test process counts
against the few one process may start), on a tiny random checkpoint of `test_vllm_mars`."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_vllm_mars import write_checkpoint

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


def test_bench_decode_on_vllm_measures_the_mars_methods_beside_hf(tmp_path):
    checkpoint = write_checkpoint("llama", tmp_path / "llama")
    output = tmp_path / "decode.json"
    asked = ["--model", checkpoint, "--engine", "vllm", "--dtype", "float32", "--prompts", "4"]
    asked += ["--max-new-tokens", "32", "--batch-sizes", "1", "4", "--repeats", "1", "--taus", "0.5"]
    done = subprocess.run(
        [sys.executable, "-m", "mars_ray.cli", "bench", "decode", *asked, "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(output.read_text())["measurements"]
    found = {(r["method"], r["tau"], r["batch"]) for r in rows}
    settings = [("ar", None), ("ar-sliding", 1.0), ("prompt-lookup", None)]
    settings += [(method, tau) for tau in (0.9, 0.5) for method in ("mars-cached", "mars-verify")]
    assert found == {(method, tau, batch) for method, tau in settings for batch in (1, 4)}
    for r in rows:
        assert r["tokens"] > 0 and r["row_forwards"] > 0 and r["seconds"] > 0
        if r["method"] in ("ar-sliding", "mars-cached", "mars-verify"):  # vLLM: forwards as it reports them
            assert r["forwards"] is None and r["peak_memory_mb"] is None and r["note"].startswith("vLLM")
        if r["method"] == "mars-verify":
            assert r["same_as_ar"] == 1.0  # exactly vLLM's AR at any tau
        if r["method"] == "ar-sliding":
            assert r["tokens_per_forward"] == 1.0  # tau = 1: vLLM's plain AR step
            if r["batch"] == 1:  # HF's own left padding may move a near-tie in a batch
                assert r["same_as_greedy"] == 1.0
    verified = [r for r in rows if r["method"] == "mars-verify" and r["tau"] == 0.5]
    assert sum(r["tokens"] for r in verified) > sum(r["row_forwards"] for r in verified)  # proposals held
    assert "| mars-verify | 0.5 | 4 |" in done.stdout
