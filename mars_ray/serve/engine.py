"""The replica's engine: continuous multi-token batching around `SlidingDecoder`, streamed per request.

Requests wait in a queue. The forwards run in a worker thread, pipelined as vLLM's async scheduling is:
once forward N is back, the engine drops cancelled and stopped rows, admits waiting requests up to
`max_batch_size` rows (a new row's prompt is prefilled within the budget of the next forwards), moves the
requests that follow the replica's operating point (tau, window) to its current value, and starts forward
N+1; only then do forward N's tokens become text and go out. So detokenizing, stop strings and streaming
run on the event loop while the next forward runs, never between two forwards. A row that a stop string
ends at forward N is computed once more and that forward's tokens are dropped.
No Ray here: the Serve deployment (`replica.py`) drives it through `protocol.ServingEngine` and exports
its `EngineMetrics` (`metrics.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mars_ray import models
from mars_ray.core.compile import compile_steps
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeState, TokenLogprob
from mars_ray.core.decoder import SlidingDecoder
from mars_ray.core.dtypes import torch_dtype
from mars_ray.core.prepack import can_prepack, prepack_linears
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine_request import EngineRequest, RowOutput, named_logprob
from mars_ray.serve.point import Operable
from mars_ray.serve.protocol import EngineMetrics
from mars_ray.serve.rules import RequestRules
from mars_ray.serve.stats import EngineStats, StatsRecorder
from mars_ray.serve.text import TextStream
from mars_ray.serve.types import Chunk, Logprob, SamplingParams

logger = logging.getLogger(__name__)


def _prompt_logprobs(
    model: PreTrainedModel, decode: DecodeConfig, mask_id: int, prompt: list[int], k: int
) -> list[TokenLogprob]:
    """One plain forward over the prompt: each token's log-probability given the tokens before it, and its
    k likeliest alternatives (the first token has none)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt], device=model.device)).logits[0, :-1]
    state = DecodeState(prompt, dataclasses.replace(decode, logprobs=k))
    state.record_logprobs(prompt[1:], logits, mask_id)
    return state.logprobs


def _decode_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mars-decode")


