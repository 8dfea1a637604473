"""What a ramp (`python -m mars_ray.bench.ramp`) measured: the status samples, each mode's summary (throughput
over the ramp and at its peak, latencies, time-weighted tau), the table with each round's ratios, the plot."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mars_ray.bench.client import RequestRecord, percentile

if TYPE_CHECKING:
    from mars_ray.bench.ramp import RampConfig


@dataclass
class Sample:
    at: float
    clients: int
    tau: float | None
    replicas: int
    waiting: int
    verified: float = 0.0  # the share of replicas at the verified (lossless) operating point


def time_weighted_mean(points: list[tuple[float, float]]) -> float:
    """Mean of a step function given as (time, value) points."""
    if len(points) < 2:
        return float("nan")
    area = sum(value * (later - at) for (at, value), (later, _) in zip(points, points[1:], strict=False))
    return area / (points[-1][0] - points[0][0])


def peak_window(args: RampConfig) -> tuple[float, float]:
    """Seconds from the ramp's start: the first run of stages at the highest level."""
    first = args.levels.index(max(args.levels))
    stages = next(
        (n for n, level in enumerate(args.levels[first:]) if level != args.levels[first]),
        len(args.levels) - first,
    )
    return first * args.stage_s, (first + stages) * args.stage_s


def tokens_within(records: list[RequestRecord], lo: float, hi: float) -> float:
    """Tokens streamed between lo and hi, each reply's tokens spread evenly from its first to its last."""
    total = 0.0
    for r in records:
        if r.first_token is None or r.completion_tokens == 0:
            continue
        span = r.finished - r.first_token
        if span <= 0:
            total += r.completion_tokens * (lo <= r.finished < hi)
        else:
            overlap = min(hi, r.finished) - max(lo, r.first_token)
            total += r.completion_tokens * max(0.0, overlap) / span
    return total


def summarize(
    mode: str, records: list[RequestRecord], samples: list[Sample], start: float, args: RampConfig
) -> dict:
    loaded_until = start + args.stage_s * len(args.levels)
    loaded = [r for r in records if r.finished <= loaded_until + 30]
    peak_lo, peak_hi = (start + t for t in peak_window(args))
    peak = [r for r in loaded if peak_lo <= r.started < peak_hi]
    per_token = [p for r in peak if (p := r.inter_token) is not None]
    latencies = [r.latency for r in peak]
    span = max(r.finished for r in loaded) - start if loaded else 1.0
    weighted = time_weighted_mean(
        [(s.at, s.tau) for s in samples if s.tau is not None and s.at <= loaded_until]
    )
    final = [s.tau for s in samples if s.tau is not None]
    verified = time_weighted_mean([(s.at, s.verified) for s in samples if s.at <= loaded_until])
    return {
        "mode": mode,
        "requests": len(loaded),
        "tokens_per_s": sum(r.completion_tokens for r in loaded) / span,
        "peak_tokens_per_s": tokens_within(records, peak_lo, peak_hi) / (peak_hi - peak_lo),
        "peak_latency_p50_s": percentile(latencies, 0.5),
        "peak_latency_p95_s": percentile(latencies, 0.95),
        "peak_per_token_p50_s": percentile(per_token, 0.5),
        "peak_per_token_p95_s": percentile(per_token, 0.95),
        "mean_tau": weighted,
        "verified_share": verified,
        "final_tau": final[-1] if final else float("nan"),
        "max_replicas": max((s.replicas for s in samples), default=0),
    }


def peak_ratios(rows: list[dict]) -> list[float]:
    """Each row's peak tokens/s as a multiple of its round's fixed tau=1.0 row (which runs first)."""
    base = {r["round"]: r["peak_tokens_per_s"] for r in rows if r["mode"] == "tau=1.0"}
    return [r["peak_tokens_per_s"] / base.get(r["round"], float("nan")) for r in rows]


def table(rows: list[dict], target: float) -> str:
    lines = [
        "| round | mode | requests | tokens/s | peak tokens/s | x tau=1.0 | p50 latency s | p95 latency s "
        "| p50 s/token | p95 s/token "
        f"| p95 vs objective ({target:g} s/token) | mean tau | verified | tau after load | replicas |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    ratios = peak_ratios(rows)
    by_mode: dict[str, list[float]] = {}
    for r, ratio in zip(rows, ratios, strict=True):
        by_mode.setdefault(r["mode"], []).append(ratio)
        lines.append(
            f"| {r['round']} | {r['mode']} | {r['requests']} | {r['tokens_per_s']:.1f} "
            f"| {r['peak_tokens_per_s']:.1f} | {ratio:.2f} | {r['peak_latency_p50_s']:.2f} "
            f"| {r['peak_latency_p95_s']:.2f} | {r['peak_per_token_p50_s']:.4f} "
            f"| {r['peak_per_token_p95_s']:.4f} "
            f"| {r['peak_per_token_p95_s'] / target:.2f}x | {r['mean_tau']:.3f} "
            f"| {100 * r['verified_share']:.0f}% | {r['final_tau']:.2f} "
            f"| {r['max_replicas']} |"
        )
    lines.append("")
    for mode, of_mode in by_mode.items():
        listed = ", ".join(f"{x:.2f}" for x in of_mode)
        lines.append(f"{mode}: x tau=1.0 at the peak {listed} (mean {sum(of_mode) / len(of_mode):.2f})")
    return "\n".join(lines)


def plot(
    runs: dict[str, tuple[list[RequestRecord], list[Sample], float]], target: float, path: Path, bin_s: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for mode, (records, samples, start) in runs.items():
        end = max(s.at for s in samples) - start
        edges = [i * bin_s for i in range(int(end / bin_s) + 1)]
        done = [[r for r in records if e <= r.finished - start < e + bin_s] for e in edges]
        axes[0].plot(edges, [sum(r.completion_tokens for r in d) / bin_s for d in done], label=mode)
        p95 = [percentile([p for r in d if (p := r.inter_token) is not None], 0.95) for d in done]
        axes[1].plot(edges, p95, label=mode)
        axes[2].step(
            [s.at - start for s in samples],
            [s.tau if s.tau else float("nan") for s in samples],
            where="post",
            label=mode,
        )
        axes[3].step([s.at - start for s in samples], [s.replicas for s in samples], where="post", label=mode)
    clients_x = [s.at - start for s in samples]
    twin = axes[0].twinx()
    twin.step(clients_x, [s.clients for s in samples], where="post", color="grey", alpha=0.4)
    twin.set_ylabel("clients (grey)")
    axes[1].axhline(target, color="red", linestyle="--", label="objective")
    axes[0].set_ylabel("tokens/s")
    axes[1].set_ylabel("p95 s/token")
    axes[2].set_ylabel("operating tau")
    axes[3].set_ylabel("replicas")
    axes[3].set_xlabel("seconds")
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.suptitle("Ramp: fixed tau=1.0, fixed tau=tau_min, load-adaptive tau (same replica count)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def record_json(record: RequestRecord) -> dict:
    """A request as `ramp.json` has always written it (the keys its readers know)."""
    return {
        "started": record.started,
        "first": record.first_token,
        "finished": record.finished,
        "tokens": record.completion_tokens,
    }
