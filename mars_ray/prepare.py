"""`mars-ray prepare`: build an offline preset once (a cached HF folder), so later runs start at once."""

from __future__ import annotations

import argparse

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args, models


class PrepareConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: models.Preset = Field(default="tiny", description="the offline preset to build")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prepare", help="build an offline model preset into the cache")
    cli_args.add_config_arguments(parser, PrepareConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    print(models.prepare(cli_args.config_from_args(PrepareConfig, args).model))