def _load_model(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    torch.set_num_threads(config.threads)
    return models.load(config.model, dtype=torch_dtype(config.dtype), device=config.device)


class Engine(Operable):
    """Continuous batching of MARS decoding for one model; `generate` streams `Chunk`s per request."""

    tokenizer: PreTrainedTokenizerBase

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        config: ModelConfig,
        metrics: EngineMetrics | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        """`executor`: the thread that runs the engine's forwards; by default the engine's own."""
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.metrics = metrics or EngineMetrics()
        # Stops, calibrated temperatures: what every request's config starts from.
        self.decode = DecodeConfig.for_model(model, tokenizer, config.block_size, allow_wider=True)
        vocab_size = model.get_input_embeddings().num_embeddings
        self.rules = RequestRules.of(config, model.config, self.decode, vocab_size)
        self._own_executor = executor is None
        self._executor = executor or _decode_thread()
        if config.compiled:
            compile_steps(model)
        elif config.prepack_weights and can_prepack(model):  # inductor cannot lower packed weights
            self._executor.submit(prepack_linears, model).result()  # where the forwards will run
        self.decoder = self._new_decoder()
        self._start_at(config.tau, config.verify, self.decode.block_size)
        self._waiting: deque[EngineRequest] = deque()
        self._running: dict[int, EngineRequest] = {}  # by id() of the decode state
        self._cancelled: list[EngineRequest] = []
        self._stopped: list[DecodeState] = []  # rows a stop string ended, still in the decoder
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._recorder = StatsRecorder(config.stats_window_s)

    @classmethod
    def load(cls, config: ModelConfig, metrics: EngineMetrics | None = None) -> Engine:
        """Load the model through the same loader as training, with the replica's thread count, in the
        thread that will run its forwards: a thread that is not the first to run torch's parallel work
        runs oneDNN's small bf16 products slower (packed weights most; see BENCHMARKS.md)."""
        decode_thread = _decode_thread()
        model, tokenizer = decode_thread.submit(_load_model, config).result()
        engine = cls(model, tokenizer, config, metrics, decode_thread)
        engine._own_executor = True  # made for this engine: it shuts down with it
        return engine

    def _new_decoder(self) -> SlidingDecoder:
        mask, pad, config = self.tokenizer.mask_token_id, self.tokenizer.pad_token_id, self.config
        return SlidingDecoder(self.model, mask, pad, config.max_prefill_tokens, config.max_batch_size)

    async def generate(
        self, prompt: Sequence[int], params: SamplingParams, prompt_field: str = "prompt"
    ) -> AsyncIterator[Chunk]:
        """Stream one request: first an empty chunk once it is accepted (with its prompt length), then
        a chunk per forward that produced text (with `stream_interval_s`, after the first text, the chunks
        of that interval as one), the last one with its `finish_reason`. Closing the iterator early (a
        client that went away) cancels the request and frees its row."""
        request = self._new_request(list(prompt), params, prompt_field)
        self._waiting.append(request)
        self._start()
        try:
            yield request.chunk("", self.tokenizer)
            async with contextlib.aclosing(request.replies(self.config.stream_interval_s)) as replies:
                async for chunk in replies:
                    yield chunk
        finally:
            if request.finish_reason is None:
                request.finish_reason = "cancelled"
                self._cancelled.append(request)
                self._wake.set()

    def _new_request(self, prompt: list[int], params: SamplingParams, prompt_field: str) -> EngineRequest:
        tau, verify, block_size = self._tau, self._verify, self._block_size
        config = self.rules.decode_config(prompt, params, prompt_field, tau, verify, block_size)
        text = TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output)
        return EngineRequest(DecodeState(prompt, config), text, params)

    async def prompt_logprobs(self, prompt: Sequence[int], k: int) -> list[Logprob]:
        """Each prompt token's log-probability given the tokens before it, and its k likeliest alternatives
        (for `echo`): one plain forward over the prompt on the decode thread, between two steps. The first
        token has none."""
        self.rules.check_prompt(prompt, "prompt")  # before the forward: out of the vocabulary or the context
        forward = (_prompt_logprobs, self.model, self.decode, self.tokenizer.mask_token_id, list(prompt), k)
        recorded = await asyncio.get_running_loop().run_in_executor(self._executor, *forward)
        first = Logprob(self.tokenizer.decode([prompt[0]]), None)
        return [first] + [named_logprob(lp, self.tokenizer) for lp in recorded]

    async def warm_up(self) -> None:
        """A short request through the whole path, a MARS window included, before reporting ready. With
        compiled steps, every kind of step a compiled forward tells apart runs here (one row and more, a
        window of one and more), so each compiles now and never in the middle of a request."""
        prompt = self.tokenizer("Hello, how are you?")["input_ids"] or [self.tokenizer.eos_token_id]
        kinds = [SamplingParams(max_tokens=8, tau=0.5, block_size=2, ignore_eos=True)]
        if self.config.compiled:
            kinds.append(SamplingParams(max_tokens=8, block_size=1, ignore_eos=True))
        for rows in (1, 2) if self.config.compiled else (1,):
            for params in kinds:
                await asyncio.gather(*(self._drain(prompt, params) for _ in range(rows)))

    async def _drain(self, prompt: Sequence[int], params: SamplingParams) -> None:
        async for _ in self.generate(prompt, params):
            pass

    def refresh_gauges(self) -> None:
        """Set the gauges again: an idle engine sets none, and Ray drops a gauge series not refreshed."""
        self.metrics.tau(self._tau)
        self.metrics.load(len(self._waiting), len(self._running))

    async def close(self) -> None:
        """Stop the decode loop and its thread. Every waiting and running request ends at once with an
        error (no reader is left waiting for a chunk that will never come)."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        self._fail([*self._waiting, *self._running.values()], "the engine shut down")
        self._waiting.clear()
        self._running.clear()
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def stats(self) -> EngineStats:
        """On the event loop only: the samples it reads and trims are appended there (`_deliver`)."""
        waiting, running, rows = len(self._waiting), len(self._running), self.config.max_batch_size
        return self._recorder.snapshot(self._tau, self._block_size, self._verify, waiting, running, rows)

    def _start(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        """The decode loop, pipelined: forward N+1 starts before forward N's rows are delivered."""
        loop = asyncio.get_running_loop()
        in_flight: asyncio.Future[list[RowOutput]] | None = None  # the forward in the decode thread
        while True:
            try:
                finished = in_flight
                in_flight = None  # awaited once, even when it fails
                outputs = [] if finished is None else await finished
                ended_at = time.monotonic()
                self._schedule()
                if self.decoder.active:
                    in_flight = loop.run_in_executor(self._executor, self._step)
                self._deliver(outputs, ended_at)
                if in_flight is None:  # idle until a request arrives
                    self._wake.clear()
                    await self._wake.wait()
            except Exception as error:  # a failed step fails the requests in the batch, not the replica
                logger.exception("decode step failed")
                self._fail_running(error)

    def _schedule(self) -> None:
        """Between two forwards: free rows that ended, admit waiting requests, move to the operating point."""
        self._release()
        self._admit()
        self.metrics.load(len(self._waiting), len(self._running))
        self._follow_operating_point()

    def _step(self) -> list[RowOutput]:
        """One forward, in the decode thread; what it gave each row is read before the next one starts."""
        return [RowOutput.of(state, tokens) for state, tokens in self.decoder.step()]

    def _release(self) -> None:
        """Free the rows of cancelled requests and of those a stop string ended."""
        if not self._cancelled and not self._stopped:
            return
        gone = {id(r.state) for r in self._cancelled}
        self._waiting = deque(r for r in self._waiting if id(r.state) not in gone)
        gone.update(id(state) for state in self._stopped)
        leaving = [state for state in [*self.decoder.seqs, *self.decoder.joining] if id(state) in gone]
        if leaving:
            self.decoder.remove(leaving)
        for request in self._cancelled:
            self._running.pop(id(request.state), None)
            self._end(request)
        self._cancelled.clear()
        self._stopped.clear()

    def _admit(self) -> None:
        """Waiting requests take the rows the decoder's `Admission` rule gives them (the rule eval,
        calibrate and distill batch by); it counts the rows the decoder holds, a request that finished at
        the last forward included (not delivered yet)."""
        for _ in range(self.decoder.admits(len(self._waiting))):
            request = self._waiting.popleft()
            self._running[id(request.state)] = request
            self.decoder.add(request.state)
            self.metrics.admitted(time.monotonic() - request.arrived, len(request.state.prompt))

    def _follow_operating_point(self) -> None:
        for request in self._running.values():
            request.follow(self._tau, self._verify, self._block_size)

    def _deliver(self, outputs: list[RowOutput], now: float) -> None:
        """Each row's new tokens become text; finished rows are answered and leave."""
        delivered = []
        for output in outputs:
            request = self._running.get(id(output.state))
            if request is None or request.finish_reason is not None:
                continue  # ended by a stop string a forward ago, or cancelled: nobody reads these tokens
            delivered.append(output)
            count = len(output.tokens)
            self._recorder.tokens(now, request.arrived, request.last_tokens_at, count, self.metrics)
            request.last_tokens_at = now
            text = request.take(output)
            if request.text.stopped:
                self._stopped.append(request.state)
            if text or request.finish_reason:
                request.outbox.put_nowait(request.chunk(text, self.tokenizer, output))
            if request.finish_reason:
                self._running.pop(id(request.state))
                self._end(request)
        if not delivered:  # the step only cached joining prompts, or every row it ran had ended before
            return
        accepted = [len(output.tokens) for output in delivered]
        self._recorder.forward(now, accepted)
        self.metrics.step(accepted, [output.drafted for output in delivered])

    def _end(self, request: EngineRequest) -> None:
        """Count a request that ended (its `finish_reason` set)."""
        self._recorder.ended(request.finish_reason)
        self.metrics.finished(request.finish_reason, time.monotonic() - request.arrived)

    def _fail(self, requests: Sequence[EngineRequest], why: str) -> None:
        """End the requests not ended yet: their readers raise a `RuntimeError` saying `why`."""
        for request in requests:
            if request.finish_reason is None:
                request.finish_reason = "error"
                request.outbox.put_nowait(RuntimeError(why))
                self._end(request)

    def _fail_running(self, error: Exception) -> None:
        """Answer every batched request with the error and start from an empty cache."""
        self._fail(list(self._running.values()), f"decoding failed: {error}")
        self._running.clear()
        self._stopped.clear()
        self.decoder = self._new_decoder()
