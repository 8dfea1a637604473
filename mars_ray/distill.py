"""`mars-ray distill`: a model's own greedy replies to the prompts of chat sources, as a training dataset.

MARS trained on a model's own outputs keeps its distribution (at tau = 1 the tuned model still answers
close to the original) and teaches the masks to predict text the model itself finds likely, which is
what Medusa-2 and EAGLE do to raise acceptance. Any `messages` source gives the prompts (a row's turns
before its last assistant turn, or all of them when it ends on a user turn).

The output folder is a dataset that `datasets` and `mars-ray train` load (`datasets: [DIR]`):

    DIR/distill.yaml          the config it was made with (a rerun must match it) and, when done, counts
    DIR/shard-00000.jsonl     rows {messages: prompt + the model's reply, complete, completion_tokens,
    ...                             source}: `complete` is false when the reply hit `max_new_tokens`

Prompts are deduplicated and cut into shards of `shard_size`; Ray actors (`num_workers`, each a loaded
model on `cpus_per_worker` threads) decode shards with continuous batching over the KV cache, or with
`engine: vllm` hand each shard to vLLM whole (several times faster on CPU at these batch sizes: BENCHMARKS).
A shard is written atomically when it is done, so a rerun skips finished shards and redoes only the rest.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from tqdm import tqdm

from mars_ray import cli_args, data, folders, models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_continuous
from mars_ray.core.dtypes import DtypeName, torch_dtype
from mars_ray.core.errors import ConfigError
from mars_ray.vllm.config import ENGINE_HELP, Engine

# Where and how wide the decoding runs: not what it writes (up to near-ties in the kernels' arithmetic).
RESUMABLE_CHANGES = {"num_workers", "cpus_per_worker", "batch_size", "device"}
RECORD = "distill.yaml"  # the config a folder was started with, and when done its counts


class DistillConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="the model whose replies are written: preset, HF folder or Hub id")
    prompts: list[str] = Field(min_length=1, description="chat sources whose prompts are replied to")
    output: str = Field(description="the dataset folder to write (a rerun resumes it)")
    split: str = Field(default="train", description="split of every prompt source")
    tasks_count: int = Field(default=4000, ge=1, description="rows generated for the bundled `tasks`")
    max_new_tokens: int = Field(default=64, ge=1, description="reply budget; a longer reply is cut")
    dtype: DtypeName = Field(default="auto", description="weights' dtype")
    batch_size: int = Field(default=32, ge=1, description="rows decoded together per worker")
    shard_size: int = Field(default=256, ge=1, description="prompts per shard (the unit of resuming)")
    limit: int | None = Field(default=None, ge=1, description="only the first N distinct prompts")
    num_workers: int = Field(default=1, ge=1, description="Ray actors, each with the model loaded")
    cpus_per_worker: int = Field(default=2, ge=1, description="CPUs (torch threads) per actor")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="where actors decode (cuda: one GPU)")
    engine: Engine = Field(default="native", description=ENGINE_HELP)

    @field_validator("output")
    @classmethod
    def _absolute(cls, value: str) -> str:
        return str(Path(value).expanduser().resolve())


def prompt_turns(messages) -> list[dict] | None:
    """The turns a reply is written to: all but a final assistant turn; None if that is not a prompt."""
    if not isinstance(messages, list) or not messages:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
        return None
    turns = messages[:-1] if messages[-1].get("role") == "assistant" else messages
    return [{"role": m["role"], "content": m["content"]} for m in turns] if turns else None


def collect_prompts(config: DistillConfig) -> tuple[list[dict], dict[str, int]]:
    """Distinct prompts of every source in order, each `{messages, source}`, and the rows skipped."""
    seen, prompts, skipped = set(), [], {}
    sources = data.load_each(
        config.prompts, "prompts", lambda source: data.load_chats(source, config.split, config.tasks_count)
    )
    for source, rows in zip(config.prompts, sources, strict=True):
        for messages in rows["messages"]:
            turns = prompt_turns(messages)
            key = json.dumps(turns)
            if turns is None or key in seen:
                skipped[source] = skipped.get(source, 0) + 1
                continue
            seen.add(key)
            prompts.append({"messages": turns, "source": source})
    return prompts[: config.limit], skipped


class Distiller:
    """One model, decoding shards of prompts greedily (tau = 1: exactly `generate(do_sample=False)`)."""

    def __init__(self, config: DistillConfig) -> None:
        import torch

        torch.set_num_threads(config.cpus_per_worker)
        self.model = self.vllm = None
        if config.engine == "vllm":  # vLLM holds the weights: load only what the decode config reads
            from mars_ray.vllm.offline import VllmDecoder

            checkpoint, self.tokenizer = models.load_card(config.model)
            self.vllm = VllmDecoder(models.resolve(config.model), dtype=config.dtype)
        else:
            checkpoint, self.tokenizer = models.load(
                config.model, dtype=torch_dtype(config.dtype), device=config.device
            )
            self.model = checkpoint
        self.decode = DecodeConfig.for_model(
            checkpoint, self.tokenizer, tau=1.0, max_new_tokens=config.max_new_tokens
        )
        self.batch_size = config.batch_size

    def shard(self, index: int, rows: list[dict]) -> tuple[int, list[dict]]:
        """Shard `index`: its rows with the model's reply appended to each prompt."""
        tok = self.tokenizer
        prompts = [data.chat_prompt_ids(tok, r["messages"]) for r in rows]
        if self.vllm is not None:
            results = dict(enumerate(self.vllm.decode(prompts, self.decode)))
        else:
            results = dict(
                decode_continuous(
                    self.model, prompts, tok.mask_token_id, self.decode, tok.pad_token_id, self.batch_size
                )
            )
        out = []
        for i, row in enumerate(rows):
            result = results[i]
            text = tok.decode(result.tokens, skip_special_tokens=True).strip()
            reply = {"role": "assistant", "content": text}
            out.append(
                {
                    "messages": row["messages"] + [reply],
                    "complete": result.finish_reason == "stop",
                    "completion_tokens": len(result.tokens),
                    "source": row["source"],
                }
            )
        return index, out


