"""`mars-ray train --config FILE [key=value ...]`: the two-stage recipe on Ray Train."""

from __future__ import annotations

import argparse
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args
from mars_ray.train.config import TrainConfig, load_config


class TrainCommandConfig(BaseModel):
    """Where the training config comes from (its keys are `TrainConfig`'s, as `key=value` arguments)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    config: Path | None = Field(default=None, description="YAML file of config keys (see configs/)")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="AR SFT then MARS on Ray Train workers",
        description="A YAML config (--config) and key=value overrides, validated before any worker starts.",
    )
    cli_args.add_config_arguments(parser, TrainCommandConfig)
    cli_args.add_override_arguments(parser, TrainConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from mars_ray.train.run import run_training  # Ray: imported only by the commands that use it

    command = cli_args.config_from_args(TrainCommandConfig, args)
    finals = run_training(load_config(command.config, args.overrides))
    for stage, folder in finals.items():
        print(f"{stage}: {folder}")
