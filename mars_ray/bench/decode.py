"""`mars-ray bench decode`: every decoder on one checkpoint, the same prompts, budget and batch, one run; and
the `mars-ray bench` command itself (`bench forward` is `forward.py`).

The methods are `decoders.py`'s; the rows and their ratios `decode_report.py`'s. Here: the run. At each batch
size every method decodes every batch once untimed, then `repeats` rounds of every method in turn (drifting
machine load hits every method alike), and each row reports its median round.

Forward passes are counted by a hook on the model, the same way for every method: tokens per forward is
generated tokens over the rows that took part in each forward (a finished row that HF keeps in its batch
counts, as it costs compute). Tokens are counted up to and including the stop token. vLLM's forwards run in
its own process: its rows count them as vLLM reports them per request (`mars_ray.vllm.passes`).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationInfo, field_validator

from mars_ray import cli_args, models
from mars_ray.bench.decode_report import BenchReport, Measurement, Rows, compare
from mars_ray.bench.decoders import METHODS, NATIVE_ONLY, VLLM_METHODS, Decoders, Method, Run
from mars_ray.bench.forward import ForwardBenchConfig, forward_table, run_forward_bench
from mars_ray.bench.measure import PeakMemory, device_line, sync, write_json
from mars_ray.core.dtypes import DtypeName, torch_dtype
from mars_ray.core.errors import ConfigError
from mars_ray.core.prepack import can_prepack, prepack_linears
from mars_ray.data import chat_prompt_ids, chatterbot_dialogs, verifiable_tasks
from mars_ray.serve.config import BlockSizeOrNone, Tau
from mars_ray.vllm.config import ENGINE_HELP, Engine


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
    tau: Tau = Field(0.9, description="MARS confidence threshold")
    taus: tuple[Tau, ...] = Field(
        (), description="more taus the MARS methods also run at, a row each (ar-sliding stays at tau 1)"
    )
    block_size: BlockSizeOrNone = Field(None, description="window; default: the trained B")
    allow_wider_window: bool = Field(False, description="allow a window wider than the trained B")
    engine: Engine = Field("native", description=ENGINE_HELP + " (the MARS methods; HF's stay HF's)")
    methods: tuple[Method, ...] = Field(
        METHODS, min_length=1, validate_default=True, description="decoders to time"
    )
    baseline: str | None = Field(
        None, description="the base model: HF generate on it (`ar-base`) is what every ratio is taken against"
    )
    device: str = Field("cpu", description="torch device")
    dtype: DtypeName = Field("auto", description="weights' dtype (auto: as saved)")
    prepack: bool = Field(
        False,
        description="pack the checkpoint's linear weights once, as the serving engine does for bf16 on a"
        " CPU with native bf16 (`prepack_weights`): every in-process method on it runs packed, the baseline"
        " stock",
    )
    repeats: int = Field(3, ge=1, description="rounds of every method in turn; each row reports its median")
    output: Path | None = Field(None, description="JSON path")

    @field_validator("methods")
    @classmethod
    def _engine_runs(cls, methods: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        """On vLLM every method (the default) means every one it runs; a native-only one named is refused."""
        if info.data.get("engine") != "vllm":
            return methods
        if methods == METHODS:
            return VLLM_METHODS
        if native := [m for m in methods if m in NATIVE_ONLY]:
            raise ConfigError("methods", f"{', '.join(native)}: native decoders only, not on engine vllm")
        return methods


def bench_prompts(tokenizer, count: int, source: str = "mixed") -> list[list[int]]:
    """Held-out prompts through the chat template: verifiable tasks, real dialogs, or half of each."""
    dialog_count = {"mixed": count // 2, "tasks": 0, "dialogs": count}[source]
    tasks = verifiable_tasks("heldout", count=count - dialog_count) if dialog_count < count else []
    dialogs = chatterbot_dialogs("heldout")[:dialog_count]
    return [chat_prompt_ids(tokenizer, row["messages"][:-1]) for row in tasks + dialogs]


def run_bench(config: BenchConfig) -> BenchReport:
    # Loaded (and packed) in the thread that runs every forward, as the engine does: in a thread that was not
    # the first to run torch's parallel work, oneDNN's small bf16 products run slower (BENCHMARKS.md).
    torch_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-torch")
    try:
        model, tokenizer, base_model = torch_thread.submit(_load_models, config).result()
        report = _run_bench(config, model, tokenizer, base_model, torch_thread)
    finally:
        torch_thread.shutdown()
    write_json(config.output, report.to_json())
    return report


def _load_models(config: BenchConfig) -> tuple[torch.nn.Module, object, torch.nn.Module | None]:
    model, tokenizer = _load(config.model, config)
    if config.prepack:
        if not can_prepack(model):
            raise ConfigError(
                "prepack", "packed weights need bf16 weights on a CPU with native bf16 (oneDNN)"
            )
        prepack_linears(model)
    base_model = _load(config.baseline, config)[0] if config.baseline else None
    return model, tokenizer, base_model


def _run_bench(
    config: BenchConfig, model: torch.nn.Module, tokenizer, base_model, torch_thread: ThreadPoolExecutor
) -> BenchReport:
    vllm = None
    if config.engine == "vllm":
        from mars_ray.vllm.offline import VllmDecoder

        vllm = VllmDecoder(models.resolve(config.model), dtype=config.dtype)
    decoders = Decoders(config, model, tokenizer, torch_thread, base_model, vllm)
    prompts = bench_prompts(tokenizer, config.prompts, config.prompt_source)
    report = BenchReport(config, device_line(model.device))
    for batch_size in config.batch_sizes:
        measured = _measure(decoders.runs(batch_size), prompts, batch_size, config.repeats, model.device)
        compare(measured)
        for m, _ in measured:
            report.measurements.append(m)
            tau = "-" if m.tau is None else f"{m.tau:g}"
            print(
                f"  {m.method:17s} tau {tau:>4} batch {batch_size:2d} block {m.cache_block or '-':>3}: "
                f"{m.tokens_per_second:8.1f} tok/s  x{m.ratio:.2f}  {m.tokens_per_forward:.2f} tok/fwd",
                flush=True,
            )
    return report


def _measure(
    runs: Sequence[Run], prompts: Rows, batch_size: int, repeats: int, device: torch.device
) -> list[tuple[Measurement, Rows]]:
    """Each run's median round over every prompt (batch by batch, or all at once for a `whole` run), with
    the replies of that round."""
    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    for run in runs:
        run.decode(batches[0])  # warm-up, not timed
    samples: list[list[tuple[float, Rows, object, float]]] = [[] for _ in runs]
    for _ in range(repeats):
        for run, taken in zip(runs, samples, strict=True):
            counter = run.counter()
            with PeakMemory(device) as memory:
                sync(device)
                start = time.perf_counter()
                inputs = [prompts] if run.whole else batches
                outputs = [row for batch in inputs for row in run.decode(batch)]
                sync(device)
                seconds = time.perf_counter() - start
            counter.close()
            taken.append((seconds, outputs, counter, memory.megabytes))
    measured = []
    for run, taken in zip(runs, samples, strict=True):
        seconds, outputs, counter, _ = sorted(taken, key=lambda sample: sample[0])[len(taken) // 2]
        peak = max(sample[3] for sample in taken) if run.in_process else None
        m = Measurement(
            method=run.method,
            batch=batch_size,
            cache_block=run.cache_block,
            tokens=sum(map(len, outputs)),
            seconds=seconds,
            forwards=counter.calls,
            row_forwards=counter.rows,
            peak_memory_mb=peak,
            note=run.note,
            tau=run.tau,
        )
        measured.append((m, outputs))
    return measured


def _load(model: str, config: BenchConfig):
    return models.load(model, dtype=torch_dtype(config.dtype), device=config.device)


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
