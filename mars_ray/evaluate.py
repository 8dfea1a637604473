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
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from mars_ray import cli_args, models
from mars_ray.bench.baseline import hf_greedy_tokens
from mars_ray.core.decoding import DecodeConfig, DecodeResult, decode_continuous
from mars_ray.data import chat_prompt_ids, chatterbot_dialogs, verifiable_tasks
from mars_ray.vllm.config import ENGINE_HELP, Engine

PAPER_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)
Source = Literal["tasks", "chatterbot"]
Confidence = Literal["calibrated", "raw"]
Mode = Literal["lossy", "verify"]


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="the MARS checkpoint: folder, Hub id or preset")
    baseline: str | None = Field(
        default=None, description="the base model it was trained from: its greedy replies are the reference"
    )
    baseline_taus: list[float] = Field(
        default=[1.0], min_length=1, description="taus the baseline is swept at too (1.0: its replies only)"
    )
    taus: list[float] = Field(default=list(PAPER_TAUS), min_length=1, description="taus to sweep")
    confidences: list[Confidence] = Field(
        default=["calibrated", "raw"],
        min_length=1,
        description="calibrated slot temperatures (when the checkpoint has them) and raw probabilities",
    )
    modes: list[Mode] = Field(
        default=["lossy"], min_length=1, description="lossy MARS, and/or verified (exactly greedy at any tau)"
    )
    block_size: int | None = Field(default=None, ge=1, description="window; default: the trained B")
    allow_wider_window: bool = Field(default=False, description="allow a window wider than the trained B")
    sources: list[Source] = Field(
        default=["tasks", "chatterbot"], min_length=1, description="held-out sets: tasks, real dialogs"
    )
    tasks_limit: int = Field(default=200, ge=1, description="held-out tasks")
    dialogs_limit: int = Field(default=100, ge=1, description="held-out dialogs")
    max_new_tokens: int = Field(default=64, ge=1, description="reply budget per prompt")
    batch_size: int = Field(default=16, ge=1, description="rows decoded together")
    device: str = Field(default="cpu", description="torch device")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(default="auto", description="weights' dtype")
    engine: Engine = Field(default="native", description=ENGINE_HELP)
    check_greedy: bool = Field(
        default=False, description="also decode with HF generate and count tau = 1 replies that differ"
    )
    output: Path | None = Field(default=None, description="JSON report path")
    plot: Path | None = Field(default=None, description="Pareto plot PNG path")

    @field_validator("taus", "baseline_taus")
    @classmethod
    def _in_range(cls, taus: list[float]) -> list[float]:
        if any(not 0 < t <= 1 for t in taus):
            raise ValueError(f"taus must lie in (0, 1], got {taus}")
        return taus


class Score(BaseModel):
    """One (model, source, confidence, tau) cell. Agreements are fractions of prompts; None: not measured."""

    model: str
    source: str
    confidence: str
    tau: float
    prompts: int
    mode: str = "lossy"
    tokens_per_forward: float
    acceptance: list[float]  # per window slot j: the fraction of forwards that accepted more than j tokens
    draft_acceptance: list[float] | None = None  # verify: per draft position, the share of drafts kept
    accuracy: float | None = None  # tasks: exact match with the known answer
    self_exact: float = 1.0  # the same model's tau = 1 reply, token for token (text)
    self_similarity: float = 1.0
    base_exact: float | None = None  # the baseline's greedy reply
    base_similarity: float | None = None
    human_similarity: float | None = None  # chatterbot: the human reply
    greedy_mismatches: int | None = None  # tau = 1 with check_greedy: replies unlike HF generate's


