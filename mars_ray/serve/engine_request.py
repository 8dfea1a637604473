"""What the native engine keeps per request: its decode state, text stream and outbox (`EngineRequest`), and
what one forward gave its row (`RowOutput`). The engine's loop moves these; each turns itself into chunks."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeState, TokenLogprob
from mars_ray.serve.rules import point_for
from mars_ray.serve.text import TextStream
from mars_ray.serve.types import Chunk, Logprob, SamplingParams


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


class EngineRequest:
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
        mode = config.mode
        logprobs = None
        if config.logprobs is not None:
            # Only ever appended to (by the decode thread), so the entries up to `completion` are settled.
            logprobs = [
                named_logprob(lp, tokenizer) for lp in s.logprobs[self.sent : max(self.sent, completion)]
            ]
        self.sent += len(tokens)
        return Chunk(
            text, len(s.prompt), completion, forward_passes, reason, tokens, config.tau, mode, logprobs
        )

    async def replies(self, interval: float) -> AsyncIterator[Chunk]:
        """The outbox as chunks, up to the one with a `finish_reason` (or the error put there). A slow reader
        gets what piled up as one chunk; with `interval`, after the first text, the chunks of that interval
        go out as one."""
        sent_text = False
        while True:
            item, failure = await self.outbox.get(), None
            if interval and sent_text and isinstance(item, Chunk) and not item.finish_reason:
                await asyncio.sleep(interval)  # what the next forwards add goes out with it, as one
            while isinstance(item, Chunk) and not self.outbox.empty():
                later = self.outbox.get_nowait()
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

    def take(self, output: RowOutput) -> str:
        """A forward's tokens for this request: the text they add; `finish_reason` set where they end it."""
        self.unsent += output.tokens
        text = self.text.push(output.tokens)
        if self.text.stopped:
            self.finish_reason = "stop"
        elif output.finish_reason is not None:
            self.finish_reason = output.finish_reason
            text += self.text.finish()
        return text

    def follow(self, tau: float, verify: bool, block_size: int) -> None:
        """Move what the request left unset to the replica's operating point, from its next forward."""
        config = self.state.config
        tau, verify, block_size = point_for(self.params, tau, verify, block_size)
        if (config.tau, config.block_size, config.verify) != (tau, block_size, verify):
            self.state.reconfigure(dataclasses.replace(config, tau=tau, block_size=block_size, verify=verify))


def named_logprob(logprob: TokenLogprob, tokenizer: PreTrainedTokenizerBase) -> Logprob:
    """Token ids as the text each one decodes to, as OpenAI reports them."""
    top = tuple((tokenizer.decode([token]), value) for token, value in logprob.top)
    return Logprob(tokenizer.decode([logprob.token]), logprob.logprob, top)
