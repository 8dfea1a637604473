"""`mars-ray`: a thin command line; each subcommand lives beside the code it drives.

Commands that do not need Ray (generate, eval, calibrate, bench, prepare) run where it is not installed,
such as a lent GPU machine with no package registry: the others import it when they run.

A bad setting, whichever command meets it, ends the command with exit code 2 and `error: <field>: <why>`.
"""

from __future__ import annotations

import argparse
import sys

from mars_ray import calibrate, cli_args, distill, evaluate, generate, prepare, quickstart
from mars_ray.bench import decode as bench
from mars_ray.serve import command as serve
from mars_ray.train import command as train

SUBCOMMANDS = (generate, evaluate, calibrate, bench, prepare, distill, train, quickstart, serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mars-ray", description="Train and serve MARS multi-token models on Ray"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in SUBCOMMANDS:
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    with cli_args.bad_settings_exit(f"mars-ray {args.command}"):
        args.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
