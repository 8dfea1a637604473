"""MARS recipes compared by measurement: each trained from the same instruct model on the same data, each
measured along its learning curve on the same held-out prompts. One process, no Ray (a lent GPU has no
package registry to install it from; a sweep is many short runs), and the same step code the Ray Train
workers run (`mars_ray/train/steps.py`).

    python scripts/recipe_sweep.py --device cuda --output OUT/sweep.jsonl \\
        --recipes lr=1e-4 lr=3e-4 "lr=1e-4 block_offsets=4" --points 800 1600 3200 6400

Data: the model's own greedy replies (`Distiller`, the code behind `mars-ray distill`) to the chatterbot
train prompts, or an existing distilled folder (`--distilled`), plus the bundled sources (`tasks`,
`chatterbot`) the recipe's `datasets` names. A recipe is `key=value` overrides of `TrainConfig` (lr,
block_offsets, batch_size, max_length, datasets, ...) on top of `--config`. At every point (examples seen)
the run is measured: tokens per forward at `--tau` (raw confidences), agreement with its own tau = 1 reply
and with the base model's, task accuracy at tau = 1 and `--tau`, and the step's cost in columns (noisy +
clean tokens, what a CPU step's time follows). Each point is a JSON line in `--output` as soon as it is
measured; `--deadline-s` stops starting new recipes in time.
`--save` keeps the last recipe's final weights as a plain HF folder (for `mars-ray bench` after it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import transformers
import yaml
from transformers import get_cosine_schedule_with_warmup

from mars_ray import data, models
from mars_ray.checkpoint_meta import CheckpointMeta
from mars_ray.core.objective import ScoredLM, collate_mars
from mars_ray.data import chat_prompt_ids
from mars_ray.distill import DistillConfig, Distiller, collect_prompts
from mars_ray.eval_model import ModelUnderTest, curve_point
from mars_ray.evaluate import EvalConfig, heldout_sets
from mars_ray.train.config import TrainConfig
from mars_ray.train.steps import BatchSampler, Objective, accumulate_gradients


def distilled_rows(args: argparse.Namespace) -> list[dict]:
    if args.distilled:
        return [json.loads(line) for f in sorted(args.distilled.glob("shard-*.jsonl")) for line in f.open()]
    config = DistillConfig(
        model=args.model,
        prompts=["chatterbot-prompts", "chatterbot"],
        output=str(args.output.parent / "distilled"),
        max_new_tokens=args.distill_max_new_tokens,
        batch_size=args.distill_batch_size,
        device=args.device,
        limit=args.distill_limit,
    )
    prompts, _ = collect_prompts(config)
    began = time.perf_counter()
    _, rows = Distiller(config).shard(0, prompts)
    print(f"distilled {len(rows)} replies in {time.perf_counter() - began:.0f} s", flush=True)
    return rows


def training_examples(config: TrainConfig, tokenizer, rows: list[dict]) -> list:
    """The distilled replies, plus the bundled sources (`tasks`, `chatterbot`) the config's datasets name."""
    import datasets

    sources = {"distilled": datasets.Dataset.from_list(rows)}
    for source in config.datasets:
        if source in data.BUNDLED_SOURCES:
            sources[source] = data.load_chats(source, "train", config.tasks_count)
    examples = []
    for name, dataset in sources.items():
        kept, report = data.tokenize_chats(dataset, tokenizer, config.max_length, name)
        print(report.summary(), flush=True)
        examples += kept
    return examples


def columns(objective: Objective, batch) -> int:
    """Noisy plus clean columns of one step's MARS batch: what its compute grows with."""
    collated = collate_mars(
        batch,
        objective.block_size,
        objective.mask_id,
        objective.pad_id,
        objective.eos_id,
        offsets=objective.offsets,
    )
    return int(collated.input_ids.numel())


