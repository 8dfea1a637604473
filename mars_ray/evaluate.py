"""Quality against speed: the tau sweep of the paper's Tables 2, 4 and 8, on our held-out sets.

A user's question is "how far from my original model am I at this tau". So each (model, tau) cell holds
tokens per forward and, on held-out prompts:
- `tasks` (generated, verifiable): exact-match accuracy against the known answer;
- `chatterbot` (real dialogs, no single right answer): agreement, exact and as a character-level
  similarity, with the same model's greedy (tau = 1) reply and, given `baseline`, with the base model's
  greedy reply (the headline when a base is given), plus similarity to the human reply.
A checkpoint with calibrated slot temperatures is swept with them and with raw probabilities, side by
side. Decoding is continuous batching over the sliding cache, which gives every row the tokens and
forward count it has alone; `check_greedy` also decodes every prompt with HF `generate` and counts the
tau = 1 replies that differ from it token for token.

Here: the config, the sweep and the command. The model decoded is `eval_model.py`'s, what is measured in
its replies `eval_measures.py`'s, the cells, table and plot `eval_scores.py`'s.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args
from mars_ray.core.dtypes import DtypeName
from mars_ray.data import chat_prompt_ids, chatterbot_dialogs, verifiable_tasks
from mars_ray.eval_measures import acceptance_rates, agreement, draft_acceptance, mean
from mars_ray.eval_model import Confidence, Mode, ModelUnderTest
from mars_ray.eval_scores import Score, plot_pareto, score_table
from mars_ray.serve.config import BlockSizeOrNone, Tau
from mars_ray.vllm.config import ENGINE_HELP, Engine

PAPER_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
Source = Literal["tasks", "chatterbot"]


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="the MARS checkpoint: folder, Hub id or preset")
    baseline: str | None = Field(
        default=None, description="the base model it was trained from: its greedy replies are the reference"
    )
    baseline_taus: list[Tau] = Field(
        default=[1.0], min_length=1, description="taus the baseline is swept at too (1.0: its replies only)"
    )
    taus: list[Tau] = Field(default=list(PAPER_TAUS), min_length=1, description="taus to sweep")
    confidences: list[Confidence] = Field(
        default=["calibrated", "raw"],
        min_length=1,
        description="calibrated slot temperatures (when the checkpoint has them) and raw probabilities",
    )
    modes: list[Mode] = Field(
        default=["lossy"], min_length=1, description="lossy MARS, and/or verified (exactly greedy at any tau)"
    )
    block_size: BlockSizeOrNone = Field(default=None, description="window; default: the trained B")
    allow_wider_window: bool = Field(default=False, description="allow a window wider than the trained B")
    sources: list[Source] = Field(
        default=["tasks", "chatterbot"], min_length=1, description="held-out sets: tasks, real dialogs"
    )
    tasks_limit: int = Field(default=200, ge=1, description="held-out tasks")
    dialogs_limit: int = Field(default=100, ge=1, description="held-out dialogs")
    max_new_tokens: int = Field(default=64, ge=1, description="reply budget per prompt")
    batch_size: int = Field(default=16, ge=1, description="rows decoded together")
    device: str = Field(default="cpu", description="torch device")
    dtype: DtypeName = Field(default="auto", description="weights' dtype")
    engine: Engine = Field(default="native", description=ENGINE_HELP)
    check_greedy: bool = Field(
        default=False, description="also decode with HF generate and count tau = 1 replies that differ"
    )
    output: Path | None = Field(default=None, description="JSON report path")
    plot: Path | None = Field(default=None, description="Pareto plot PNG path")


class EvalReport(BaseModel):
    config: EvalConfig
    scores: list[Score] = []

    def table(self) -> str:
        """Markdown, one row per (model, mode, confidence, tau); `= base`: agreement with the base model."""
        return score_table(self.scores)


def heldout_sets(config: EvalConfig) -> dict[str, list[dict]]:
    sets = {
        "tasks": lambda: verifiable_tasks("heldout", count=config.tasks_limit),
        "chatterbot": lambda: chatterbot_dialogs("heldout")[: config.dialogs_limit],
    }
    return {source: sets[source]() for source in config.sources}


def _score_model(
    name: str,
    under_test: ModelUnderTest,
    taus: Sequence[float],
    config: EvalConfig,
    reference: dict[str, list[str]] | None,
) -> tuple[list[Score], dict[str, list[str]]]:
    """Every cell of one model; returns them and its own greedy replies per source."""
    scores, greedy_texts = [], {}
    for source, rows in heldout_sets(config).items():
        prompts = [chat_prompt_ids(under_test.tokenizer, r["messages"][:-1]) for r in rows]
        greedy = under_test.decode(prompts, 1.0, "raw")
        greedy_texts[source] = greedy.texts
        mismatches = under_test.greedy_mismatches(prompts, greedy.results) if config.check_greedy else None
        settings = [
            (mode, confidence, tau)
            for mode in config.modes
            for confidence in under_test.confidences(config.confidences)
            for tau in taus
        ]
        for mode, confidence, tau in settings:
            run = greedy if tau >= 1.0 else under_test.decode(prompts, tau, confidence, mode)
            base = reference.get(source) if reference else None
            self_exact, self_similarity = agreement(run.texts, greedy.texts)
            score = Score(
                model=name,
                source=source,
                mode=mode,
                confidence=confidence,
                tau=tau,
                prompts=len(rows),
                tokens_per_forward=run.tokens_per_forward,
                acceptance=acceptance_rates(run.results, under_test.base.block_size),
                draft_acceptance=draft_acceptance(run.results) if mode == "verify" else None,
                self_exact=self_exact,
                self_similarity=self_similarity,
                greedy_mismatches=mismatches if tau >= 1.0 else None,
            )
            if base is not None:
                score.base_exact, score.base_similarity = agreement(run.texts, base)
            if source == "tasks":
                score.accuracy = mean(t == r["answer"] for t, r in zip(run.texts, rows, strict=True))
            else:
                human = [r["messages"][-1]["content"] for r in rows]
                score.human_similarity = agreement(run.texts, human)[1]
            scores.append(score)
            print(
                f"  {name} {source} {mode} {confidence} tau {tau:g}: {score.tokens_per_forward:.2f} tok/fwd",
                flush=True,
            )
    return scores, greedy_texts


def evaluate(config: EvalConfig) -> EvalReport:
    """Run the sweep (the baseline first: its replies are the reference); write JSON and plot if asked."""
    report = EvalReport(config=config)
    reference = None
    if config.baseline:
        base_scores, reference = _score_model(
            "base", ModelUnderTest(config.baseline, config), config.baseline_taus, config, None
        )
    mars_scores, _ = _score_model(
        "mars", ModelUnderTest(config.model, config), config.taus, config, reference
    )
    if config.baseline:
        for score in base_scores:  # the base against itself: its own replies are the reference
            score.base_exact, score.base_similarity = score.self_exact, score.self_similarity
    report.scores = mars_scores + (base_scores if config.baseline else [])
    if config.output:
        config.output.parent.mkdir(parents=True, exist_ok=True)
        config.output.write_text(report.model_dump_json(indent=2))
    if config.plot:
        plot_pareto(report.scores, config.plot)
    return report


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="tau sweep: tokens per forward and agreement with the base model on held-out prompts"
    )
    cli_args.add_config_arguments(parser, EvalConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    print(evaluate(cli_args.config_from_args(EvalConfig, args)).table())
