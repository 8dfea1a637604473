"""`mars-ray calibrate`: make a slot's confidence mean what tau assumes, and store it in the checkpoint.

tau is a quality knob only if a slot's confidence c predicts that its token is the one greedy decoding
would produce about c of the time. This measures that and fits it:
1. Every prompt of the `calibration` split (never trained on, never evaluated on) gets the model's own
   greedy (tau = 1) reply.
2. One teacher-forced MARS forward per chat (the training layout, block size B) reads, for every block
   of the reply, what each mask slot j = 1 .. B-1 would propose after the committed tokens before it:
   its confidence and whether it is the greedy reply's token.
3. Per slot, a temperature T_j is fitted (on a grid, by the binary cross-entropy of confidence against
   agreement); decoders divide slot j's logits by T_j before reading its confidence (greedy tokens are
   unchanged). The temperatures go into the checkpoint's `config.json` as `mars_slot_temperatures`.
4. Expected calibration error (ECE) per slot before and after, on the calibration split and on the
   `heldout` split, with reliability diagrams, in `calibration.json` beside the weights (and a PNG).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args, models
from mars_ray.checkpoint_meta import CheckpointMeta
from mars_ray.core.decode_config import TRAINED_BLOCK_SIZE, DecodeConfig
from mars_ray.core.decoder import decode_continuous
from mars_ray.core.dtypes import DtypeName, torch_dtype
from mars_ray.core.errors import ConfigError
from mars_ray.core.objective import IGNORE, Example, collate_mars
from mars_ray.data import chat_prompt_ids, chatterbot_dialogs, verifiable_tasks

GRID = torch.logspace(math.log10(0.05), math.log10(10.0), 93)  # candidate temperatures, 6% apart


class CalibrateConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="the MARS checkpoint folder (its config.json gets the temperatures)")
    sources: list[Literal["tasks", "chatterbot"]] = Field(
        default=["tasks", "chatterbot"], min_length=1, description="generated tasks and/or real dialogs"
    )
    tasks_limit: int = Field(default=200, ge=1, description="generated tasks per split")
    dialogs_limit: int = Field(default=200, ge=1, description="real dialogs per split (at most all)")
    max_new_tokens: int = Field(default=64, ge=1, description="greedy reply budget")
    batch_size: int = Field(default=16, ge=1, description="rows decoded together")
    bins: int = Field(default=10, ge=2, description="confidence bins of the ECE and the diagrams")
    write: bool = Field(default=True, description="store the temperatures in the checkpoint")
    plot: Path | None = Field(default=None, description="reliability diagrams PNG")
    dtype: DtypeName = Field(default="auto", description="weights' dtype")


class SlotStats(BaseModel):
    """One slot on one split: sample count, agreement rate, ECE raw and calibrated, and the diagrams."""

    slot: int
    samples: int
    agreement: float
    ece_raw: float
    ece_calibrated: float
    reliability_raw: list[list[float]]  # per bin: [mean confidence, agreement, samples]
    reliability_calibrated: list[list[float]]


class CalibrationReport(BaseModel):
    model: str
    block_size: int
    temperatures: list[float]  # per slot 0..B-1 (slot 0, the AR token, is always accepted: 1.0)
    splits: dict[str, list[SlotStats]]


def split_prompts(tokenizer, split: str, config: CalibrateConfig) -> list[list[int]]:
    rows = []
    if "tasks" in config.sources:
        rows += verifiable_tasks(split, count=config.tasks_limit)
    if "chatterbot" in config.sources:
        rows += chatterbot_dialogs(split)[: config.dialogs_limit]
    return [chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in rows]


@torch.inference_mode()
def slot_samples(
    model, tokenizer, chats: list[tuple[list[int], list[int]]], block_size: int, batch_size: int
):
    """Teacher-forced mask predictions over (prompt, reply) chats: per slot j in 1..B-1, a [n, len(GRID)]
    tensor of the confidence at each grid temperature and a [n] bool tensor of agreement with the reply."""
    conf: dict[int, list[torch.Tensor]] = {j: [] for j in range(1, block_size)}
    agree: dict[int, list[torch.Tensor]] = {j: [] for j in range(1, block_size)}
    grid = GRID.to(model.device)
    for start in range(0, len(chats), batch_size):
        chunk = chats[start : start + batch_size]
        examples = [Example(p + r, [IGNORE] * len(p) + r) for p, r in chunk]
        batch = collate_mars(
            examples, block_size, tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id
        ).to(model.device)
        width = batch.noisy_width
        pos = batch.position_ids[:, :width]
        prompt_len = torch.tensor([len(p) for p, _ in chunk], device=model.device)[:, None]
        length = torch.tensor([len(p) + len(r) for p, r in chunk], device=model.device)[:, None]
        # Slot j: a mask j positions after the last real token it sees (its block's start, or the prompt).
        last_real = torch.maximum(pos - pos % block_size - 1, prompt_len - 1)
        slot = pos - last_real
        use = batch.scored[:, :width] & (pos >= prompt_len) & (pos + 1 < length) & (slot < block_size)
        hidden = model.base_model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=batch.attention_mask
        ).last_hidden_state[:, :width]
        logits = model.get_output_embeddings()(hidden[use]).float()
        targets, slots = batch.targets[:, :width][use], slot[use]
        shifted = logits - logits.max(dim=-1, keepdim=True).values
        confidence = torch.stack([1.0 / torch.exp(shifted / t).sum(dim=-1) for t in grid], dim=1)
        correct = logits.argmax(dim=-1) == targets
        for j in conf:
            conf[j].append(confidence[slots == j].cpu())
            agree[j].append(correct[slots == j].cpu())
    return {j: (torch.cat(conf[j]), torch.cat(agree[j])) for j in conf}


def fit_temperature(confidence: torch.Tensor, correct: torch.Tensor) -> float:
    """The grid temperature whose confidences best predict agreement (binary cross-entropy)."""
    c = confidence.clamp(1e-6, 1 - 1e-6)
    y = correct.float()[:, None]
    bce = -(y * c.log() + (1 - y) * (1 - c).log()).mean(dim=0)
    return float(GRID[int(bce.argmin())])


def reliability(
    confidence: torch.Tensor, correct: torch.Tensor, bins: int
) -> tuple[float, list[list[float]]]:
    """ECE over equal-width bins, and per bin [mean confidence, agreement, samples]."""
    index = (confidence * bins).long().clamp(max=bins - 1)
    table, ece = [], 0.0
    for b in range(bins):
        inside = index == b
        n = int(inside.sum())
        if n:
            mean_conf, rate = float(confidence[inside].mean()), float(correct[inside].float().mean())
            ece += n / len(confidence) * abs(mean_conf - rate)
            table.append([mean_conf, rate, n])
    return ece, table


def _grid_index(temperature: float) -> int:
    return int((GRID - temperature).abs().argmin())


def split_stats(samples, temperatures: list[float], bins: int) -> list[SlotStats]:
    stats, raw = [], _grid_index(1.0)
    for j, (confidence, correct) in samples.items():
        fitted = _grid_index(temperatures[j])
        ece_raw, table_raw = reliability(confidence[:, raw], correct, bins)
        ece_cal, table_cal = reliability(confidence[:, fitted], correct, bins)
        stats.append(
            SlotStats(
                slot=j,
                samples=len(correct),
                agreement=float(correct.float().mean()) if len(correct) else 0.0,
                ece_raw=ece_raw,
                ece_calibrated=ece_cal,
                reliability_raw=table_raw,
                reliability_calibrated=table_cal,
            )
        )
    return stats


def calibrate(config: CalibrateConfig) -> CalibrationReport:
    folder = Path(models.resolve(config.model))
    model, tokenizer = models.load(str(folder), dtype=torch_dtype(config.dtype))
    block_size = CheckpointMeta.of(model.config).block_size
    if not block_size:
        raise ConfigError("model", f"{folder} records no {TRAINED_BLOCK_SIZE}: not a MARS checkpoint")
    greedy = DecodeConfig.for_model(model, tokenizer, calibrated=False, max_new_tokens=config.max_new_tokens)
    samples = {}
    for split in ("calibration", "heldout"):
        prompts = split_prompts(tokenizer, split, config)
        replies = dict(
            decode_continuous(
                model, prompts, tokenizer.mask_token_id, greedy, tokenizer.pad_token_id, config.batch_size
            )
        )
        chats = [(p, replies[i].tokens) for i, p in enumerate(prompts) if replies[i].tokens]
        samples[split] = slot_samples(model, tokenizer, chats, block_size, config.batch_size)
    temperatures = [1.0] + [fit_temperature(*samples["calibration"][j]) for j in range(1, block_size)]
    report = CalibrationReport(
        model=str(folder),
        block_size=block_size,
        temperatures=temperatures,
        splits={split: split_stats(s, temperatures, config.bins) for split, s in samples.items()},
    )
    if config.write:
        CheckpointMeta(slot_temperatures=temperatures).write(folder)
        (folder / "calibration.json").write_text(report.model_dump_json(indent=2))
    if config.plot:
        plot_reliability(report, config.plot)
    return report


def table(report: CalibrationReport) -> str:
    lines = [
        f"{report.model}: B = {report.block_size}; ECE per slot, raw -> calibrated (temperature fitted on the"
        " calibration split)",
        "",
        "| split | slot | samples | agreement % | temperature | ECE raw | ECE calibrated |",
        "|---|---|---|---|---|---|---|",
    ]
    for split, stats in report.splits.items():
        for s in stats:
            lines.append(
                f"| {split} | {s.slot} | {s.samples} | {100 * s.agreement:.1f} | "
                f"{report.temperatures[s.slot]:.2f} | {s.ece_raw:.3f} | {s.ece_calibrated:.3f} |"
            )
    return "\n".join(lines)


def plot_reliability(report: CalibrationReport, path: Path) -> None:
    """Per slot, on the held-out split: agreement against confidence, raw and calibrated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = report.splits["heldout"]
    fig, axes = plt.subplots(1, len(stats), figsize=(4 * len(stats), 4), squeeze=False)
    for ax, s in zip(axes[0], stats, strict=True):
        for rows, label, marker in (
            (s.reliability_raw, f"raw (ECE {s.ece_raw:.3f})", "o"),
            (
                s.reliability_calibrated,
                f"T={report.temperatures[s.slot]:.2f} (ECE {s.ece_calibrated:.3f})",
                "s",
            ),
        ):
            ax.plot([r[0] for r in rows], [r[1] for r in rows], marker=marker, label=label)
        ax.plot([0, 1], [0, 1], color="grey", linestyle=":")
        ax.set_title(f"slot {s.slot} ({s.samples} held-out samples)")
        ax.set_xlabel("confidence")
        ax.set_ylabel("agreement with the greedy reply")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "calibrate", help="fit per-slot confidence temperatures on the calibration split, store them"
    )
    cli_args.add_config_arguments(parser, CalibrateConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    print(table(calibrate(cli_args.config_from_args(CalibrateConfig, args))))
