"""The replica's engine: continuous multi-token batching around `SlidingDecoder`, streamed per request.

Requests wait in a queue. The forwards run in a worker thread, pipelined as vLLM's async scheduling is:
once forward N is back, the engine drops cancelled and stopped rows, admits waiting requests up to
`max_batch_size` rows (a new row's prompt is prefilled within the budget of the next forwards), moves the
requests that follow the replica's operating point (tau, window) to its current value, and starts forward
N+1; only then do forward N's tokens become text and go out. So detokenizing, stop strings and streaming
run on the event loop while the next forward runs, never between two forwards. A row that a stop string
ends at forward N is computed once more and that forward's tokens are dropped.
No Ray here: the Serve deployment (`app.py`) wraps it and exports `EngineMetrics`.
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
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from mars_ray import models
from mars_ray.core.compile import compile_steps
from mars_ray.core.decoding import (
    DecodeConfig,
    DecodeState,
    SlidingDecoder,
    TokenLogprob,
)
from mars_ray.core.prepack import can_prepack, prepack_linears
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.point import Operable
from mars_ray.serve.rules import RequestRules, point_for
from mars_ray.serve.stats import EngineStats, StatsRecorder
from mars_ray.serve.text import TextStream
from mars_ray.serve.types import Chunk, Logprob, SamplingParams

logger = logging.getLogger(__name__)


class EngineMetrics:
    """Where the engine reports what it does; the Serve deployment exports these (no-ops here).

    Shaped like vLLM's metric families, so that its dashboards' queries carry over: per row and forward,
    `drafted` is how many proposals the forward offered that row (a lossy row: its window's W-1 mask
    slots; a verified row: the drafts it checked; 0 at one token per forward) and `accepted` how many
    tokens it took (at most drafted + 1), as vLLM's speculative-decoding counters count them.
    """

    def step(self, accepted: Sequence[int], drafted: Sequence[int]) -> None:
        """One forward: per row, the tokens it accepted and the proposals it was offered."""

    def admitted(self, queued_seconds: float, prompt_tokens: int) -> None:
        """A request got its row after waiting this long."""

    def first_token(self, seconds: float) -> None:
        """Time from a request's arrival to its first accepted token."""

    def inter_token(self, seconds: float) -> None:
        """Time per token between two of a request's forwards."""

    def finished(self, reason: str, seconds: float) -> None:
        """A request ended (stop, length, cancelled or error) this long after it arrived."""

    def load(self, waiting: int, running: int) -> None:
        """Requests waiting for a row, and rows in the batch."""

    def tau(self, tau: float) -> None:
        """The operating tau changed."""


@dataclass(frozen=True)
class RowOutput:
    """What one forward gave one row, read in the decode thread as the forward ended: the event loop turns
    it into text while the next forward already changes the row's `DecodeState`."""

    state: DecodeState
    tokens: list[int]  # accepted by this forward
    completion_tokens: int  # the row's tokens so far, these included
    forward_passes: int
    finish_reason: str | None  # "stop" (a stop token) or "length"; None while it goes on
    config: DecodeConfig  # the operating point this forward ran at
    drafted: int  # proposals this forward offered the row (see `EngineMetrics.step`)

    @classmethod
    def of(cls, state: DecodeState, tokens: list[int]) -> RowOutput:
        config = state.config
        drafted = state.drafted[-1] if config.verify else config.window - 1
        return cls(
            state, tokens, len(state.tokens), state.forward_passes, state.finish_reason, config, drafted
        )


class _Request:
    """One request inside the engine: its decode state, its text stream and its outbox."""

    def __init__(self, state: DecodeState, text: TextStream, params: SamplingParams) -> None:
        self.state, self.text, self.params = state, text, params
        self.outbox: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self.arrived = time.monotonic()
        self.last_tokens_at: float | None = None
        self.finish_reason: str | None = None  # stop, length, cancelled or error
        self.unsent: list[int] = []  # decoded tokens not yet in a chunk (their text may be held back)
        self.sent = 0  # tokens already in a chunk

    def chunk(self, text: str, tokenizer: PreTrainedTokenizerBase, output: RowOutput | None = None) -> Chunk:
        """The next chunk: `text` and the tokens decoded since the last chunk, as of `output` (None: before
        the first forward)."""
        s = self.state
        reason = self.finish_reason if self.finish_reason in ("stop", "length") else None
        tokens, self.unsent = self.unsent, []
        config = s.config if output is None else output.config
        # Tokens accepted in the same forward past a stop string were decoded but are not the completion.
        completion = 0 if output is None else output.completion_tokens
        if self.text.stopped:
            completion = self.text.stop_tokens
        forward_passes = 0 if output is None else output.forward_passes
        mode = "ar" if config.window == 1 else "verify" if config.verify else "mars"
        logprobs = None
        if config.logprobs is not None:
            # Only ever appended to (by the decode thread), so the entries up to `completion` are settled.
            logprobs = [_named(lp, tokenizer) for lp in s.logprobs[self.sent : max(self.sent, completion)]]
        self.sent += len(tokens)
        return Chunk(
            text, len(s.prompt), completion, forward_passes, reason, tokens, config.tau, mode, logprobs
        )


