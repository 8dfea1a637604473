"""`mars-ray prepare`: build an offline preset once (a cached HF folder), so later runs start at once."""

from __future__ import annotations

import argparse

from mars_ray import models


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("prepare", help="build an offline model preset into the cache")
    parser.add_argument("--model", default="tiny", choices=sorted(models.PRESETS))
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    print(models.prepare(args.model))
