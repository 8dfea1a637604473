"""`mars-ray eval` and `mars-ray bench decode` on the tiny preset: the reports hold what they claim."""

from __future__ import annotations

import json

import pytest
import torch

from mars_ray import models
from mars_ray.bench.decode import BenchConfig, bench_prompts, run_bench
from mars_ray.bench.forward import ForwardBenchConfig, run_forward_bench
from mars_ray.calibrate import CalibrateConfig, calibrate
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.errors import ConfigError
from mars_ray.eval_scores import Score
from mars_ray.evaluate import EvalConfig, EvalReport, evaluate


def test_eval_sweep_writes_json_and_plot(tmp_path):
    config = EvalConfig(
        model="tiny",
        baseline="tiny",
        taus=[1.0, 0.5],
        tasks_limit=6,
        dialogs_limit=4,
        max_new_tokens=8,
        check_greedy=True,
        output=tmp_path / "eval.json",
        plot=tmp_path / "pareto.png",
    )
    report = evaluate(config)
    saved = json.loads((tmp_path / "eval.json").read_text())
    # mars: sources x taus (an uncalibrated model has raw confidences only); base: its greedy replies
    assert len(saved["scores"]) == 2 * 2 + 2
    cells = {(s.model, s.source, s.tau): s for s in report.scores}
    greedy = cells["mars", "chatterbot", 1.0]
    assert greedy.self_exact == 1.0 and greedy.tokens_per_forward == 1.0  # tau = 1 agrees with itself
    assert greedy.base_exact == 1.0  # the base here is the same model: its greedy replies are the same
    assert greedy.greedy_mismatches == 0  # and equal HF generate's, token for token
    assert cells["mars", "tasks", 0.5].acceptance[0] == 1.0  # every forward accepts slot 0
    assert cells["base", "tasks", 1.0].accuracy == cells["mars", "tasks", 1.0].accuracy
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "| mars | lossy | raw | 0.5 |" in report.table()


def test_eval_rejects_bad_taus():
    with pytest.raises(ValueError, match="taus"):
        EvalConfig(model="tiny", taus=[1.5])


def test_bench_decode_measures_every_method(tmp_path):
    config = BenchConfig(
        model="tiny",
        prompts=4,
        max_new_tokens=8,
        batch_sizes=(1, 2),
        cache_blocks=(4,),
        repeats=2,
        output=tmp_path / "b.json",
    )
    report = run_bench(config)
    methods = {(m.method, m.batch) for m in report.measurements}
    assert methods == {(name, b) for name in config.methods for b in (1, 2)}
    for m in report.measurements:
        assert m.tokens > 0 and m.forwards > 0 and m.seconds > 0
        if m.method == "ar":
            assert m.ratio == 1.0 and m.tokens_per_forward <= 1.0
        if m.method == "ar-sliding":
            assert m.tokens_per_forward == 1.0  # tau = 1: one token per forward, nothing wasted on padding
            assert m.same_as_greedy == 1.0  # and the same tokens as HF generate, row by row
    # at tau = 0.9 an untrained model accepts about one token per forward; the cached decoder never fewer
    cached = next(m for m in report.measurements if (m.method, m.batch) == ("mars-cached", 1))
    assert cached.tokens_per_forward >= 1.0
    # alone, HF's greedy AR and MARS's loop at tau = 1 decode the same tokens
    alone = {m.method: m.tokens for m in report.measurements if m.batch == 1}
    assert alone["ar-sliding"] == alone["ar"]
    # the serving engine runs the same decoder: the same tokens, however its rows come and go
    for batch in (1, 2):
        by_method = {m.method: m.tokens for m in report.measurements if m.batch == batch}
        assert by_method["engine"] == by_method["mars-cached"]
    assert json.loads((tmp_path / "b.json").read_text())["measurements"]


def test_bench_decode_against_a_base_model(tmp_path):
    config = BenchConfig(
        model="tiny", baseline="tiny", prompts=2, max_new_tokens=6, batch_sizes=(1,), methods=("ar-sliding",)
    )
    rows = {m.method: m for m in run_bench(config).measurements}
    assert set(rows) == {"ar-base", "ar-sliding"}
    assert rows["ar-base"].ratio == 1.0 and rows["ar-sliding"].ratio_sliding == 1.0
    assert rows["ar-base"].tokens == rows["ar-sliding"].tokens
    assert "x base AR" in run_bench(config).table()


def test_bench_rejects_unknown_method():
    with pytest.raises(ValueError, match="methods"):
        BenchConfig(model="tiny", methods=("warp-drive",))
    with pytest.raises(ValueError, match="repeats"):
        BenchConfig(model="tiny", repeats=0)
    with pytest.raises(ValueError, match="prompt_source"):
        BenchConfig(model="tiny", prompt_source="poems")


def test_bench_prompt_sources_hold_what_they_say():
    _, tokenizer = models.load("tiny")
    tasks, dialogs, mixed = (bench_prompts(tokenizer, 6, source) for source in ("tasks", "dialogs", "mixed"))
    assert len(tasks) == len(dialogs) == len(mixed) == 6
    assert mixed == tasks[:3] + dialogs[:3]  # the same held-out prompts, half of each
    assert not set(map(tuple, tasks)) & set(map(tuple, dialogs))


