"""What `mars-ray bench decode` reports: a row per method and setting, its speed and tokens per forward, its
ratios to the AR baselines of the same batch size, and its text against theirs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mars_ray.bench.decode import BenchConfig

Rows = list[list[int]]


@dataclass
class Measurement:
    method: str
    batch: int
    cache_block: int | None
    tokens: int
    seconds: float
    forwards: int | None  # model calls; None where no hook sees them (vLLM runs its forwards in its process)
    row_forwards: int  # the rows that took part in each forward, summed (vLLM's: as it reports them per row)
    peak_memory_mb: float | None  # None for an engine in another process
    note: str = ""
    tau: float | None = None  # None: a method that does not read tau (HF's)
    ratio: float = 0.0  # tokens/s over HF generate's at the same batch size, this run (the base model's)
    ratio_sliding: float = 0.0  # tokens/s over ar-sliding's (the engine's own loop at tau = 1)
    same_as_greedy: float | None = None  # fraction of rows whose tokens equal HF generate's on this model
    same_as_ar: float | None = None  # fraction of rows whose tokens equal ar-sliding's (the same engine's AR)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.row_forwards, 1)


def compare(measured: Sequence[tuple[Measurement, Rows]]) -> None:
    """One batch size's rows against its baselines, in place: speed over HF generate (the base model's where
    there is one) and over ar-sliding; the share of rows equal to HF generate's and to ar-sliding's.

    The verified rows must equal ar-sliding's exactly on either engine; against HF generate a bf16 row may
    part at a near-tie, where another kernel rounds the two top logits the other way."""
    found = {m.method: (m, outputs) for m, outputs in measured}
    baseline = found.get("ar-base", found.get("ar", (None, None)))[0]
    sliding, sliding_rows = found.get("ar-sliding", (None, None))
    greedy_rows = found.get("ar", (None, None))[1]
    for m, outputs in measured:
        m.ratio = m.tokens_per_second / baseline.tokens_per_second if baseline else float("nan")
        m.ratio_sliding = m.tokens_per_second / sliding.tokens_per_second if sliding else float("nan")
        if m.method != "ar-base":
            m.same_as_greedy = _share_equal(outputs, greedy_rows)
            m.same_as_ar = _share_equal(outputs, sliding_rows)


def _share_equal(rows: Rows, reference: Rows | None) -> float | None:
    if reference is None:
        return None
    return sum(a == b for a, b in zip(rows, reference, strict=True)) / len(rows)


@dataclass
class BenchReport:
    config: BenchConfig
    machine: str
    measurements: list[Measurement] = field(default_factory=list)

    def table(self) -> str:
        config = self.config
        versus = "base AR" if config.baseline else "AR"
        taus = ", ".join(f"{t:g}" for t in (config.tau, *config.taus))
        lines = [
            f"machine: {self.machine}; model: {config.model}"
            + (f" (base: {config.baseline})" if config.baseline else "")
            + f"; engine {config.engine}; dtype {config.dtype}; tau {taus}, block_size={config.block_size}, "
            f"max_new_tokens={config.max_new_tokens}, {config.prompts} prompts ({config.prompt_source}); "
            "`= greedy`: rows whose tokens equal HF generate's on the model; `= ar-sliding`: equal to the "
            "engine's own AR",
            "",
            f"| method | tau | batch | cache block | tokens/s | x {versus} | x ar-sliding | tokens/forward "
            "| forwards | = greedy % | = ar-sliding % | peak MB | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in self.measurements:
            lines.append(
                f"| {m.method} | {_blank(m.tau, 'g')} | {m.batch} | {m.cache_block or ''} "
                f"| {m.tokens_per_second:.1f} | {_times(m.ratio)} | {_times(m.ratio_sliding)} "
                f"| {m.tokens_per_forward:.2f} | {_blank(m.forwards, 'd')} | {_percent(m.same_as_greedy)} "
                f"| {_percent(m.same_as_ar)} | {_blank(m.peak_memory_mb, '.0f')} | {m.note} |"
            )
        return "\n".join(lines)

    def to_json(self) -> dict:
        rows = [
            {
                **asdict(m),
                "tokens_per_second": m.tokens_per_second,
                "tokens_per_forward": m.tokens_per_forward,
            }
            for m in self.measurements
        ]
        return {"config": self.config.model_dump(mode="json"), "machine": self.machine, "measurements": rows}


def _times(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else ""  # blank: nothing to compare with


def _percent(share: float | None) -> str:
    return "" if share is None else f"{100 * share:.0f}"


def _blank(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)
