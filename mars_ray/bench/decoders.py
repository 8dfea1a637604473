"""The methods `mars-ray bench decode` times: each decodes a batch of prompts into its replies' tokens.

- `ar`: HF `generate` greedy with a KV cache, the AR baseline every ratio is taken against at the same batch
  size (`ar-base`: the same on the base model, which then sets the ratios);
- `ar-sliding`: the engine's own loop at tau = 1, the same greedy AR tokens through MARS's decoder, which
  separates what the loop costs or saves from what multi-token acceptance gains;
- `prompt-lookup`: HF prompt-lookup decoding, the lossless peer;
- `mars-cached`: the MARS sliding cached decoder at the bench's tau (at batch 1 the single-sequence one);
- `mars-verify`: the same, verified: lossless, exactly greedy, tau picks the proposals it checks;
- `mars-block`, `mars-block-fused`: the paper's block-cached decoder over a sweep of cache-block sizes (as
  published, and with the extend pass fused into the next block);
- `engine`: the serving engine's continuous batcher, every prompt at once.

On `engine: vllm`, vLLM decodes the MARS methods of the engine (`ar-sliding` at tau = 1, `mars-cached`
relaxed, `mars-verify`) through `mars_ray.vllm.offline.VllmDecoder`, with the MARS proposer; the HF methods
stay HF's, and the native decoders that have no vLLM counterpart are not offered.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from mars_ray.bench.baseline import hf_greedy_tokens
from mars_ray.bench.measure import ForwardCounter, ReportedForwards
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.prepack import PackedLinear
from mars_ray.core.reference import decode_block_cached
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine import Engine
from mars_ray.serve.types import SamplingParams

if TYPE_CHECKING:
    from mars_ray.bench.decode import BenchConfig
    from mars_ray.vllm.offline import VllmDecoder

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
NATIVE_ONLY = ("mars-block", "mars-block-fused", "engine")  # no vLLM counterpart
VLLM_METHODS = tuple(m for m in METHODS if m not in NATIVE_ONLY)

Rows = list[list[int]]
Counter = ForwardCounter | ReportedForwards


@dataclass(frozen=True)
class Run:
    """One method at one setting: what decodes a batch, and what counts its forwards while it is timed."""

    method: str
    decode: Callable[[Rows], Rows]
    counter: Callable[[], Counter]
    note: str = ""
    tau: float | None = None
    cache_block: int | None = None
    whole: bool = False  # it takes every prompt at once (it batches them itself), not batch by batch
    in_process: bool = True  # its forwards run in this process, so its peak memory is this process's


class VllmRun:
    """One setting on vLLM: decodes a batch through `VllmDecoder` and tallies the forwards vLLM reports."""

    def __init__(self, decoder: VllmDecoder, config: DecodeConfig) -> None:
        self.decoder, self.config = decoder, config
        self.forwards = ReportedForwards()

    def __call__(self, batch: Rows) -> Rows:
        results = self.decoder.decode(batch, self.config)
        self.forwards.add(results)
        return [r.tokens for r in results]

    def counter(self) -> ReportedForwards:
        self.forwards = ReportedForwards()
        return self.forwards


class Decoders:
    """Every method of one bench run, on its models; `runs(batch_size)` lists what is timed at that size."""

    def __init__(
        self,
        config: BenchConfig,
        model: torch.nn.Module,
        tokenizer,
        torch_thread: ThreadPoolExecutor,
        base_model: torch.nn.Module | None = None,
        vllm: VllmDecoder | None = None,
    ) -> None:
        """`torch_thread`: the one thread every forward of the run takes, the engine's included (torch gives
        each thread that computes its own OpenMP team, and a second team on the same cores slows whichever
        method runs after it); the models were loaded there (see `run_bench`)."""
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.base_model, self.vllm = base_model, vllm
        self.decode = DecodeConfig.for_model(
            model,
            tokenizer,
            config.block_size,
            allow_wider=config.allow_wider_window,
            tau=config.tau,
            max_new_tokens=config.max_new_tokens,
        )
        self.torch_thread = torch_thread

    def runs(self, batch_size: int) -> list[Run]:
        wanted, runs = self.config.methods, []
        if self.base_model is not None:
            note = "HF generate on the base model, greedy, KV cache"
            runs.append(self._hf("ar-base", self.base_model, note))
        if "ar" in wanted:
            runs.append(self._hf("ar", self.model, "HF generate, greedy, KV cache"))
        if "ar-sliding" in wanted:
            own = "at tau = 1" if self.vllm else "MARS's sliding decoder at tau = 1"
            runs.append(self._mars("ar-sliding", replace(self.decode, tau=1.0), f"{own}: greedy AR"))
        if "prompt-lookup" in wanted:
            note = "HF supports batch 1 only: rows run one at a time" if batch_size > 1 else ""
            runs.append(self._hf("prompt-lookup", self.model, note, prompt_lookup=True))
        for tau in (self.config.tau, *self.config.taus):
            decode = replace(self.decode, tau=tau)
            if "mars-cached" in wanted:
                native = "sliding cache" if batch_size > 1 else "single sequence"
                note = "relaxed (lossy)" if self.vllm else native
                runs.append(self._mars("mars-cached", decode, note))
            if "mars-verify" in wanted:
                note = "verified: exactly greedy, tau picks drafts"
                runs.append(self._mars("mars-verify", replace(decode, verify=True), note))
            for fuse, name in ((False, "mars-block"), (True, "mars-block-fused")):
                if name in wanted:
                    runs += [self._block(name, decode, block, fuse) for block in self.config.cache_blocks]
            if "engine" in wanted:
                runs.append(self._engine(decode, batch_size))
        if any(isinstance(m, PackedLinear) for m in self.model.modules()):  # every method on it runs them
            on_model = [r.in_process and r.method != "ar-base" for r in runs]
            note = "packed weights"
            runs = [
                replace(r, note=f"{r.note}; {note}" if r.note else note) if o else r
                for r, o in zip(runs, on_model, strict=True)
            ]
        return runs

    def _on_torch_thread(self, fn: Callable[[Rows], Rows]) -> Callable[[Rows], Rows]:
        return lambda batch: self.torch_thread.submit(fn, batch).result()

    def _counted(self, model: torch.nn.Module) -> Callable[[], Counter]:
        return lambda: ForwardCounter(model)

    def _hf(self, method: str, model: torch.nn.Module, note: str, prompt_lookup: bool = False) -> Run:
        decode = self.decode

        def generate(batch: Rows) -> Rows:
            if not prompt_lookup:
                return self._generate(model, batch)
            window = decode.block_size * 2  # HF runs prompt lookup at batch 1 only
            return [row for p in batch for row in self._generate(model, [p], prompt_lookup_num_tokens=window)]

        return Run(method, self._on_torch_thread(generate), self._counted(model), note)

    def _generate(self, model: torch.nn.Module, batch: Rows, **extra) -> Rows:
        stops, pad_id = self.decode.stop_token_ids, self.tokenizer.pad_token_id
        return hf_greedy_tokens(model, batch, self.config.max_new_tokens, stops, pad_id, **extra)

    def _mars(self, method: str, decode: DecodeConfig, note: str) -> Run:
        """A MARS decoder of the engine: MARS's sliding cached decoder, or vLLM with the MARS proposer."""
        if self.vllm is not None:
            run = VllmRun(self.vllm, decode)
            return Run(method, run, run.counter, f"vLLM + MARS, {note}", decode.tau, in_process=False)
        mask_id, pad_id = self.tokenizer.mask_token_id, self.tokenizer.pad_token_id

        def sliding(batch: Rows) -> Rows:
            return [r.tokens for r in decode_cached(self.model, batch, mask_id, decode, pad_id)]

        return Run(method, self._on_torch_thread(sliding), self._counted(self.model), note, decode.tau)

    def _block(self, method: str, decode: DecodeConfig, cache_block: int, fuse: bool) -> Run:
        mask_id, pad_id = self.tokenizer.mask_token_id, self.tokenizer.pad_token_id

        def block(batch: Rows) -> Rows:
            results = decode_block_cached(
                self.model, batch, mask_id, decode, cache_block, pad_id, fuse_extend=fuse
            )
            return [r.tokens for r in results]

        decoder = self._on_torch_thread(block)
        return Run(method, decoder, self._counted(self.model), "", decode.tau, cache_block)

    def _engine(self, decode: DecodeConfig, batch_size: int) -> Run:
        """The serving engine in this process: the prompts arrive at once, at most `batch_size` run
        together, and a waiting one takes a finished one's row at the next forward."""
        serving = ModelConfig(
            model=self.config.model,
            tau=decode.tau,
            block_size=decode.block_size,
            max_block_size=decode.block_size,
            max_batch_size=batch_size,
            max_ongoing_requests=max(batch_size, 64),
            prepack_weights=False,  # it shares the other methods' model: packing it would change theirs
        )
        params = SamplingParams(max_tokens=self.config.max_new_tokens)

        async def one(engine: Engine, prompt: list[int]) -> list[int]:
            tokens = []
            async for chunk in engine.generate(prompt, params):
                tokens += chunk.token_ids
                if chunk.finish_reason:
                    return tokens
            raise RuntimeError("the engine ended a request without a finish reason")

        async def run(prompts: Rows) -> Rows:
            engine = Engine(self.model, self.tokenizer, serving, executor=self.torch_thread)
            try:
                return list(await asyncio.gather(*(one(engine, p) for p in prompts)))
            finally:
                await engine.close()

        def batcher(prompts: Rows) -> Rows:
            return asyncio.run(run(prompts))  # its event loop here, its forwards on the torch thread

        note = f"continuous batching: all prompts at once, {batch_size} at a time"
        return Run("engine", batcher, self._counted(self.model), note, decode.tau, whole=True)
