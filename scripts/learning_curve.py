"""The learning curve of a MARS run: tokens per forward at one tau and agreement with the base model on
held-out prompts, against the training examples each checkpoint had seen. Prints markdown, writes JSON.

    .venv/bin/python scripts/learning_curve.py --run RUN [RUN ...] --baseline smollm2-135m --output curve.json

Points: the base model (0 examples) and every checkpoint each run kept (`keep_checkpoints`), or only the
optimizer steps `--steps` names (a run still training: the points it has so far). Several runs of one base
(gated beside full MARS on the same data, say) are read in one table: the same held-out prompts and the
base's replies to them, decoded once. The checkpoints are uncalibrated, so every point reads raw
confidences. Tokens per forward are read lossy and verified.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

from mars_ray.data import chat_prompt_ids
from mars_ray.eval_model import ModelUnderTest, curve_point
from mars_ray.evaluate import EvalConfig, heldout_sets
from mars_ray.train.config import TrainConfig
from mars_ray.train.steps import IncompleteCheckpoint, verify_checkpoint


def checkpoints(run: Path, stage: str) -> list[tuple[int, Path]]:
    """(optimizer step, folder) of every kept checkpoint of the stage, then its final folder."""
    found = []
    for folder in (run / stage).glob("checkpoint_*"):
        match = re.fullmatch(r"checkpoint_(\d+)(?:\.\d+)?", folder.name)  # .1: redone after a refused one
        if not match:
            continue
        try:
            verify_checkpoint(folder)
        except IncompleteCheckpoint as error:
            print(f"skipped: {error}", file=sys.stderr)
            continue
        found.append((int(match.group(1)), folder))
    return sorted(found)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--run", type=Path, nargs="+", required=True, help="the run folder(s) (output_dir/name), one base"
    )
    parser.add_argument("--stage", default="mars")
    parser.add_argument("--baseline", required=True, help="the base model the run started from")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--sources", nargs="+", default=["chatterbot"], choices=["tasks", "chatterbot"])
    parser.add_argument("--dialogs-limit", type=int, default=100)
    parser.add_argument("--tasks-limit", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, nargs="+", help="only these checkpoints (optimizer steps)")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    trains = {run: TrainConfig(**yaml.safe_load((run / "config.yaml").read_text())) for run in args.run}
    block_sizes = {train.block_size for train in trains.values()}
    if len(block_sizes) > 1:
        parser.error(f"--run: the runs were trained with different block sizes {sorted(block_sizes)}")
    config = EvalConfig(
        model=str(args.run[0]),
        sources=args.sources,
        dialogs_limit=args.dialogs_limit,
        tasks_limit=args.tasks_limit,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        block_size=block_sizes.pop(),
    )
    sets = heldout_sets(config)
    base = ModelUnderTest(args.baseline, config)
    prompts = {
        s: [chat_prompt_ids(base.tokenizer, r["messages"][:-1]) for r in rows] for s, rows in sets.items()
    }
    reference = {s: base.decode(p, 1.0, "raw").texts for s, p in prompts.items()}
    points = [("base", 0, args.baseline)]
    for run, train in trains.items():
        kept = checkpoints(run, args.stage)
        if args.steps:
            missing = sorted(set(args.steps) - {step for step, _ in kept})
            if missing:
                parser.error(f"--steps: no complete checkpoint for step(s) {missing} in {run / args.stage}")
            kept = [(step, folder) for step, folder in kept if step in args.steps]
        points += [(run.name, step * train.global_batch, str(folder)) for step, folder in kept]
    answers = [r["answer"] for r in sets["tasks"]] if "tasks" in sets else None
    rows = []
    for run, examples, path in points:
        model = base if path == args.baseline else ModelUnderTest(path, config)
        point = curve_point(model, prompts, reference, answers, args.tau)
        row = {"run": run, "examples": examples, "model": path, **point}
        rows.append(row)
        print(json.dumps(row), flush=True)
    t = args.tau
    print(f"\n| run | examples seen | source | tok/fwd at tau {t} | verified tok/fwd ", end="")
    print(f"| = own tau 1 % (sim) | tau 1 = base % (sim) | tau {t} = base % (sim) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        for source in prompts:
            r = row[source]
            cells = [f"{100 * r[k][0]:.1f} ({100 * r[k][1]:.1f})" for k in ("self", "base_greedy", "base")]
            rates = f"{r['tokens_per_forward']:.2f} | {r['verified_tokens_per_forward']:.2f}"
            head = f"| {row['run']} | {row['examples']} | {source} | {rates} | "
            print(head + " | ".join(cells) + " |")
    if args.output:
        args.output.write_text(json.dumps({"tau": args.tau, "points": rows}, indent=2))


if __name__ == "__main__":
    main()
