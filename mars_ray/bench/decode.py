"""`mars-ray bench decode`: every decoder on one checkpoint, the same prompts, budget and batch, one run.
`mars-ray bench forward`: what one cached decode step costs against the window of tokens it carries.

Methods: HF `generate` greedy with a KV cache (the AR baseline every ratio is taken against, at the same
batch size; with `baseline`, also on the base model, `ar-base`, which then sets the ratios); the MARS
sliding decoder at tau = 1 (the same greedy AR tokens through MARS's own loop, which separates what the
loop costs or saves from what multi-token acceptance gains); HF prompt-lookup decoding (the lossless
peer); the MARS sliding cached decoder at the bench's tau (at batch 1 the single-sequence decoder); the
same decoder verified (`mars-verify`: lossless, exactly greedy, tau picks the proposals it checks); the
paper's block-cached decoder over a sweep of cache-block sizes (as published, and with the extend pass
fused into the next block); and the serving engine's continuous batcher. `= greedy` is the share of rows
whose tokens equal HF `generate`'s on the same model.

Forward passes are counted by a hook on the model, the same way for every method: tokens per forward is
generated tokens over the rows that took part in each forward (a finished row that HF keeps in its batch
counts, as it costs compute). Tokens are counted up to and including the stop token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import time
import typing
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from mars_ray import cli_args, models
from mars_ray.bench.baseline import hf_greedy_tokens
from mars_ray.bench.machine import cpu_name
from mars_ray.core import gated
from mars_ray.core.compile import compile_steps
from mars_ray.core.decoding import DecodeConfig, RaggedCache, decode_block_cached, decode_cached
from mars_ray.core.errors import ConfigError
from mars_ray.core.prepack import can_prepack, prepack_linears
from mars_ray.data import chat_prompt_ids, chatterbot_dialogs, verifiable_tasks
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine import Engine
from mars_ray.serve.types import SamplingParams
from mars_ray.train.config import LoraSettings

Method = Literal[
    "ar",
    "ar-sliding",
    "prompt-lookup",
    "mars-cached",
    "mars-verify",
    "mars-block",
    "mars-block-fused",
    "engine",
]
METHODS: tuple[str, ...] = typing.get_args(Method)
PROMPT_SOURCES = ("mixed", "tasks", "dialogs")
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class BenchConfig(BaseModel):
    """`mars-ray bench decode`: every method on the same held-out prompts, budget and batch, one run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="the MARS checkpoint: folder, Hub id or preset")
    prompts: int = Field(16, ge=1, description="held-out prompts")
    prompt_source: Literal["mixed", "tasks", "dialogs"] = Field(
        "mixed", description="half generated tasks and half real dialogs, or only one of them"
    )
    max_new_tokens: int = Field(64, ge=1, description="reply budget per prompt")
    batch_sizes: tuple[PositiveInt, ...] = Field((1, 4, 8, 16), min_length=1, description="rows per batch")
    cache_blocks: tuple[PositiveInt, ...] = Field(
        (4, 8, 16, 32), description="cache-block sizes Bc of the block-cached decoders"
    )
    tau: float = Field(0.9, gt=0, le=1, description="MARS confidence threshold")
    block_size: int | None = Field(None, ge=1, description="window; default: the trained B")
    allow_wider_window: bool = Field(False, description="allow a window wider than the trained B")
    methods: tuple[Method, ...] = Field(METHODS, min_length=1, description="decoders to time")
    baseline: str | None = Field(
        None, description="the base model: HF generate on it (`ar-base`) is what every ratio is taken against"
    )
    device: str = Field("cpu", description="torch device")
    dtype: Dtype = Field("auto", description="weights' dtype (auto: as saved)")
    repeats: int = Field(3, ge=1, description="rounds of every method in turn; each row reports its median")
    output: Path | None = Field(None, description="JSON path")


@dataclass
class Measurement:
    method: str
    batch: int
    cache_block: int | None
    tokens: int
    seconds: float
    forwards: int
    row_forwards: int
    peak_memory_mb: float
    note: str = ""
    ratio: float = 0.0  # tokens/s over HF generate's at the same batch size, this run (the base model's)
    ratio_sliding: float = 0.0  # tokens/s over ar-sliding's (MARS's own loop at tau = 1)
    same_as_greedy: float | None = None  # fraction of rows whose tokens equal HF generate's on this model

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / max(self.row_forwards, 1)


