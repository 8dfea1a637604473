"""The replica's engine on vLLM: `AsyncLLM` with MARS as its speculative method (`mars_ray.vllm`), behind
the same protocol as the native engine (`protocol.ServingEngine`): `load`, `warm_up`, `generate` streaming
`Chunk`s, `prompt_logprobs`, the operating point (`tau`, `verify`, `block_size`), `stats`, `close`.

Why the project's deployment hosts vLLM instead of Ray Serve LLM's `LLMServer`: the replica keeps what
Ray Serve LLM has no place for, the per-request `tau` / `verify` / `block_size` fields and their checks (a
400 naming the field), the tau controller moving the replica's operating point without a restart (the
worker's proposer holds it, `mars_ray.vllm.worker`, and a request follows it in what it leaves unset, from
its next forward, as on the native engine), `/v1/status`, the replica autoscaling policy and the
API key. vLLM itself runs as Ray Serve LLM runs it: `AsyncLLM`, its engine core in a process of its own.
A request's forward passes come from vLLM's per-request speculative metrics (`mars_ray.vllm.passes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence

from transformers import PreTrainedTokenizerBase

from mars_ray import models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.point import Operable
from mars_ray.serve.protocol import EngineMetrics
from mars_ray.serve.rules import RequestRules
from mars_ray.serve.stats import EngineStats, StatsRecorder
from mars_ray.serve.types import Chunk, Logprob, SamplingParams
from mars_ray.vllm.config import cpu_bind, mars_engine_args
from mars_ray.vllm.offline import KV_CACHE_BYTES, sampling_params
from mars_ray.vllm.passes import accepted_per_forward, histogram_of
from mars_ray.vllm.worker import OPERATING_POINT_RPC


def replica_engine_args(config: ModelConfig, path: str, max_context: int) -> dict:
    """vLLM's engine arguments for one replica: its batch, context and cache, compiled graphs unless
    `compile` is false, and what the checkpoint asks (`mars_engine_args`: a gated folder runs eagerly)."""
    return dict(
        max_model_len=max_context,
        max_num_seqs=config.max_batch_size,
        enforce_eager=not config.compiled,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        seed=0,
    ) | mars_engine_args(path, config.dtype)


class VllmEngine(Operable):
    """vLLM's `AsyncLLM` for one model; `generate` streams `Chunk`s per request."""

    tokenizer: PreTrainedTokenizerBase

    def __init__(
        self,
        llm,
        tokenizer: PreTrainedTokenizerBase,
        config: ModelConfig,
        rules: RequestRules,
        metrics: EngineMetrics,
        drafting: bool = False,
    ) -> None:
        """`drafting`: vLLM runs the MARS proposer, whose operating point this engine's moves set."""
        self.llm, self.tokenizer, self.config, self.rules = llm, tokenizer, config, rules
        self.metrics = metrics
        self._drafting = drafting
        self._told: set[asyncio.Task] = set()  # calls telling the worker a new point, not yet answered
        self._told_point: tuple[float, bool, int] | None = None  # the point the worker was last told
        self._start_at(config.tau, config.verify, rules.decode.block_size)
        self._in_flight = 0
        self._recorder = StatsRecorder(config.stats_window_s)

    @classmethod
    def load(cls, config: ModelConfig, metrics: EngineMetrics) -> VllmEngine:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        # vLLM-CPU's own binding keeps a core for its scheduler: on 2 cores it decodes on one. The replica's
        # threads are its cores (an operator's VLLM_CPU_OMP_THREADS_BIND wins); its engine core inherits it.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_bind(config.threads))
        path = models.resolve(config.model)
        checkpoint, tokenizer = models.load_card(path)
        rules = RequestRules.of(
            config,
            checkpoint.config,
            # `for_model` reads only the checkpoint's config and generation config: no weights loaded here.
            DecodeConfig.for_model(checkpoint, tokenizer, config.block_size, allow_wider=True),
            int(checkpoint.config.vocab_size),
        )
        engine = replica_engine_args(config, path, rules.max_context)
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine))
        return cls(llm, tokenizer, config, rules, metrics, drafting="speculative_config" in engine)

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, prompt_field: str = "prompt"
    ) -> AsyncIterator[Chunk]:
        """Stream one request: an empty chunk once it is accepted, then a chunk per output of vLLM's (a
        forward, or several a slow reader missed, as one; with `stream_interval_s`, after the first text,
        what the interval's forwards add, as one), the last with its `finish_reason`. Closing the iterator
        early cancels the request in vLLM."""
        config = self.rules.decode_config(
            prompt, params, prompt_field, self._tau, self._verify, self._block_size
        )
        from vllm.sampling_params import RequestOutputKind

        wanted = sampling_params(
            config,
            own={"tau": params.tau, "verify": params.verify, "block_size": params.block_size},
            output_kind=RequestOutputKind.DELTA,
            stop=list(params.stop) or None,
            include_stop_str_in_output=params.include_stop_str_in_output,
            skip_special_tokens=True,
        )
        mode = config.mode
        request_id, arrived, last = uuid.uuid4().hex, time.monotonic(), None
        completion = forwards = 0
        finish = None
        self._in_flight += 1
        self.metrics.load(*self._load())
        try:
            yield Chunk("", len(prompt), 0, 0, tau=config.tau, mode=mode)
            async for output in self.llm.generate({"prompt_token_ids": list(prompt)}, wanted, request_id):
                piece, now = output.outputs[0], time.monotonic()
                tokens = list(piece.token_ids)
                if tokens:
                    forwards += 1  # at least; the request's own count comes with its last output
                    completion += len(tokens)
                    self._recorder.tokens(now, arrived, last, len(tokens), self.metrics)
                    last = now
                if output.finished:
                    finish = piece.finish_reason if piece.finish_reason in ("stop", "length") else "error"
                    steps = accepted_per_forward(completion, histogram_of(piece.spec_decode_metrics))
                    forwards = len(steps)
                    for accepted in steps:
                        self._recorder.forward(now, [accepted])
                    self.metrics.request_forwards(steps)
                logprobs = self._logprobs(piece, config.logprobs)
                if tokens or finish:
                    text, counted = piece.text, (len(prompt), completion, forwards)
                    yield Chunk(text, *counted, finish, tokens, config.tau, mode, logprobs)
                    if self.config.stream_interval_s and not finish:
                        # vLLM merges the outputs a reader has not taken yet: one message per interval
                        # crosses to the ingress instead of one per forward (Ray Serve LLM batches alike)
                        await asyncio.sleep(self.config.stream_interval_s)
        finally:
            self._in_flight -= 1
            reason = finish or "cancelled"
            if finish is None:
                with contextlib.suppress(Exception):
                    await self.llm.abort(request_id)
            self._recorder.ended(reason)
            self.metrics.finished(reason, time.monotonic() - arrived)
            self.metrics.load(*self._load())

    def _logprobs(self, piece, k: int | None) -> list[Logprob] | None:
        if k is None:
            return None
        pairs = zip(piece.token_ids, piece.logprobs or [], strict=False)
        return [self._named(token, alternatives, k) for token, alternatives in pairs]

    def _named(self, token: int, alternatives: dict, k: int) -> Logprob:
        """vLLM's logprobs of one position (the token's, and the k likeliest by rank) as OpenAI names them."""
        ranked = sorted(alternatives.items(), key=lambda item: item[1].rank)
        top = tuple((self.tokenizer.decode([t]), lp.logprob) for t, lp in ranked if lp.rank <= k)
        return Logprob(self.tokenizer.decode([token]), alternatives[token].logprob, top)

    async def prompt_logprobs(self, prompt: Sequence[int], k: int) -> list[Logprob]:
        """Each prompt token's log-probability given the tokens before it and its k likeliest alternatives
        (for `echo`), from vLLM's `prompt_logprobs`. The first token has none."""
        from vllm import SamplingParams as VllmParams

        self.rules.check_prompt(prompt, "prompt")
        asked = VllmParams(max_tokens=1, temperature=0, prompt_logprobs=k, extra_args={"tau": 1.0})
        final = None
        async for output in self.llm.generate({"prompt_token_ids": list(prompt)}, asked, uuid.uuid4().hex):
            final = output
        pairs = zip(prompt[1:], (final.prompt_logprobs or [])[1:], strict=True)
        first = Logprob(self.tokenizer.decode([prompt[0]]), None)
        return [first] + [self._named(token, alternatives, k) for token, alternatives in pairs]

    async def warm_up(self) -> None:
        """The worker told the operating point, then a short request through the whole path, a MARS window
        included, before reporting ready."""
        if self._drafting:
            await self._tell_point()
        prompt = self.tokenizer("Hello, how are you?")["input_ids"] or [self.tokenizer.eos_token_id]
        params = SamplingParams(max_tokens=8, tau=0.5, block_size=min(2, self.rules.max_block_size))
        async for _ in self.generate(prompt, dataclasses.replace(params, ignore_eos=True)):
            pass

    def _load(self) -> tuple[int, int]:
        """(waiting, running): requests past vLLM's batch wait in its scheduler."""
        running = min(self._in_flight, self.config.max_batch_size)
        return self._in_flight - running, running

    def refresh_gauges(self) -> None:
        self.metrics.tau(self._tau)
        self.metrics.load(*self._load())

    def stats(self) -> EngineStats:
        """On the event loop only. `forwards_per_s` counts each request's forwards (vLLM batches them), as
        its last output reports them."""
        waiting, running = self._load()
        return self._recorder.snapshot(
            self._tau, self._block_size, self._verify, waiting, running, self.config.max_batch_size
        )

    def _moved(self) -> None:
        """Tell the worker's proposer the new point, so running requests that follow it move from their next
        forward (as on the native engine); before the event loop runs, `warm_up` tells it."""
        if not self._drafting:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        told = loop.create_task(self._tell_point())
        self._told.add(told)
        told.add_done_callback(self._told.discard)

    async def _tell_point(self) -> None:
        """The point as it stands when the call goes out (of several quick moves, the last wins; a setter at a
        time would show the worker half a move, a lossy tau before the verified mode). The controller sets the
        point every tick: one the worker already holds is not sent again."""
        point = self._point()
        if point == self._told_point:
            return
        self._told_point = point
        await self.llm.collective_rpc(OPERATING_POINT_RPC, args=point)

    def _point(self) -> tuple[float, bool, int]:
        return self._tau, self._verify, self._block_size

    async def close(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)
