"""Quality against speed: the tau sweep of the paper's Tables 2, 4 and 8, on our held-out sets.

For each model (the MARS checkpoint and, when given, its AR-SFT control) and each tau, decode the held-out
prompts and report tokens per forward with:
- `tasks` (generated, verifiable): exact-match accuracy against the known answer;
- `chatterbot` (real dialogs, no single right answer): agreement with the same model's greedy (tau = 1)
  reply, exact and as a character-level similarity, plus similarity to the human reply.
Decoding is batched with the sliding cache, which gives every row the tokens and forward count it has alone.
"""

from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mars_ray import models
from mars_ray.core.decoding import DecodeConfig, decode_cached
from mars_ray.data import chat_prompt_ids, chatterbot_dialogs, verifiable_tasks

PAPER_TAUS = (1.0, 0.95, 0.9, 0.8, 0.7, 0.6, 0.5)


@dataclass(frozen=True)
class EvalConfig:
    model: str
    baseline: str | None = None  # the AR-SFT control, decoded the same way
    taus: tuple[float, ...] = PAPER_TAUS
    block_size: int = 4
    tasks_limit: int = 200
    dialogs_limit: int = 100
    max_new_tokens: int = 64
    batch_size: int = 16
    device: str = "cpu"
    output: Path | None = None  # JSON report
    plot: Path | None = None  # Pareto PNG: tokens per forward against accuracy

    def __post_init__(self) -> None:
        if not self.taus or any(not 0 < t <= 1 for t in self.taus):
            raise ValueError(f"taus must lie in (0, 1], got {self.taus}")
        for name in ("block_size", "tasks_limit", "max_new_tokens", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Score:
    """One (model, source, tau) cell."""

    model: str
    source: str
    tau: float
    accuracy: float  # tasks: exact match; chatterbot: exact agreement with the greedy reply
    tokens_per_forward: float
    similarity: float  # chatterbot: similarity to the greedy reply (tasks: same as accuracy)
    human_similarity: float | None = None  # chatterbot: similarity to the human reply
    prompts: int = 0


@dataclass
class EvalReport:
    config: EvalConfig
    scores: list[Score] = field(default_factory=list)

    def table(self) -> str:
        """Markdown: one row per model and tau, accuracy / tokens per forward per source."""
        sources = sorted({s.source for s in self.scores}, key=["tasks", "chatterbot"].index)
        head = "| model | tau | " + " | ".join(f"{s} acc | {s} tok/fwd" for s in sources) + " |"
        lines = [head, "|" + "---|" * (2 + 2 * len(sources))]
        for name in dict.fromkeys(s.model for s in self.scores):
            for tau in self.config.taus:
                cells = []
                for source in sources:
                    score = next(s for s in self.scores if (s.model, s.source, s.tau) == (name, source, tau))
                    cells += [f"{100 * score.accuracy:.1f}", f"{score.tokens_per_forward:.2f}"]
                lines.append(f"| {name} | {tau:g} | " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def to_json(self) -> dict:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self.config).items()}
        return {"config": config, "scores": [asdict(s) for s in self.scores]}


def similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


def _decode_all(model, tokenizer, prompts: list[list[int]], config: DecodeConfig, batch_size: int):
    """Decoded texts and the pooled tokens per forward."""
    results = []
    for start in range(0, len(prompts), batch_size):
        chunk = prompts[start : start + batch_size]
        results += decode_cached(model, chunk, tokenizer.mask_token_id, config, tokenizer.pad_token_id)
    texts = [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in results]
    tokens_per_forward = sum(len(r.tokens) for r in results) / max(sum(r.forward_passes for r in results), 1)
    return texts, tokens_per_forward