@dataclass
class BenchReport:
    config: BenchConfig
    machine: str
    measurements: list[Measurement] = field(default_factory=list)

    def table(self) -> str:
        versus = "base AR" if self.config.baseline else "AR"
        lines = [
            f"machine: {self.machine}; model: {self.config.model}"
            + (f" (base: {self.config.baseline})" if self.config.baseline else "")
            + f"; dtype {self.config.dtype}; tau={self.config.tau:g}, block_size={self.config.block_size}, "
            f"max_new_tokens={self.config.max_new_tokens}, {self.config.prompts} prompts "
            f"({self.config.prompt_source}); `= greedy`: rows whose tokens equal HF generate's on the model",
            "",
            f"| method | batch | cache block | tokens/s | x {versus} | x ar-sliding | tokens/forward "
            "| forwards | = greedy % | peak MB | note |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]

        def times(value: float) -> str:
            return f"{value:.2f}" if math.isfinite(value) else ""  # blank: nothing to compare with

        for m in self.measurements:
            same = "" if m.same_as_greedy is None else f"{100 * m.same_as_greedy:.0f}"
            lines.append(
                f"| {m.method} | {m.batch} | {m.cache_block or ''} | {m.tokens_per_second:.1f} "
                f"| {times(m.ratio)} | {times(m.ratio_sliding)} | {m.tokens_per_forward:.2f} | {m.forwards} "
                f"| {same} | {m.peak_memory_mb:.0f} | {m.note} |"
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
        return {"config": _config_json(self.config), "machine": self.machine, "measurements": rows}


class ForwardCounter:
    """Counts model calls and the rows in each, through a forward hook."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = self.rows = 0
        self._handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls += 1
        self.rows += int(ids.shape[0]) if ids is not None else 1

    def close(self) -> None:
        self._handle.remove()


class PeakMemory:
    """Peak memory above the start: CUDA allocator statistics, or the kernel's peak RSS on CPU.

    On CPU the peak is Linux's resettable high-water mark (VmHWM, reset through /proc/self/clear_refs), read
    once at the end: a sampling thread would fight the decode loop for the GIL and slow what it measures
    (the serving engine, whose forward runs in a worker thread, ran at a third of its speed beside one).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self._base = torch.cuda.memory_allocated()
        else:
            self._base = _proc_status_bytes("VmRSS")
            with contextlib.suppress(OSError):
                Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self._base
        else:
            self.peak = _proc_status_bytes("VmHWM") - self._base

    @property
    def megabytes(self) -> float:
        return max(self.peak, 0) / 2**20


def _proc_status_bytes(field: str) -> int:
    """A memory field of /proc/self/status in bytes (0 where there is no procfs)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def bench_prompts(tokenizer, count: int, source: str = "mixed") -> list[list[int]]:
    """Held-out prompts through the chat template: verifiable tasks, real dialogs, or half of each."""
    dialog_count = {"mixed": count // 2, "tasks": 0, "dialogs": count}[source]
    tasks = verifiable_tasks("heldout", count=count - dialog_count) if dialog_count < count else []
    dialogs = chatterbot_dialogs("heldout")[:dialog_count]
    return [chat_prompt_ids(tokenizer, row["messages"][:-1]) for row in tasks + dialogs]


def run_bench(config: BenchConfig) -> BenchReport:
    model, tokenizer = _load(config.model, config)
    base_model = _load(config.baseline, config)[0] if config.baseline else None
    mask_id, pad_id = tokenizer.mask_token_id, tokenizer.pad_token_id
    decode = DecodeConfig.for_model(
        model,
        tokenizer,
        config.block_size,
        allow_wider=config.allow_wider_window,
        tau=config.tau,
        max_new_tokens=config.max_new_tokens,
    )
    stops = decode.stop_token_ids
    prompts = bench_prompts(tokenizer, config.prompts, config.prompt_source)
    device = model.device
    # Every forward of the run on one thread, the engine's included: torch gives each thread that computes
    # its own OpenMP team, and a second team on the same cores slows whichever method runs after it.
    torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-torch")
    Rows = list[list[int]]

    def on_torch_thread(fn: Callable[[Rows], Rows]) -> Callable[[Rows], Rows]:
        return lambda batch: torch_thread.submit(fn, batch).result()

    def hf_generate(batch: Rows, on=model, **extra) -> Rows:
        return hf_greedy_tokens(on, batch, config.max_new_tokens, stops, pad_id, **extra)

    @on_torch_thread
    def prompt_lookup(batch: Rows) -> Rows:
        window = decode.block_size * 2
        return [row for p in batch for row in hf_generate([p], prompt_lookup_num_tokens=window)]

    def sliding(config: DecodeConfig) -> Callable[[Rows], Rows]:
        @on_torch_thread
        def run(batch: Rows) -> Rows:
            return [r.tokens for r in decode_cached(model, batch, mask_id, config, pad_id)]

        return run

    def mars_block(cache_block: int, fuse: bool) -> Callable[[Rows], Rows]:
        @on_torch_thread
        def run(batch: Rows) -> Rows:
            results = decode_block_cached(
                model, batch, mask_id, decode, cache_block, pad_id, fuse_extend=fuse
            )
            return [r.tokens for r in results]

        return run

    def engine_batcher(batch_size: int) -> Callable[[Rows], Rows]:
        """The serving engine in this process: the prompts arrive at once, at most `batch_size` run
        together, and a waiting one takes a finished one's row at the next forward."""
        serving = ModelConfig(
            model=config.model,
            tau=config.tau,
            block_size=decode.block_size,
            max_block_size=decode.block_size,
            max_batch_size=batch_size,
            max_ongoing_requests=max(batch_size, 64),
            prepack_weights=False,  # it shares the other methods' model: packing it would change theirs
        )
        params = SamplingParams(max_tokens=config.max_new_tokens)

        async def one(engine: Engine, prompt: list[int]) -> list[int]:
            tokens = []
            async for chunk in engine.generate(prompt, params):
                tokens += chunk.token_ids
                if chunk.finish_reason:
                    return tokens
            raise RuntimeError("the engine ended a request without a finish reason")

        async def run(prompts: Rows) -> Rows:
            engine = Engine(model, tokenizer, serving, executor=torch_thread)
            try:
                return list(await asyncio.gather(*(one(engine, p) for p in prompts)))
            finally:
                await engine.close()

        return lambda prompts: asyncio.run(run(prompts))  # its event loop here, its forwards on torch_thread

    report = BenchReport(config, _machine(device))
    for batch_size in config.batch_sizes:
        batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
        runs: list[tuple[str, int | None, Callable, str]] = []  # each called on every batch in turn
        if base_model is not None:
            base = on_torch_thread(lambda batch: hf_generate(batch, on=base_model))
            runs.append(("ar-base", None, base, "HF generate on the base model, greedy, KV cache"))
        if "ar" in config.methods:
            runs.append(("ar", None, on_torch_thread(hf_generate), "HF generate, greedy, KV cache"))
        if "ar-sliding" in config.methods:
            greedy = replace(decode, tau=1.0)
            runs.append(("ar-sliding", None, sliding(greedy), "MARS's sliding decoder at tau = 1: greedy AR"))
        if "prompt-lookup" in config.methods:
            note = "HF supports batch 1 only: rows run one at a time" if batch_size > 1 else ""
            runs.append(("prompt-lookup", None, prompt_lookup, note))
        if "mars-cached" in config.methods:
            runs.append(
                (
                    "mars-cached",
                    None,
                    sliding(decode),
                    "sliding cache" if batch_size > 1 else "single sequence",
                )
            )
        if "mars-verify" in config.methods:
            verified = replace(decode, verify=True)
            runs.append(
                ("mars-verify", None, sliding(verified), "verified: exactly greedy, tau picks drafts")
            )
        for fuse, name in ((False, "mars-block"), (True, "mars-block-fused")):
            if name in config.methods:
                runs += [(name, cb, mars_block(cb, fuse), "") for cb in config.cache_blocks]
        if "engine" in config.methods:
            note = f"continuous batching: all prompts at once, {batch_size} at a time"
            runs.append(("engine", None, engine_batcher(batch_size), note))
        for _, _, fn, _ in runs:
            fn(batches[0])  # warm-up, not timed
        samples: list[list[tuple[float, Rows, ForwardCounter, float]]] = [[] for _ in runs]
        for _ in range(config.repeats):  # rounds: drifting machine load hits every method alike
            for (method, _, fn, _), taken in zip(runs, samples, strict=True):
                counter = ForwardCounter(base_model if method == "ar-base" else model)
                with PeakMemory(device) as memory:
                    _sync(device)
                    start = time.perf_counter()
                    inputs = [prompts] if method == "engine" else batches
                    outputs = [row for b in inputs for row in fn(b)]
                    _sync(device)
                    seconds = time.perf_counter() - start
                counter.close()
                taken.append((seconds, outputs, counter, memory.megabytes))
        measured = []
        for (method, cache_block, _, note), taken in zip(runs, samples, strict=True):
            seconds, outputs, counter, _ = sorted(taken, key=lambda sample: sample[0])[len(taken) // 2]
            peak = max(sample[3] for sample in taken)
            tokens = sum(map(len, outputs))
            m = Measurement(
                method, batch_size, cache_block, tokens, seconds, counter.calls, counter.rows, peak, note
            )
            measured.append((m, outputs))
        reference = {m.method: (m, outputs) for m, outputs in measured}
        baseline = reference.get("ar-base", reference.get("ar", (None, None)))[0]
        sliding_ar = reference.get("ar-sliding", (None, None))[0]
        greedy_rows = reference.get("ar", (None, None))[1]
        for m, outputs in measured:
            m.ratio = m.tokens_per_second / baseline.tokens_per_second if baseline else float("nan")
            m.ratio_sliding = (
                m.tokens_per_second / sliding_ar.tokens_per_second if sliding_ar else float("nan")
            )
            if greedy_rows is not None and m.method != "ar-base":
                m.same_as_greedy = sum(a == b for a, b in zip(outputs, greedy_rows, strict=True)) / len(
                    outputs
                )
            report.measurements.append(m)
            print(
                f"  {m.method:17s} batch {batch_size:2d} block {m.cache_block or '-':>3}: "
                f"{m.tokens_per_second:8.1f} tok/s  x{m.ratio:.2f}  {m.tokens_per_forward:.2f} tok/fwd",
                flush=True,
            )
    torch_thread.shutdown()
    _write_json(config.output, report.to_json())
    return report


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
    dtype: Dtype = Field("auto", description="weights' dtype (auto: as saved)")
    compile: bool = Field(False, description="torch.compile the cached steps (the warm-up steps compile)")
    prepack: bool = Field(
        False,
        description="also time the steps with linear weights packed for oneDNN (bf16 on a CPU that has it)",
    )
    gated_rank: PositiveInt | None = Field(
        None,
        description="also time the steps of the model with a gated adapter of this rank on every attention"
        " and MLP projection (`lora.gated`; its delta runs at the mask slots only), beside the plain model",
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


@torch.inference_mode()
def run_forward_bench(config: ForwardBenchConfig) -> list[StepTime]:
    """Per batch, every window's step timed in turn, step by step; with `prepack` and `compile`, copies of
    the model with packed weights, compiled steps, and both take their turns beside the eager one, so each
    speed-up comes from the same run."""
    model, tokenizer = _load(config.model, config)
    forwards = {"eager": model}
    variants = [("packed", True, False)] if config.prepack else []
    if config.compile:
        variants.append(("compiled", False, True))
        if config.prepack:
            variants.append(("packed + compiled", True, True))
    if config.prepack and not can_prepack(model):
        raise ConfigError("prepack", "packed weights need bf16 weights on a CPU with native bf16 (oneDNN)")
    for name, packed, compiled in variants:
        forwards[name], _ = _load(config.model, config)
        if packed:
            prepack_linears(forwards[name])
        if compiled:
            compile_steps(forwards[name])
    if config.gated_rank:  # a fresh adapter: its cost does not depend on what it has learned
        name = f"gated r{config.gated_rank}"
        forwards[name], _ = _load(config.model, config)
        rank, targets = config.gated_rank, LoraSettings().target_modules
        gated.attach(forwards[name], gated.GatedSpec(config.model, rank, 2.0 * rank, targets))
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
        for i in range(config.steps + 2):  # two warm-up steps (where a compiled step compiles)
            for key, cache in caches.items():
                _sync(device)
                start = time.perf_counter()
                cache.forward(steps[key], real[key], 1, key[1])
                _sync(device)
                if i >= 2:
                    times[key].append(time.perf_counter() - start)
        medians = {key: sorted(t)[len(t) // 2] for key, t in times.items()}
        smallest = min(config.windows)
        for (name, window), median in medians.items():
            base = medians[(name, smallest)]
            eager = medians[("eager", window)]
            results.append(StepTime(batch, window, 1e3 * median, median / base, name, eager / median))
    report = {
        "config": _config_json(config),
        "machine": _machine(device),
        "steps": [asdict(r) for r in results],
    }
    _write_json(config.output, report)
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


def _load(model: str, config: BenchConfig | ForwardBenchConfig):
    dtype = getattr(torch, config.dtype) if config.dtype != "auto" else None
    return models.load(model, dtype=dtype, device=config.device)


def _config_json(config: BenchConfig | ForwardBenchConfig) -> dict:
    return config.model_dump(mode="json")


def _write_json(path: Path | None, report: dict) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_name()}, {torch.get_num_threads()} torch threads"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks")
    kinds = parser.add_subparsers(dest="bench", required=True)
    decode = kinds.add_parser(
        "decode", help="every decoder on one checkpoint, same prompts and batch, one run"
    )
    cli_args.add_config_arguments(decode, BenchConfig)
    decode.set_defaults(run=run)
    step = kinds.add_parser("forward", help="one cached decode step's time against the window it carries")
    cli_args.add_config_arguments(step, ForwardBenchConfig)
    step.set_defaults(run=run_forward)


def run(args: argparse.Namespace) -> None:
    print(run_bench(cli_args.config_from_args(BenchConfig, args)).table())


def run_forward(args: argparse.Namespace) -> None:
    config = cli_args.config_from_args(ForwardBenchConfig, args)
    print(forward_table(config, run_forward_bench(config)))