def _shard_path(output: Path, index: int) -> Path:
    return output / f"shard-{index:05d}.jsonl"


def distill(config: DistillConfig) -> Path:
    """Write every shard not yet written; return the dataset folder."""
    output = Path(config.output)
    prompts, skipped = collect_prompts(config)
    if not prompts:
        raise ConfigError("prompts", f"no usable prompts in {config.prompts}")
    # a folder is resumed only under the config it was started with: its shards depend on it
    folders.check_rerun(
        output / RECORD, config.model_dump(), lambda saved: RESUMABLE_CHANGES, "output", "config"
    )
    shards = [prompts[i : i + config.shard_size] for i in range(0, len(prompts), config.shard_size)]
    todo = [i for i in range(len(shards)) if not _shard_path(output, i).exists()]
    print(
        f"{len(prompts)} prompts in {len(shards)} shards; {len(shards) - len(todo)} already written"
        + (f"; skipped (duplicate or not a prompt): {skipped}" if skipped else "")
    )
    began = time.perf_counter()
    if todo:
        import ray  # here, not at the top: `Distiller` alone runs where Ray is not installed

        if not ray.is_initialized():
            ray.init()
        gpus = 1 if config.device == "cuda" else 0
        worker = ray.remote(num_cpus=config.cpus_per_worker, num_gpus=gpus)(Distiller)
        pool = ray.util.ActorPool([worker.remote(config) for _ in range(min(config.num_workers, len(todo)))])
        jobs = pool.map_unordered(lambda actor, i: actor.shard.remote(i, shards[i]), todo)
        bar = tqdm(total=sum(len(shards[i]) for i in todo), unit="prompt", desc="distill")
        for index, rows in jobs:
            folders.write_file(_shard_path(output, index), "".join(json.dumps(row) + "\n" for row in rows))
            bar.update(len(rows))
        bar.close()
    _write_summary(config, output, len(shards), time.perf_counter() - began)
    return output


def _write_summary(config: DistillConfig, output: Path, shards: int, seconds: float) -> None:
    rows = [json.loads(line) for i in range(shards) for line in _shard_path(output, i).open()]
    summary = {
        "rows": len(rows),
        "complete": sum(r["complete"] for r in rows),
        "completion_tokens": sum(r["completion_tokens"] for r in rows),
        "seconds_this_run": round(seconds, 1),
    }
    folders.write_file(
        output / RECORD, yaml.safe_dump({"config": config.model_dump(), "summary": summary}, sort_keys=False)
    )
    print(f"{output}: {summary}")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "distill", help="write a model's own greedy replies to chat prompts, as a dataset"
    )
    cli_args.add_config_arguments(parser, DistillConfig)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    distill(cli_args.config_from_args(DistillConfig, args))