def _score_model(name: str, path: str, config: EvalConfig) -> list[Score]:
    model, tokenizer = models.load(path, device=config.device)
    stops = models.stop_token_ids(model, tokenizer)
    sets = {
        "tasks": verifiable_tasks("heldout", count=config.tasks_limit),
        "chatterbot": chatterbot_dialogs("heldout")[: config.dialogs_limit],
    }
    scores = []
    for source, rows in sets.items():
        if not rows:
            continue
        prompts = [chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in rows]
        runs = {}
        for tau in sorted({1.0, *config.taus}, reverse=True):
            decode = DecodeConfig(
                tau=tau,
                block_size=config.block_size,
                max_new_tokens=config.max_new_tokens,
                stop_token_ids=stops,
            )
            runs[tau] = _decode_all(model, tokenizer, prompts, decode, config.batch_size)
        greedy = runs[1.0][0]
        human = [r["messages"][-1]["content"] for r in rows]
        for tau in config.taus:
            texts, tpf = runs[tau]
            if source == "tasks":
                accuracy = _mean(t == r["answer"] for t, r in zip(texts, rows, strict=True))
                scores.append(Score(name, source, tau, accuracy, tpf, accuracy, prompts=len(rows)))
            else:
                agree = _mean(t == g for t, g in zip(texts, greedy, strict=True))
                close = _mean(similarity(t, g) for t, g in zip(texts, greedy, strict=True))
                to_human = _mean(similarity(t, h) for t, h in zip(texts, human, strict=True))
                scores.append(Score(name, source, tau, agree, tpf, close, to_human, prompts=len(rows)))
    return scores


def _mean(values) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values)


def evaluate(config: EvalConfig) -> EvalReport:
    """Run the sweep; write JSON and the Pareto plot when asked."""
    report = EvalReport(config)
    named = [("mars", config.model)] + ([("ar-sft", config.baseline)] if config.baseline else [])
    for name, path in named:
        report.scores += _score_model(name, path, config)
    if config.output:
        config.output.parent.mkdir(parents=True, exist_ok=True)
        config.output.write_text(json.dumps(report.to_json(), indent=2))
    if config.plot:
        plot_pareto(report, config.plot)
    return report


def plot_pareto(report: EvalReport, path: Path) -> None:
    """Tokens per forward (x) against accuracy (y), one line per model and source, tau annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (name, source), marker in zip(
        dict.fromkeys((s.model, s.source) for s in report.scores), "osd^vx", strict=False
    ):
        cells = sorted(
            (s for s in report.scores if (s.model, s.source) == (name, source)), key=lambda s: -s.tau
        )
        xs = [s.tokens_per_forward for s in cells]
        ys = [100 * s.accuracy for s in cells]
        ax.plot(xs, ys, marker=marker, label=f"{name} / {source}")
        for s, x, y in zip(cells, xs, ys, strict=True):
            ax.annotate(f"{s.tau:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    ax.set_xlabel("tokens per forward")
    ax.set_ylabel("accuracy (tasks: exact match; dialogs: agreement with greedy) %")
    ax.set_title("MARS: quality against tokens per forward, tau annotated")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval", help="tau sweep: accuracy and tokens per forward on held-out prompts"
    )
    parser.add_argument("--model", required=True, help="MARS checkpoint: folder, Hub id or preset")
    parser.add_argument("--baseline", help="its AR-SFT control, evaluated the same way")
    parser.add_argument("--taus", type=float, nargs="+", default=list(PAPER_TAUS))
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--tasks-limit", type=int, default=200)
    parser.add_argument("--dialogs-limit", type=int, default=100)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--output", type=Path, help="JSON report path")
    parser.add_argument("--plot", type=Path, help="Pareto plot PNG path")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    config = EvalConfig(
        model=args.model,
        baseline=args.baseline,
        taus=tuple(args.taus),
        block_size=args.block_size,
        tasks_limit=args.tasks_limit,
        dialogs_limit=args.dialogs_limit,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        device=args.device,
        output=args.output,
        plot=args.plot,
    )
    print(evaluate(config).table())
