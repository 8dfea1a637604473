"""`mars-ray train --config FILE [key=value ...]`: the two-stage recipe on Ray Train."""

from __future__ import annotations

import argparse

from mars_ray import cli_args
from mars_ray.train.config import TrainConfig, load_config


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="AR SFT then MARS on Ray Train workers",
        description="A YAML config (--config) and key=value overrides, validated before any worker starts.",
        epilog=cli_args.keys_help(TrainConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML file of config keys (see configs/)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="replace a config value (YAML)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    from mars_ray.train.run import run_training  # Ray: imported only by the commands that use it

    finals = run_training(load_config(args.config, args.overrides))
    for stage, folder in finals.items():
        print(f"{stage}: {folder}")
