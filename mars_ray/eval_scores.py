"""What `mars-ray eval` reports: a `Score` per (model, source, mode, confidence, tau) cell, the Markdown
table of them and the Pareto plot."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel


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


def score_table(scores: Sequence[Score]) -> str:
    """Markdown, one row per (model, mode, confidence, tau); `= base`: agreement with the base model."""
    sources = [s for s in ("tasks", "chatterbot") if any(c.source == s for c in scores)]
    head = ["model", "mode", "confidence", "tau"]
    for source in sources:
        head += [f"{source} tok/fwd"] + (["acc %"] if source == "tasks" else [])
        head += ["= own tau 1 % (sim)", "= base % (sim)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rows = dict.fromkeys((s.model, s.mode, s.confidence, s.tau) for s in scores)
    for row in rows:
        model, mode, confidence, tau = row
        cells = [model, mode, confidence, f"{tau:g}"]
        for source in sources:
            score = next(
                (s for s in scores if (s.model, s.mode, s.confidence, s.tau, s.source) == (*row, source)),
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


def plot_pareto(scores: Sequence[Score], path: Path) -> None:
    """Tokens per forward (x) against quality (y): task accuracy, and dialog similarity to the base model's
    reply (to the model's own greedy reply without a base), one line per model, source and confidence."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lines = dict.fromkeys((s.model, s.source, s.confidence) for s in scores)
    for (name, source, confidence), marker in zip(lines, "osd^vx<>p*", strict=False):
        cells = sorted(
            (s for s in scores if (s.model, s.source, s.confidence) == (name, source, confidence)),
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