class EvalReport(BaseModel):
    config: EvalConfig
    scores: list[Score] = []

    def table(self) -> str:
        """Markdown, one row per (model, mode, confidence, tau); `= base`: agreement with the base model."""
        sources = [s for s in ("tasks", "chatterbot") if any(c.source == s for c in self.scores)]
        head = ["model", "mode", "confidence", "tau"]
        for source in sources:
            head += [f"{source} tok/fwd"] + (["acc %"] if source == "tasks" else [])
            head += ["= own tau 1 % (sim)", "= base % (sim)"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        rows = dict.fromkeys((s.model, s.mode, s.confidence, s.tau) for s in self.scores)
        for row in rows:
            model, mode, confidence, tau = row
            cells = [model, mode, confidence, f"{tau:g}"]
            for source in sources:
                score = next(
                    (
                        s
                        for s in self.scores
                        if (s.model, s.mode, s.confidence, s.tau, s.source) == (*row, source)
                    ),
                    None,
                )
                if score is None:
                    cells += [""] * (4 if source == "tasks" else 3)
                    continue
                cells.append(f"{score.tokens_per_forward:.2f}")
                if source == "tasks":
                    cells.append(_percent(score.accuracy))
                cells.append(_agreement(score.self_exact, score.self_similarity))
                cells.append(_agreement(score.base_exact, score.base_similarity))
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _percent(value: float | None) -> str:
    return "" if value is None else f"{100 * value:.1f}"


def _agreement(exact: float | None, similarity: float | None) -> str:
    """`exact (similarity)` in percent; blank where not measured (no baseline given)."""
    return "" if exact is None else f"{_percent(exact)} ({_percent(similarity)})"


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def agreement(texts: Sequence[str], references: Sequence[str]) -> tuple[float, float]:
    """The fraction of texts equal to their reference, and the mean similarity to it."""
    pairs = list(zip(texts, references, strict=True))
    return _mean(a == b for a, b in pairs), _mean(similarity(a, b) for a, b in pairs)


def heldout_sets(config: EvalConfig) -> dict[str, list[dict]]:
    sets = {
        "tasks": lambda: verifiable_tasks("heldout", count=config.tasks_limit),
        "chatterbot": lambda: chatterbot_dialogs("heldout")[: config.dialogs_limit],
    }
    return {source: sets[source]() for source in config.sources}


def acceptance_rates(results: Sequence[DecodeResult], width: int) -> list[float]:
    """Per slot j < width: the fraction of token-producing forwards that accepted more than j tokens."""
    counts = [n for r in results for n in r.accepted]
    return [sum(n > j for n in counts) / max(len(counts), 1) for j in range(width)]


def draft_acceptance(results: Sequence[DecodeResult]) -> list[float]:
    """Verified decoding, per draft position i: of the forwards that checked more than i drafts, the share
    that kept draft i (a forward keeps `accepted - 1` drafts, then adds the greedy token after them). Results
    that do not record their drafts per forward (vLLM's) are left out."""
    recorded = [r for r in results if r.drafted]
    pairs = [(d, a - 1) for r in recorded for d, a in zip(r.drafted, r.accepted, strict=True)]
    width = max((d for d, _ in pairs), default=0)
    rates = []
    for i in range(width):
        offered = [kept for drafted, kept in pairs if drafted > i]
        rates.append(sum(kept > i for kept in offered) / len(offered))
    return rates


class Decoded:
    """One model's replies to one prompt set at one setting."""

    def __init__(self, tokenizer, results: list[DecodeResult]) -> None:
        self.results = results
        self.texts = [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in results]
        tokens = sum(len(r.tokens) for r in results)
        self.tokens_per_forward = tokens / max(sum(r.forward_passes for r in results), 1)


class ModelUnderTest:
    """A loaded model and the decoding its checkpoint asks for."""

    def __init__(self, path: str, config: EvalConfig) -> None:
        dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
        self.model, self.tokenizer = models.load(path, dtype=dtype, device=config.device)
        self._configure(config)
        if config.engine == "vllm":
            from mars_ray.vllm.offline import VllmDecoder

            self.vllm = VllmDecoder(models.resolve(path), dtype=config.dtype)

    @classmethod
    def in_memory(cls, model, tokenizer, config: EvalConfig) -> ModelUnderTest:
        """A model already loaded (a training run's live weights), put in eval mode."""
        under_test = cls.__new__(cls)
        under_test.model, under_test.tokenizer = model.eval(), tokenizer
        under_test._configure(config)
        return under_test

    def _configure(self, config: EvalConfig) -> None:
        self.base = DecodeConfig.for_model(
            self.model,
            self.tokenizer,
            config.block_size,
            allow_wider=config.allow_wider_window,
            max_new_tokens=config.max_new_tokens,
        )
        self.batch_size = config.batch_size
        self.vllm = None

    def confidences(self, wanted: Sequence[Confidence]) -> list[Confidence]:
        """The confidence modes that differ for this checkpoint (raw only, if it is not calibrated)."""
        return [c for c in wanted if c == "raw" or self.base.slot_temperatures] or ["raw"]

    def decode(
        self, prompts: list[list[int]], tau: float, confidence: Confidence, mode: Mode = "lossy"
    ) -> Decoded:
        temperatures = self.base.slot_temperatures if confidence == "calibrated" else ()
        config = replace(self.base, tau=tau, slot_temperatures=temperatures, verify=mode == "verify")
        tok = self.tokenizer
        if self.vllm is not None:
            return Decoded(tok, self.vllm.decode(prompts, config))
        found = dict(
            decode_continuous(
                self.model, prompts, tok.mask_token_id, config, tok.pad_token_id, self.batch_size
            )
        )
        return Decoded(tok, [found[i] for i in range(len(prompts))])

    def greedy_mismatches(self, prompts: list[list[int]], results: list[DecodeResult]) -> int:
        """How many replies differ from HF `generate(do_sample=False)` on the same weights, one prompt at
        a time (a left-padded batch is checked first; only the rows where it differs are run alone, since
        padding itself can move a near-tie in HF's own kernels)."""

        def generate(chunk: list[list[int]]) -> list[list[int]]:
            tok, decode = self.tokenizer, self.base
            return hf_greedy_tokens(
                self.model, chunk, decode.max_new_tokens, decode.stop_token_ids, tok.pad_token_id
            )

        mismatches = 0
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            got = [r.tokens for r in results[start : start + len(chunk)]]
            for prompt, expected, mine in zip(chunk, generate(chunk), got, strict=True):
                mismatches += expected != mine and generate([prompt])[0] != mine
        return mismatches


def curve_point(
    under_test: ModelUnderTest,
    prompts: dict[str, list[list[int]]],
    reference: dict[str, list[str]],
    answers: list[str] | None,
    tau: float,
) -> dict:
    """One point of a learning curve, per source: tokens per forward at `tau` (raw confidences), lossy and
    verified; the lossy text's agreement (exact, similarity) with the model's own tau = 1 reply, and of
    both with the base model's reply (`reference`); for tasks, exact-match accuracy at tau = 1 and at
    `tau`. `verified_exact` is the share of verified replies equal to the tau = 1 reply (always 1)."""
    point = {}
    for source, source_prompts in prompts.items():
        greedy = under_test.decode(source_prompts, 1.0, "raw")
        fast = under_test.decode(source_prompts, tau, "raw")
        verified = under_test.decode(source_prompts, tau, "raw", "verify")
        point[source] = {
            "tokens_per_forward": fast.tokens_per_forward,
            "verified_tokens_per_forward": verified.tokens_per_forward,
            "verified_exact": agreement(verified.texts, greedy.texts)[0],
            "acceptance": acceptance_rates(fast.results, under_test.base.block_size),
            "self": agreement(fast.texts, greedy.texts),
            "base_greedy": agreement(greedy.texts, reference[source]),
            "base": agreement(fast.texts, reference[source]),
        }
        if source == "tasks" and answers is not None:
            point[source]["accuracy"] = [agreement(run.texts, answers)[0] for run in (greedy, fast)]
    return point


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
                score.accuracy = _mean(t == r["answer"] for t, r in zip(run.texts, rows, strict=True))
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
        plot_pareto(report, config.plot)
    return report


def plot_pareto(report: EvalReport, path: Path) -> None:
    """Tokens per forward (x) against quality (y): task accuracy, and dialog similarity to the base model's
    reply (to the model's own greedy reply without a base), one line per model, source and confidence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lines = dict.fromkeys((s.model, s.source, s.confidence) for s in report.scores)
    for (name, source, confidence), marker in zip(lines, "osd^vx<>p*", strict=False):
        cells = sorted(
            (s for s in report.scores if (s.model, s.source, s.confidence) == (name, source, confidence)),
            key=lambda s: -s.tau,
        )
        if source == "tasks":
            ys, what = [s.accuracy for s in cells], "accuracy"
        elif cells[0].base_similarity is not None:
            ys, what = [s.base_similarity for s in cells], "similarity to base"
        else:
            ys, what = [s.self_similarity for s in cells], "similarity to own tau 1"
        xs = [s.tokens_per_forward for s in cells]
        ax.plot(xs, [100 * y for y in ys], marker=marker, label=f"{name} / {source} {what} / {confidence}")
        for s, x, y in zip(cells, xs, ys, strict=True):
            ax.annotate(f"{s.tau:g}", (x, 100 * y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("quality %")
    ax.set_title("MARS: quality against tokens per forward, tau annotated")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="tau sweep: tokens per forward and agreement with the base model on held-out prompts"
    )
    cli_args.add_config_arguments(parser, EvalConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    print(evaluate(cli_args.config_from_args(EvalConfig, args)).table())