def run_recipe(
    name: str, config: TrainConfig, base_state: dict, model, tokenizer, examples, measure, args
) -> None:
    device = torch.device(args.device)
    model.load_state_dict(base_state)
    CheckpointMeta(block_size=config.block_size).apply(model.config)
    model.train()
    scored = ScoredLM(model)
    points = sorted(args.points)
    total_steps = math.ceil(points[-1] / config.global_batch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(
        optimizer, round(config.warmup_ratio * total_steps), total_steps
    )
    objective = Objective(
        "mars",
        config.block_size,
        config.ar_weight,
        tokenizer.mask_token_id,
        tokenizer.pad_token_id,
        tokenizer.eos_token_id,
        config.offsets,
    )
    sampler = BatchSampler(
        [len(e.input_ids) for e in examples], config.global_batch, config.seed, config.group_by_length
    )
    autocast = config.autocast_dtype(device.type)
    began, noisy, cost = time.perf_counter(), [], 0
    for step in range(1, total_steps + 1):
        batch = [examples[i] for i in sampler(step - 1)]
        losses = accumulate_gradients(
            scored, objective, [batch], objective.normaliser(batch), 1, device, autocast
        )
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        noisy.append(losses["noisy"])
        cost += columns(objective, batch)
        seen = step * config.global_batch
        if seen < points[0] and step != total_steps:
            continue
        points.pop(0)
        train_s = time.perf_counter() - began
        model.eval()
        with torch.no_grad():
            point = measure(model)
        model.train()
        row = {
            "recipe": name,
            "overrides": args.recipe_overrides[name],
            "examples": seen,
            "steps": step,
            "noisy_loss": sum(noisy[-20:]) / len(noisy[-20:]),
            "columns": cost,
            "train_s": round(train_s, 1),
            **point,
        }
        with args.output.open("a") as out:
            out.write(json.dumps(row) + "\n")
        d, t = point.get("chatterbot", {}), point.get("tasks", {})
        print(
            f"[{name}] {seen} examples, noisy loss {row['noisy_loss']:.2f}: dialogs "
            f"{d.get('tokens_per_forward', 0):.2f} tok/fwd (self sim {d.get('self', [0, 0])[1]:.3f}); tasks "
            f"{t.get('tokens_per_forward', 0):.2f} tok/fwd, acc {t.get('accuracy', ['-', '-'])}",
            flush=True,
        )
        began = time.perf_counter()
        if not points:
            break


def table(rows: list[dict], tau: float) -> str:
    """Markdown: one line per measured point, dialogs then tasks (agreement as exact % (similarity %))."""

    def pair(values) -> str:
        return f"{100 * values[0]:.1f} ({100 * values[1]:.1f})"

    head = (
        f"| recipe | chats seen | noisy loss | dialogs tok/fwd at tau {tau:g} | = own tau 1 | tau 1 = base "
        f"| tasks tok/fwd | = own tau 1 | accuracy tau 1 / {tau:g} % |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        d, t = row["chatterbot"], row["tasks"]
        loss = f"{row['noisy_loss']:.2f}" if "noisy_loss" in row else ""
        accuracy = " / ".join(f"{100 * a:.1f}" for a in t["accuracy"])
        cells = [row["recipe"], str(row["examples"]), loss, f"{d['tokens_per_forward']:.2f}", pair(d["self"])]
        cells += [pair(d["base_greedy"]), f"{t['tokens_per_forward']:.2f}", pair(t["self"]), accuracy]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--config", type=Path, default=Path("configs/smollm2-cpu.yaml"))
    parser.add_argument("--recipes", nargs="+", default=["lr=1e-4"], help="space-separated key=value sets")
    parser.add_argument("--points", type=int, nargs="+", default=[400, 800, 1600, 3200])
    parser.add_argument("--distilled", type=Path, help="a `mars-ray distill` folder (default: distill here)")
    parser.add_argument("--distill-max-new-tokens", type=int, default=96)
    parser.add_argument("--distill-batch-size", type=int, default=64)
    parser.add_argument("--distill-limit", type=int, help="only the first N distinct prompts")
    parser.add_argument("--tau", type=float, default=0.9)
    parser.add_argument("--dialogs-limit", type=int, default=48)
    parser.add_argument("--tasks-limit", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--eval-batch-size", type=int, default=48)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--deadline-s", type=float, default=math.inf, help="no new recipe after this")
    parser.add_argument("--save", type=Path, help="keep the last recipe's final weights here")
    parser.add_argument("--output", type=Path, required=True, help="JSON lines")
    parser.add_argument("--table", action="store_true", help="only print the table of an existing --output")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(line) for line in args.output.open()], args.tau))
        return
    started = time.perf_counter()
    transformers.utils.logging.disable_progress_bar()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.unlink(missing_ok=True)
    torch.manual_seed(0)

    base = yaml.safe_load(args.config.read_text())
    base.update(model=args.model, use_gpu=args.device != "cpu")
    recipes = {}
    for recipe in args.recipes:
        overrides = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in recipe.split())}
        recipes[recipe] = TrainConfig(**{**base, **overrides})
    args.recipe_overrides = {name: dict(item.split("=", 1) for item in name.split()) for name in recipes}

    model, tokenizer = models.load(args.model, dtype=torch.float32, device=args.device)
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    rows = distilled_rows(args)
    first = next(iter(recipes.values()))

    eval_config = EvalConfig(
        model=args.model,
        dialogs_limit=args.dialogs_limit,
        tasks_limit=args.tasks_limit,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.eval_batch_size,
        device=args.device,
        block_size=first.block_size,
        allow_wider_window=True,
    )
    sets = heldout_sets(eval_config)
    prompts = {s: [chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in rows] for s, rows in sets.items()}
    answers = [r["answer"] for r in sets["tasks"]]
    base_model = ModelUnderTest.in_memory(model, tokenizer, eval_config)
    reference = {s: base_model.decode(p, 1.0, "raw").texts for s, p in prompts.items()}

    def measure(live) -> dict:
        return curve_point(
            ModelUnderTest.in_memory(live, tokenizer, eval_config), prompts, reference, answers, args.tau
        )

    with torch.no_grad():
        point = measure(model)
    with args.output.open("a") as out:
        out.write(json.dumps({"recipe": "base", "examples": 0, **point}) + "\n")
    print(f"[base] dialogs {point['chatterbot']['tokens_per_forward']:.2f} tok/fwd", flush=True)
    for name, config in recipes.items():
        if time.perf_counter() - started > args.deadline_s:
            print(f"[{name}] skipped: past the deadline", flush=True)
            continue
        examples = training_examples(config, tokenizer, rows)
        run_recipe(name, config, base_state, model, tokenizer, examples, measure, args)
    if args.save:
        model.save_pretrained(args.save)
        tokenizer.save_pretrained(args.save)
    print(table([json.loads(line) for line in args.output.open()], args.tau))
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)


if __name__ == "__main__":
    main()