def _named(logprob: TokenLogprob, tokenizer: PreTrainedTokenizerBase) -> Logprob:
    """Token ids as the text each one decodes to, as OpenAI reports them."""
    top = tuple((tokenizer.decode([token]), value) for token, value in logprob.top)
    return Logprob(tokenizer.decode([logprob.token]), logprob.logprob, top)


def _decode_thread() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="mars-decode")


def _load_model(config: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    torch.set_num_threads(config.torch_threads or max(1, int(config.num_cpus)))
    dtype = None if config.dtype == "auto" else getattr(torch, config.dtype)
    return models.load(config.model, dtype=dtype, device=config.device)


class Engine(Operable):
    """Continuous batching of MARS decoding for one model; `generate` streams `Chunk`s per request."""

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
        decode = DecodeConfig.for_model(model, tokenizer, config.block_size, allow_wider=True)
        vocab_size = model.get_input_embeddings().num_embeddings
        self.rules = RequestRules.of(config, model.config, decode, vocab_size)
        self.decode, self.vocab_size = decode, vocab_size
        self.max_context, self.max_block_size = self.rules.max_context, self.rules.max_block_size
        self._own_executor = executor is None
        self._executor = executor or _decode_thread()
        if config.compile:
            compile_steps(model)
        elif config.prepack_weights and can_prepack(model):  # inductor cannot lower packed weights
            self._executor.submit(prepack_linears, model).result()  # where the forwards will run
        self.decoder = self._new_decoder()
        self._start_at(config.tau, config.verify, self.decode.block_size)
        self._waiting: deque[_Request] = deque()
        self._running: dict[int, _Request] = {}  # by id() of the decode state
        self._cancelled: list[_Request] = []
        self._stopped: list[DecodeState] = []  # rows a stop string ended, still in the decoder
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._recorder = StatsRecorder(config.stats_window_s)

    @classmethod
    def load(cls, config: ModelConfig, metrics: EngineMetrics | None = None) -> Engine:
        """Load the model through the same loader as training, with the replica's thread count, in the
        thread that will run its forwards: a thread that is not the first to run torch's parallel work
        pays for oneDNN's small bf16 products (packed weights: 0.67x there, BENCHMARKS.md)."""
        decode_thread = _decode_thread()
        model, tokenizer = decode_thread.submit(_load_model, config).result()
        engine = cls(model, tokenizer, config, metrics, decode_thread)
        engine._own_executor = True  # made for this engine: it shuts down with it
        return engine

    def _new_decoder(self) -> SlidingDecoder:
        tokenizer = self.tokenizer
        return SlidingDecoder(
            self.model, tokenizer.mask_token_id, tokenizer.pad_token_id, self.config.max_prefill_tokens
        )

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
        interval, sent_text = self.config.stream_interval_s, False
        try:
            yield request.chunk("", self.tokenizer)
            while True:
                item, failure = await request.outbox.get(), None
                if interval and sent_text and isinstance(item, Chunk) and not item.finish_reason:
                    await asyncio.sleep(interval)  # what the next forwards add goes out with it, as one
                while isinstance(item, Chunk) and not request.outbox.empty():
                    later = request.outbox.get_nowait()  # a slow reader gets what piled up as one chunk
                    if isinstance(later, BaseException):
                        failure = later  # after the text merged so far, which is not lost
                        break
                    item = item.then(later)
                if isinstance(item, BaseException):
                    raise item
                yield item
                sent_text = True
                if failure is not None:
                    raise failure
                if item.finish_reason:
                    return
        finally:
            if request.finish_reason is None:
                request.finish_reason = "cancelled"
                self._cancelled.append(request)
                self._wake.set()

    def check_token_ids(self, tokens: Sequence[int], field: str) -> None:
        self.rules.check_token_ids(tokens, field)

    def check_prompt(self, prompt: Sequence[int], field: str) -> int:
        return self.rules.check_prompt(prompt, field)

    def _new_request(self, prompt: list[int], params: SamplingParams, prompt_field: str) -> _Request:
        tau, verify, block_size = self._tau, self._verify, self._block_size
        config = self.rules.decode_config(prompt, params, prompt_field, tau, verify, block_size)
        text = TextStream(self.tokenizer, params.stop, params.include_stop_str_in_output)
        return _Request(DecodeState(prompt, config), text, params)

    async def prompt_logprobs(self, prompt: Sequence[int], k: int) -> list[Logprob]:
        """Each prompt token's log-probability given the tokens before it, and its k likeliest alternatives
        (for `echo`): one plain forward over the prompt on the decode thread, between two steps. The first
        token has none."""
        self.check_prompt(prompt, "prompt")  # before the forward: out of the vocabulary or the context

        def forward() -> list[TokenLogprob]:
            with torch.inference_mode():
                ids = torch.tensor([list(prompt)], device=self.model.device)
                logits = self.model(input_ids=ids).logits[0, :-1]
            state = DecodeState(list(prompt), dataclasses.replace(self.decode, logprobs=k))
            state.record_logprobs(list(prompt[1:]), logits, self.tokenizer.mask_token_id)
            return state.logprobs

        recorded = await asyncio.get_running_loop().run_in_executor(self._executor, forward)
        first = Logprob(self.tokenizer.decode([prompt[0]]), None)
        return [first] + [_named(lp, self.tokenizer) for lp in recorded]

    async def warm_up(self) -> None:
        """A short request through the whole path, a MARS window included, before reporting ready. With
        compiled steps, every kind of step a compiled forward tells apart runs here (one row and more, a
        window of one and more), so each compiles now and never in the middle of a request."""
        prompt = self.tokenizer("Hello, how are you?")["input_ids"] or [self.tokenizer.eos_token_id]
        kinds = [SamplingParams(max_tokens=8, tau=0.5, block_size=2, ignore_eos=True)]
        if self.config.compile:
            kinds.append(SamplingParams(max_tokens=8, block_size=1, ignore_eos=True))
        for rows in (1, 2) if self.config.compile else (1,):
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
        for request in [*self._waiting, *self._running.values()]:
            if request.finish_reason is None:
                request.finish_reason = "error"
                request.outbox.put_nowait(RuntimeError("the engine shut down"))
                self._end(request)
        self._waiting.clear()
        self._running.clear()
        if self._own_executor:
            self._executor.shutdown(wait=True)

    def stats(self) -> EngineStats:
        """On the event loop only: the samples it reads and trims are appended there (`_deliver`)."""
        return self._recorder.snapshot(
            self._tau,
            self._block_size,
            self._verify,
            len(self._waiting),
            len(self._running),
            self.config.max_batch_size,
        )

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
        # Counts the rows the decoder holds: a request that finished at the last forward is not delivered yet.
        decoder = self.decoder
        while self._waiting and len(decoder.seqs) + len(decoder.joining) < self.config.max_batch_size:
            request = self._waiting.popleft()
            self._running[id(request.state)] = request
            self.decoder.add(request.state)
            self.metrics.admitted(time.monotonic() - request.arrived, len(request.state.prompt))

    def _follow_operating_point(self) -> None:
        for request in self._running.values():
            config = request.state.config
            tau, verify = point_for(request.params, self._tau, self._verify)
            block_size = self._block_size if request.params.block_size is None else request.params.block_size
            if (config.tau, config.block_size, config.verify) != (tau, block_size, verify):
                request.state.reconfigure(
                    dataclasses.replace(config, tau=tau, block_size=block_size, verify=verify)
                )

    def _deliver(self, outputs: list[RowOutput], now: float) -> None:
        """Each row's new tokens become text; finished rows are answered and leave."""
        delivered = []
        for output in outputs:
            request = self._running.get(id(output.state))
            if request is None or request.finish_reason is not None:
                continue  # ended by a stop string a forward ago, or cancelled: nobody reads these tokens
            delivered.append(output)
            tokens = output.tokens
            if request.last_tokens_at is None:
                ttft = now - request.arrived
                self._recorder.first_token(now, ttft)
                self.metrics.first_token(ttft)
            elif tokens:
                itl = (now - request.last_tokens_at) / len(tokens)
                self._recorder.inter_token(now, itl)
                self.metrics.inter_token(itl)
            request.last_tokens_at = now
            request.unsent += tokens
            text = request.text.push(tokens)
            if request.text.stopped:
                request.finish_reason = "stop"
                self._stopped.append(request.state)
            elif output.finish_reason is not None:
                request.finish_reason = output.finish_reason
                text += request.text.finish()
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

    def _end(self, request: _Request) -> None:
        """Count a request that ended (its `finish_reason` set)."""
        self._recorder.ended(request.finish_reason)
        self.metrics.finished(request.finish_reason, time.monotonic() - request.arrived)

    def _fail_running(self, error: Exception) -> None:
        """Answer every batched request with the error and start from an empty cache."""
        for request in self._running.values():
            if request.finish_reason is None:
                request.finish_reason = "error"
                request.outbox.put_nowait(RuntimeError(f"decoding failed: {error}"))
                self._end(request)
        self._running.clear()
        self._stopped.clear()
        self.decoder = self._new_decoder()