def test_bench_forward_times_every_window(tmp_path):
    config = ForwardBenchConfig(
        model="tiny", context=8, windows=(1, 4), batch_sizes=(1, 2), steps=3, output=tmp_path / "f.json"
    )
    steps = run_forward_bench(config)
    assert [(s.batch, s.window) for s in steps] == [(1, 1), (1, 4), (2, 1), (2, 4)]
    assert all(s.milliseconds > 0 for s in steps)
    assert [s.ratio for s in steps if s.window == 1] == [1.0, 1.0]
    assert len(json.loads((tmp_path / "f.json").read_text())["steps"]) == 4
    with pytest.raises(ValueError, match="windows"):
        ForwardBenchConfig(model="tiny", windows=(0,))
    with pytest.raises(ConfigError) as error:  # fp32 weights are never packed
        run_forward_bench(ForwardBenchConfig(model="tiny", dtype="float32", prepack=True, steps=1))
    assert error.value.field == "prepack"


def test_bench_forward_times_the_gate_stacked_and_layer_by_layer_beside_eager():
    config = ForwardBenchConfig(
        model="tiny", context=8, windows=(1, 2), batch_sizes=(1,), steps=2, gated_rank=4
    )
    steps = run_forward_bench(config)
    assert [s.forward for s in steps] == ["eager"] * 2 + ["gated r4"] * 2 + ["gated r4 per layer"] * 2
    assert all(s.milliseconds > 0 for s in steps)


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no native bf16 on this CPU")
def test_bench_forward_times_packed_weights_beside_eager():
    config = ForwardBenchConfig(
        model="tiny", dtype="bfloat16", context=8, windows=(1, 2), batch_sizes=(1,), steps=3, prepack=True
    )
    steps = run_forward_bench(config)
    assert [(s.forward, s.batch, s.window) for s in steps] == [
        ("eager", 1, 1),
        ("eager", 1, 2),
        ("packed", 1, 1),
        ("packed", 1, 2),
    ]
    assert all(s.eager_ratio == 1.0 for s in steps if s.forward == "eager")
    gated = run_forward_bench(config.model_copy(update={"gated_rank": 4, "windows": (2,)}))
    assert [s.forward for s in gated] == [
        "eager",
        "packed",
        "gated r4",
        "gated r4 per layer",
        "gated r4 packed",
    ]


def test_calibrate_fits_and_stores_slot_temperatures(tmp_path):
    model, tokenizer = models.load("tiny")
    model.config.mars_block_size = 4  # what training writes
    model.save_pretrained(tmp_path / "ckpt")
    tokenizer.save_pretrained(tmp_path / "ckpt")
    report = calibrate(
        CalibrateConfig(
            model=str(tmp_path / "ckpt"),
            tasks_limit=6,
            dialogs_limit=4,
            max_new_tokens=10,
            plot=tmp_path / "r.png",
        )
    )
    assert len(report.temperatures) == 4 and report.temperatures[0] == 1.0
    assert set(report.splits) == {"calibration", "heldout"}
    for stats in report.splits.values():
        assert [s.slot for s in stats] == [1, 2, 3] and all(s.samples > 0 for s in stats)
        assert all(0 <= s.ece_raw <= 1 and 0 <= s.ece_calibrated <= 1 for s in stats)
        # the fit minimises a proper score on this split: it cannot be badly worse calibrated there
    fitted = report.splits["calibration"]
    assert sum(s.ece_calibrated for s in fitted) <= sum(s.ece_raw for s in fitted) + 0.05
    reloaded, tokenizer = models.load(str(tmp_path / "ckpt"))
    config = DecodeConfig.for_model(reloaded, tokenizer)
    assert config.slot_temperatures == tuple(report.temperatures)
    assert json.loads((tmp_path / "ckpt" / "calibration.json").read_text())["block_size"] == 4
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_calibrate_refuses_a_model_without_a_trained_block_size(tmp_path):
    with pytest.raises(ConfigError) as error:
        calibrate(CalibrateConfig(model="tiny", write=False))
    assert error.value.field == "model"


def test_eval_table_keeps_modes_apart_and_leaves_unmeasured_cells_blank():
    config = EvalConfig(model="tiny", taus=(0.5,), modes=("lossy", "verify"))
    scores = [
        Score(
            model="mars",
            source="tasks",
            confidence="raw",
            tau=0.5,
            prompts=4,
            mode=mode,
            tokens_per_forward=tpf,
            acceptance=[1.0],
            accuracy=acc,
        )
        for mode, tpf, acc in (("lossy", 3.0, 0.5), ("verify", 2.0, 0.75))
    ]
    lines = EvalReport(config=config, scores=scores).table().splitlines()
    assert lines[2] == "| mars | lossy | raw | 0.5 | 3.00 | 50.0 | 100.0 (100.0) |  |"
    assert lines[3] == "| mars | verify | raw | 0.5 | 2.00 | 75.0 | 100.0 (100.0) |  |"
