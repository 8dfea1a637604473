"""`mars-ray bench forward`: what one cached decode step costs against the window of tokens it carries."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from mars_ray import models
from mars_ray.bench.measure import device_line, sync, write_json
from mars_ray.core import gated
from mars_ray.core.compile import compile_steps
from mars_ray.core.dtypes import DtypeName, torch_dtype
from mars_ray.core.errors import ConfigError
from mars_ray.core.kv_cache import RaggedCache
from mars_ray.core.prepack import can_prepack, prepack_linears
from mars_ray.train.config import LoraSettings

WARMUP_STEPS = 2  # untimed steps per window first (where a compiled step compiles)


class ForwardBenchConfig(BaseModel):
    """One cached decode step against its window: `[one committed token | window - 1 masks]` after `context`
    cached tokens, which is the sliding decoder's step (window 1 is its AR step). The ratio of a window's
    time to window 1's is the tokens per forward a MARS decoder must accept there just to break even."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="the checkpoint: folder, Hub id or preset")
    context: int = Field(64, ge=1, description="cached tokens before the step")
    windows: tuple[PositiveInt, ...] = Field((1, 2, 4, 8), min_length=1, description="windows to time")
    batch_sizes: tuple[PositiveInt, ...] = Field((1, 4), min_length=1, description="rows per step")
    steps: int = Field(48, ge=1, description="timed steps per window; the windows take turns step by step")
    device: str = Field("cpu", description="torch device")
    dtype: DtypeName = Field("auto", description="weights' dtype (auto: as saved)")
    compile: bool = Field(False, description="torch.compile the cached steps (the warm-up steps compile)")
    prepack: bool = Field(
        False,
        description="also time the steps with linear weights packed for oneDNN (bf16 on a CPU that has it)",
    )
    gated_rank: PositiveInt | None = Field(
        None,
        description="also time the steps of the model with a gated adapter of this rank on every attention"
        " and MLP projection (`lora.gated`; its delta runs at the mask slots only), beside the plain model:"
        " stacked as decoding runs it, layer by layer as training runs it, and (with `compile`) compiled",
    )
    output: Path | None = Field(None, description="JSON path")


@dataclass
class StepTime:
    batch: int
    window: int
    milliseconds: float  # median over the timed steps
    ratio: float  # over the smallest window's time at the same batch, same forward
    forward: str = "eager"  # eager, packed (prepacked weights), compiled, packed + compiled, or gated rN
    eager_ratio: float = 1.0  # eager's time over this one's, same batch and window


def _load(config: ForwardBenchConfig):
    return models.load(config.model, dtype=torch_dtype(config.dtype), device=config.device)


def _forwards(config: ForwardBenchConfig) -> tuple[dict[str, torch.nn.Module], object]:
    """The eager model and, as asked, copies with packed weights, compiled steps, both, or a gated adapter;
    and the tokenizer."""
    model, tokenizer = _load(config)
    forwards = {"eager": model}
    variants = [("packed", True, False)] if config.prepack else []
    if config.compile:
        variants.append(("compiled", False, True))
        if config.prepack:
            variants.append(("packed + compiled", True, True))
    if config.prepack and not can_prepack(model):
        raise ConfigError("prepack", "packed weights need bf16 weights on a CPU with native bf16 (oneDNN)")
    for name, packed, compiled in variants:
        forwards[name], _ = _load(config)
        if packed:
            prepack_linears(forwards[name])
        if compiled:
            compile_steps(forwards[name])
    if config.gated_rank:  # a fresh adapter: its cost does not depend on what it has learned
        rank, targets = config.gated_rank, LoraSettings().target_modules
        gates = [(f"gated r{rank}", True, False, False), (f"gated r{rank} per layer", False, False, False)]
        if config.prepack:
            gates.append((f"gated r{rank} packed", True, True, False))
        if config.compile:
            gates.append((f"gated r{rank} compiled", True, False, True))
        for name, stacked, packed, compiled in gates:
            forwards[name], _ = _load(config)
            gated.attach(forwards[name], gated.GatedSpec(config.model, rank, 2.0 * rank, targets))
            if stacked:
                gated.stack(forwards[name])
            if packed:
                prepack_linears(forwards[name])
            if compiled:
                compile_steps(forwards[name])
    return forwards, tokenizer


@torch.inference_mode()
def run_forward_bench(config: ForwardBenchConfig) -> list[StepTime]:
    """Per batch, every window's step timed in turn, step by step; with `prepack` and `compile`, copies of
    the model with packed weights, compiled steps, and both take their turns beside the eager one, so each
    speed-up comes from the same run."""
    forwards, tokenizer = _forwards(config)
    model = forwards["eager"]
    device, vocab = model.device, model.config.vocab_size
    results = []
    for batch in config.batch_sizes:
        caches, steps, real = {}, {}, {}
        for name, forward_model in forwards.items():
            for window in config.windows:  # the same random context for every window
                torch.manual_seed(0)
                cache = RaggedCache(forward_model)
                cache.add_rows(batch)
                prompt = torch.randint(0, vocab, (batch, config.context), device=device)
                cache.forward(prompt, torch.ones_like(prompt, dtype=torch.bool), config.context, 1)
                step = torch.full((batch, window), tokenizer.mask_token_id, device=device)
                step[:, 0] = prompt[:, -1]
                key = (name, window)
                caches[key], steps[key] = cache, step
                real[key] = torch.ones_like(step, dtype=torch.bool)
        times: dict[tuple[str, int], list[float]] = {key: [] for key in caches}
        for i in range(config.steps + WARMUP_STEPS):
            for key, cache in caches.items():
                sync(device)
                start = time.perf_counter()
                cache.forward(steps[key], real[key], 1, key[1])
                sync(device)
                if i >= WARMUP_STEPS:
                    times[key].append(time.perf_counter() - start)
        medians = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
        smallest = min(config.windows)
        for (name, window), median in medians.items():
            base = medians[(name, smallest)]
            eager = medians[("eager", window)]
            results.append(StepTime(batch, window, 1e3 * median, median / base, name, eager / median))
    report = {
        "config": config.model_dump(mode="json"),
        "machine": device_line(device),
        "steps": [asdict(r) for r in results],
    }
    write_json(config.output, report)
    return results


def forward_table(config: ForwardBenchConfig, results: Sequence[StepTime]) -> str:
    lines = [
        f"model: {config.model}, dtype {config.dtype}, {config.context} cached tokens; median of "
        f"{config.steps} steps. `x window 1`: the tokens per forward a window must accept to break even; "
        "`x eager`: eager's time over this step's, same run.",
        "",
        "| forward | batch | window | ms/forward | x window 1 | x eager |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.forward} | {r.batch} | {r.window} | {r.milliseconds:.2f} | "
        f"{r.ratio:.2f} | {r.eager_ratio:.2f} |"
        for r in results
    ]
    return "\n".join(lines)
