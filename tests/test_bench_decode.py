"""`mars-ray bench decode`'s settings and text checks on the tiny preset: more taus give a row each, every
verified row equals the engine's own AR, and the vLLM engine runs only the methods it has."""

from __future__ import annotations

import pytest
import torch

from mars_ray import cli_args
from mars_ray.bench.decode import BenchConfig, run_bench
from mars_ray.bench.decoders import METHODS, NATIVE_ONLY, VLLM_METHODS
from mars_ray.core.errors import ConfigError

BF16_NATIVE = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def small(**fields) -> BenchConfig:
    """Two prompts, six tokens, batch 1, one round: AR, the engine's AR and verified at tau 0.9 and 0.5."""
    methods = ("ar", "ar-sliding", "mars-verify")
    defaults = {"prompts": 2, "max_new_tokens": 6, "batch_sizes": (1,), "repeats": 1, "methods": methods}
    return BenchConfig(**{"model": "tiny", "taus": (0.5,), **defaults, **fields})


def test_more_taus_give_a_row_each_and_verified_rows_equal_the_engines_own_ar():
    report = run_bench(small())
    rows = {(m.method, m.tau): m for m in report.measurements}
    assert set(rows) == {("ar", None), ("ar-sliding", 1.0), ("mars-verify", 0.9), ("mars-verify", 0.5)}
    for tau in (0.9, 0.5):
        assert rows["mars-verify", tau].same_as_ar == 1.0  # verified: exactly the engine's AR
        assert rows["mars-verify", tau].same_as_greedy == 1.0  # and HF generate's (fp32, no padding)
    assert rows["ar-sliding", 1.0].tokens_per_forward == 1.0
    assert all(m.forwards > 0 and m.peak_memory_mb is not None for m in report.measurements)
    assert "| mars-verify | 0.5 | 1 |" in report.table()


def test_prepack_runs_the_checkpoint_packed_as_the_engine_serves_it():
    """`prepack`: the checkpoint's rows run its packed weights (and say so), the baseline's stock; verified
    is still exactly the engine's AR. Refused, naming the field, where there is nothing to pack (fp32)."""
    with pytest.raises(ConfigError) as error:
        run_bench(BenchConfig(model="tiny", dtype="float32", prepack=True, prompts=1, methods=("ar",)))
    assert error.value.field == "prepack"
    if not BF16_NATIVE:
        pytest.skip("this CPU has no native bf16 for oneDNN")
    config = small(baseline="tiny", dtype="bfloat16", prepack=True)
    rows = {(m.method, m.tau): m for m in run_bench(config).measurements}
    assert "packed" not in rows["ar-base", None].note
    assert all("packed weights" in rows[key].note for key in rows if key[0] != "ar-base")
    assert rows["mars-verify", 0.5].same_as_ar == 1.0


def test_engine_vllm_runs_what_vllm_has():
    assert BenchConfig(model="tiny").methods == METHODS
    assert BenchConfig(model="tiny", engine="vllm").methods == VLLM_METHODS  # the default: all it runs
    assert not set(VLLM_METHODS) & set(NATIVE_ONLY)
    named = ("ar", "mars-verify")
    assert BenchConfig(model="tiny", engine="vllm", methods=named).methods == named
    with pytest.raises(ValueError, match="native decoders only"):
        BenchConfig(model="tiny", engine="vllm", methods=("mars-verify", "engine"))


BAD = [("tau", 1.5), ("tau", 0.0), ("taus", (0.5, -1.0)), ("block_size", 0), ("dtype", "int8")]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_bad_settings_name_their_field(field, value):
    with pytest.raises(ConfigError) as error:
        cli_args.validated(BenchConfig, {"model": "tiny", field: value})
    assert error.value.field.split(".")[0] == field
