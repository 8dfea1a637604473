"""`mars-ray generate` on the tiny preset: JSON out, exact greedy at tau = 1, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from mars_ray import models
from mars_ray.data import chat_prompt_ids


def mars_ray(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mars_ray.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_generate_json_equals_transformers_greedy():
    done = mars_ray(
        "generate", "--model", "tiny", "--prompt", "Count from 3 to 9.", "--max-new-tokens", "12", "--json"
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(out) == {"text", "token_ids", "forward_passes", "tokens_per_forward", "mode"}
    assert out["mode"] == "ar"
    model, tokenizer = models.load("tiny")
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": "Count from 3 to 9."}])
    greedy = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)[
        0, len(prompt) :
    ].tolist()
    assert out["token_ids"] == greedy
    assert out["forward_passes"] == len(greedy) and out["tokens_per_forward"] == 1.0
    assert out["text"] == tokenizer.decode(greedy, skip_special_tokens=True)

    verified = mars_ray(
        "generate",
        "--model",
        "tiny",
        "--prompt",
        "Count from 3 to 9.",
        "--max-new-tokens",
        "12",
        "--json",
        "--verify",
        "--tau",
        "0.2",
    )
    assert verified.returncode == 0, verified.stderr
    out = json.loads(verified.stdout.strip().splitlines()[-1])
    assert out["token_ids"] == greedy and out["mode"] == "verify"


def test_generate_errors_name_the_problem():
    missing = mars_ray("generate", "--model", "./no-such-folder", "--prompt", "hi")
    assert missing.returncode == 2 and "no-such-folder" in missing.stderr
    bad_tau = mars_ray("generate", "--model", "tiny", "--prompt", "hi", "--tau", "-1")
    assert bad_tau.returncode == 2 and "tau" in bad_tau.stderr


def test_commands_without_ray_run_where_ray_is_not_installed():
    """A lent GPU machine has torch but no registry to install Ray from: the decode, eval and bench
    commands, the distiller and the training step must not need it (scripts/gpu_bench.sh runs there)."""
    blocked = (
        "import sys; sys.modules['ray'] = None\n"  # `import ray` now raises ImportError
        "import mars_ray.distill, mars_ray.train.steps, mars_ray.evaluate, mars_ray.bench.decode\n"
        "from mars_ray.cli import main\n"
        "main(['generate', '--model', 'tiny', '--prompt', 'hi', '--max-new-tokens', '4', '--json'])\n"
    )
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1])["forward_passes"] >= 1
    needs_ray = subprocess.run(
        [sys.executable, "-c", "import sys; sys.modules['ray'] = None; import mars_ray.train.run"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert needs_ray.returncode != 0 and "ray" in needs_ray.stderr  # the block itself works


def test_every_command_help_lists_every_config_field_with_its_description():
    """One mechanism: each command's config is a typed model whose every field has a description, and its
    `--help` lists each field (as a flag, or as a key for the `key=value` commands) with that description."""
    import argparse

    from mars_ray.bench.decode import BenchConfig
    from mars_ray.bench.forward import ForwardBenchConfig
    from mars_ray.calibrate import CalibrateConfig
    from mars_ray.cli import build_parser
    from mars_ray.cli_args import flag
    from mars_ray.distill import DistillConfig
    from mars_ray.evaluate import EvalConfig
    from mars_ray.generate import GenerateConfig
    from mars_ray.prepare import PrepareConfig
    from mars_ray.quickstart import QuickstartConfig
    from mars_ray.serve.config import AppConfig, ModelConfig, TauObjective
    from mars_ray.train.command import TrainCommandConfig
    from mars_ray.train.config import TrainConfig

    def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return action.choices[name]

    root = build_parser()
    commands = {
        ("generate",): [(GenerateConfig, set())],
        ("eval",): [(EvalConfig, set())],
        ("calibrate",): [(CalibrateConfig, set())],
        ("distill",): [(DistillConfig, set())],
        ("bench", "decode"): [(BenchConfig, set())],
        ("bench", "forward"): [(ForwardBenchConfig, set())],
        ("prepare",): [(PrepareConfig, set())],
        ("train",): [(TrainConfig, set()), (TrainCommandConfig, set())],
        ("quickstart",): [(TrainConfig, set()), (QuickstartConfig, set())],
        ("serve",): [(ModelConfig, {"tau_control"}), (TauObjective, set()), (AppConfig, {"models"})],
    }
    for path, configs in commands.items():
        parser = root
        for name in path:
            parser = subparser(parser, name)
        text = " ".join(parser.format_help().split())
        for config, skip in configs:
            keyed = config is TrainConfig
            for name, field in config.model_fields.items():
                assert field.description, f"{config.__name__}.{name} has no description"
                if name in skip:
                    continue
                assert (f"{name}:" if keyed else flag(name)) in text, (path, name)
                assert " ".join(field.description.split()[:3]) in text, (path, name)
