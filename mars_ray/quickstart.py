"""`mars-ray quickstart`: the offline demo end to end, on this machine, in minutes.

Prepares the `tiny` preset, runs AR SFT then MARS on 2 Ray Train workers over the bundled data
(`configs/quickstart.yaml`), sweeps tau on held-out prompts, and prints how to use the result.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import transformers
from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args, models
from mars_ray.core.errors import ConfigError
from mars_ray.evaluate import EvalConfig, evaluate
from mars_ray.train.config import TrainConfig, load_config

QUICKSTART_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml"


class QuickstartConfig(BaseModel):
    """The demo's own options; the training config's keys are `TrainConfig`'s, as `key=value` arguments."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: Path = Field(default=QUICKSTART_CONFIG, description="YAML file of training config keys")
    tasks_limit: int = Field(default=200, ge=1, description="held-out tasks to evaluate")
    dialogs_limit: int = Field(default=50, ge=1, description="held-out dialogs to evaluate")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("quickstart", help="train and evaluate the tiny offline demo end to end")
    cli_args.add_config_arguments(parser, QuickstartConfig)
    cli_args.add_override_arguments(parser, TrainConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    began = time.perf_counter()
    options = cli_args.config_from_args(QuickstartConfig, args)
    transformers.utils.logging.disable_progress_bar()
    print(f"tiny preset: {models.prepare('tiny')}")
    config = load_config(options.config, args.overrides)
    if "mars" not in config.stages:
        raise ConfigError("stages", "the quickstart evaluates the mars stage, keep it")
    import ray  # Ray: imported only by the commands that use it

    from mars_ray.train.run import run_training, worker_runtime_env

    if not ray.is_initialized():  # a cluster of its own: the demo promises 2 workers on this machine
        ray.init(address="local", runtime_env=worker_runtime_env())
    finals = run_training(config)
    taus = [1.0, 0.9, 0.8]
    report = evaluate(
        EvalConfig(
            model=str(finals["mars"]),
            baseline=str(finals["ar-sft"]) if "ar-sft" in finals else None,
            baseline_taus=taus,
            taus=taus,
            tasks_limit=options.tasks_limit,
            dialogs_limit=options.dialogs_limit,
            output=config.run_dir / "eval.json",
        )
    )
    model = finals["mars"]
    print(
        f"\nHeld-out prompts, block size {config.block_size}: tokens per forward, task accuracy, and"
        " agreement with the model's own greedy reply and with the AR SFT model's (`base`)\n"
    )
    print(report.table())
    print(
        f"\nDone in {(time.perf_counter() - began) / 60:.1f} min. The MARS model is a plain HF folder:\n"
        f"  {model}\n"
        "Try it:\n"
        f'  mars-ray generate --model {model} --tau 0.9 --prompt "Count from 3 to 9."\n'
        "Serve it (OpenAI-compatible API on 127.0.0.1:8000):\n"
        f"  mars-ray serve --model {model}"
    )
