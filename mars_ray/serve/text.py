"""Token ids to streamed text: incremental detokenization and stop strings that may span tokens."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Turns one request's accepted tokens into text deltas whose concatenation is the decoded output.

    Text is held back while it may still change: an incomplete UTF-8 character at the end (the decode ends
    in U+FFFD), or a tail that could be the start of a stop string. A stop string ends the text before it
    (after it, with `include_stop`); nothing past it is ever released. Each push decodes only the tokens
    since the previous push, with the push before that as context (tokenizers that drop a word's leading
    space at a decode's start need it).
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = (), include_stop: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.include_stop = include_stop  # the text ends after the stop string instead of before it
        self.ids: list[int] = []
        self.text = ""  # decoded so far: what may be released, plus what is held back
        self.released = 0  # characters of `text` given out
        self.stopped = False  # a stop string was found
        self.stop_tokens: int | None = (
            None  # once stopped: the tokens up to the one that ends the stop string
        )
        self._settled = 0  # text[:_settled] is ids[:_decoded] decoded; the rest may still change
        self._context = 0  # ids[_context:_decoded]: context for decoding the next tokens
        self._decoded = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add accepted tokens; return the text that is now final."""
        self.ids += token_ids
        self._decode(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended (EOS or budget): release what was held back, unless a stop string ended it."""
        self._decode(final=True)
        return self._release(final=True)

    def _decode(self, final: bool) -> None:
        decode = self.tokenizer.decode
        old = decode(self.ids[self._context : self._decoded], skip_special_tokens=True)
        new = decode(self.ids[self._context :], skip_special_tokens=True)[len(old) :]
        if new.endswith("\ufffd") and not final:
            # A character split across tokens: show the text before it, settle nothing until it is whole.
            self.text = self.text[: self._settled] + new.rstrip("\ufffd")
            return
        self.text = self.text[: self._settled] + new
        self._settled = len(self.text)
        self._context, self._decoded = self._decoded, len(self.ids)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        # Held-back text never contains a stop string's start, so a match begins at `released` or later.
        hits = [
            (i, i + len(s)) for i, s in ((self.text.find(s, self.released), s) for s in self.stop) if i >= 0
        ]
        if hits:
            end, stop_end = min(hits)
            end = stop_end if self.include_stop else end
            self.stopped = True
            self.stop_tokens = self._tokens_through(stop_end)
        elif final:
            end = len(self.text)
        else:
            end = len(self.text) - self._stop_prefix_length()
        out = self.text[self.released : end]
        self.released = max(self.released, end)
        return out

    def _tokens_through(self, characters: int) -> int:
        """The fewest leading tokens whose text reaches `characters` (binary search over prefixes)."""
        low, high = 1, len(self.ids)
        while low < high:
            middle = (low + high) // 2
            if len(self.tokenizer.decode(self.ids[:middle], skip_special_tokens=True)) >= characters:
                high = middle
            else:
                low = middle + 1
        return low

    def _stop_prefix_length(self) -> int:
        """Length of the longest unreleased tail that a stop string starts with."""
        tail = self.text[self.released :]
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(tail)), longest, -1):
                if tail.endswith(stop[:n]):
                    longest = n
                    break
        return longest
