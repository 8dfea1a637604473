"""`mars-ray eval` and `mars-ray bench decode` on the tiny preset: the reports hold what they claim."""

from __future__ import annotations

import json

import pytest

from mars_ray import models
from mars_ray.bench import BenchConfig, ForwardBenchConfig, bench_prompts, run_bench, run_forward_bench
from mars_ray.evaluate import EvalConfig, evaluate


def test_eval_sweep_writes_json_and_plot(tmp_path):
    config = EvalConfig(
        model="tiny",
        baseline="tiny",
        taus=(1.0, 0.5),
        tasks_limit=6,
        dialogs_limit=4,
        max_new_tokens=8,
        output=tmp_path / "eval.json",
        plot=tmp_path / "pareto.png",
    )
    report = evaluate(config)
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert len(saved["scores"]) == 2 * 2 * 2  # models x sources x taus
    greedy = next(s for s in report.scores if (s.model, s.source, s.tau) == ("mars", "chatterbot", 1.0))
    assert greedy.accuracy == 1.0 and greedy.tokens_per_forward == 1.0  # tau = 1 agrees with itself
    assert (tmp_path / "pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "| mars | 0.5 |" in report.table()


def test_eval_rejects_bad_taus():
    with pytest.raises(ValueError, match="taus"):
        EvalConfig(model="tiny", taus=(1.5,))


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
