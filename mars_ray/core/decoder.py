"""The production decoder: continuous multi-token decoding over a sliding KV cache.

Every decoder runs the same step. Feed the committed context plus mask tokens; slot 0 of the window is the
ordinary next-token prediction (logits at the last real token), slot j the prediction read at mask j-1
(right shift). Propose the greedy (or sampled) token of each slot, always accept slot 0, then accept the
longest prefix whose confidence (fp32 softmax probability) is >= tau. tau = 1 accepts exactly one token,
which is greedy autoregressive decoding of the same weights.

`SlidingDecoder` / `decode_cached` / `decode_continuous` keep a KV cache that never holds a mask's keys and
values; each step feeds `[tokens accepted last step | masks]` and crops the masks. Rows of a batch advance
independently over a ragged cache with holes, join at any step (by the `Admission` rule) and leave at once:
the serving engine is built on it. With `verify`, the same step is lossless: proposals are checked, not
output. The reference decoders that tests and benchmarks compare it with are in `reference.py`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from mars_ray.core.admission import Admission
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeResult, DecodeState, accept_length
from mars_ray.core.kv_cache import RaggedCache, right_align
from mars_ray.core.sampling import propose


class SlidingDecoder:
    """Continuous multi-token decoding: every row accepts >= 1 token at every forward.

    A step runs named stages: join (cache the prompts of rows that were added, then let them into the
    batch), propose (one forward of every row's `[uncached tokens | drafts | W-1 masks]`, right-aligned with
    holes on the left, so the masks are always the last W-1 columns and one crop removes them from every
    row: no mask KV is ever kept), accept (per row, by tau or, for a verifying row, by agreement with the
    greedy predictions), advance (what the next forward feeds; finished rows leave). The uncached tokens are
    last step's accepted ones, or a joining row's last prompt token; drafts are a verifying row's carried
    proposals. W is the widest window in the batch; a row at tau >= 1 only reads slot 0.

    Rows join by the `Admission` rule (`max_rows`, `prefill_budget`): a caller adds as many as `admits`
    allows. Rows that join while others run wait outside the batch while their prompts (all but the last
    token) are cached in a side cache, at most `prefill_budget` tokens a step (oldest first), so the running
    rows' forwards stay one window wide and a long prompt delays each of their steps by at most one
    budget's worth of prefill. Rows added to an idle decoder join at once: nobody waits.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        mask_id: int,
        pad_id: int = 0,
        prefill_budget: int | None = None,
        max_rows: int | None = None,
    ) -> None:
        self.model, self.mask_id, self.pad_id = model, mask_id, pad_id
        self.admission = Admission(max_rows, prefill_budget)
        self.cache = RaggedCache(model)
        self.seqs: list[DecodeState] = []  # the batch
        self.uncached: list[list[int]] = []  # per row: its tokens not yet in the cache
        self.joining: list[DecodeState] = []  # added, prompts being cached; not yet in the batch
        self.unprefilled: list[list[int]] = []  # per joining row: its tokens not yet in the side cache
        # The joining rows' keys and values so far; prefill chunks run eager (compute-bound already).
        self.side = RaggedCache(model, compiled=False)

    @property
    def active(self) -> bool:
        """Rows in the batch or joining it."""
        return bool(self.seqs or self.joining)

    def admits(self, waiting: int) -> int:
        """How many of `waiting` rows may be added now (the `Admission` rule, over the rows held)."""
        return self.admission.joining(len(self.seqs) + len(self.joining), waiting)

    @torch.inference_mode()
    def add(self, seq: DecodeState) -> None:
        """Join the batch once its prompt is cached (at once when the decoder is idle)."""
        self.joining.append(seq)
        self.unprefilled.append(list(seq.prompt) + seq.tokens)
        self.side.add_rows(1)

    @torch.inference_mode()
    def remove(self, seqs: Sequence[DecodeState]) -> None:
        """Leave now, freeing their cache rows (in the batch or still joining)."""
        gone = {id(s) for s in seqs}
        keep = [i for i, s in enumerate(self.seqs) if id(s) not in gone]
        if len(keep) < len(self.seqs):
            self.seqs = [self.seqs[i] for i in keep]
            self.uncached = [self.uncached[i] for i in keep]
            self.cache.keep_rows(keep)
        keep = [i for i, s in enumerate(self.joining) if id(s) not in gone]
        if len(keep) < len(self.joining):
            self.joining = [self.joining[i] for i in keep]
            self.unprefilled = [self.unprefilled[i] for i in keep]
            self.side.keep_rows(keep)

    @torch.inference_mode()
    def step(self) -> list[tuple[DecodeState, list[int]]]:
        """One decode forward for every row of the batch; returns each of those rows with its newly
        accepted tokens (finished rows then leave). Joining rows are prefilled first, within the budget."""
        self._join()
        if not self.seqs:
            return []
        tokens, confidence, anchor, logits, windows = self._propose()
        accepted = self._accept(tokens, confidence, anchor, logits, windows)
        stepped = list(zip(self.seqs, accepted, strict=True))
        self._advance(accepted)
        return stepped

    def _join(self) -> None:
        """Cache the next chunk of the joining rows' prompts (`Admission.prefill_chunks`); rows with
        nothing left to cache join the batch. Into an idle decoder every joining row joins at
        once, and the decode forward caches the rest of its prompt itself."""
        if not self.joining:
            return
        if self.seqs:
            sizes = self.admission.prefill_chunks([len(pending) for pending in self.unprefilled])
            chunks = [pending[:size] for pending, size in zip(self.unprefilled, sizes, strict=True)]
            if any(chunks):
                ids, real = right_align(chunks, self.pad_id)
                self.side.forward(ids.to(self.side.device), real.to(self.side.device), ids.shape[1], 1)
                self.unprefilled = [p[len(c) :] for p, c in zip(self.unprefilled, chunks, strict=True)]
            ready = [r for r, pending in enumerate(self.unprefilled) if len(pending) <= 1]
        else:
            ready = list(range(len(self.joining)))
        if not ready:
            return
        self.cache.add_rows(len(ready))
        self.cache.take_rows(range(len(self.seqs), len(self.seqs) + len(ready)), self.side.split_rows(ready))
        self.seqs += [self.joining[r] for r in ready]
        self.uncached += [self.unprefilled[r] for r in ready]
        waiting = [r for r in range(len(self.joining)) if r not in set(ready)]
        self.joining = [self.joining[r] for r in waiting]
        self.unprefilled = [self.unprefilled[r] for r in waiting]

    def _propose(self) -> tuple[list[list[int]], list[list[float]], int, torch.Tensor, list[int]]:
        """Forward every row's `[uncached | drafts | masks]`, right-aligned: the greedy token and the
        confidence at each of the last columns, the column of every row's last real token (its slot 0; its
        drafts' predictions come just before, its masks' slots just after), the logits read there, and
        each row's window (`DecodeState.window`). Masks past a row's own window are holes: a row near the
        end of its budget never takes a position past it, whatever its neighbours' windows."""
        windows = [s.window for s in self.seqs]
        window = max(windows)
        masks = [self.mask_id] * (window - 1)
        rows = [u + s.drafts + masks for u, s in zip(self.uncached, self.seqs, strict=True)]
        ids, real = right_align(rows, self.pad_id)
        for row, own in enumerate(windows):
            real[row, ids.shape[1] - (window - own) :] = False
        keep = ids.shape[1] - (window - 1)  # the masks' keys and values are dropped
        anchor = max(len(s.drafts) for s in self.seqs)
        device = self.cache.device
        logits = self.cache.forward(ids.to(device), real.to(device), keep, anchor + window)
        first_slot = [anchor] * len(self.seqs)
        tokens, confidence, read = propose(logits, self.seqs, first_slot, self.mask_id, windows)
        return tokens, confidence, anchor, read, windows

    def _accept(
        self,
        tokens: list[list[int]],
        confidence: list[list[float]],
        anchor: int,
        logits: torch.Tensor,
        windows: list[int],
    ) -> list[list[int]]:
        """Each row commits its tokens: the window prefix its tau accepts, or (verify) the longest run of
        drafts that greedy decoding agrees with plus the greedy token after it. Rejected drafts become
        holes in the cache; a verifying row whose drafts all held carries its masks' confident proposals."""
        accepted, rejected = [], []
        for row, (seq, width) in enumerate(zip(self.seqs, windows, strict=True)):
            seq.forward_passes += 1
            window = slice(anchor, anchor + width)
            if not seq.config.verify:
                accepted.append(seq.take(tokens[row][window], confidence[row][window]))
                seq.record_logprobs(accepted[-1], logits[row, window], self.mask_id)
                rejected.append(0)
                continue
            drafts = seq.drafts
            checked = slice(anchor - len(drafts), anchor + 1)  # after the last token and each draft
            greedy = tokens[row][checked]
            held = next(
                (i for i, (d, g) in enumerate(zip(drafts, greedy, strict=False)) if d != g), len(drafts)
            )
            accepted.append(seq.commit(greedy[: held + 1], drafted=len(drafts)))
            seq.record_logprobs(accepted[-1], logits[row, checked], self.mask_id)
            rejected.append(len(drafts) - held)
            seq.drafts = []
            if held == len(drafts) and not seq.finished:
                carry = accept_length(confidence[row][window], seq.config.tau, min(width, seq.room))
                seq.drafts = tokens[row][window][1:carry]
        self.cache.forget_last(rejected)
        return accepted

    def _advance(self, accepted: list[list[int]]) -> None:
        """What the next forward must feed: a row's accepted tokens, less the drafts already cached (a
        verifying row's accepted drafts were fed as real tokens); finished rows leave."""
        self.uncached = [
            list(tokens[-1:] if seq.config.verify else tokens)
            for tokens, seq in zip(accepted, self.seqs, strict=True)
        ]
        finished = [s for s in self.seqs if s.finished]
        if finished:
            self.remove(finished)


def decode_cached(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    mask_id: int,
    config: DecodeConfig | Sequence[DecodeConfig],
    pad_id: int = 0,
) -> list[DecodeResult]:
    """Decode prompts together with the sliding KV cache; at batch 1 this is the single-sequence decoder."""
    configs = [config] * len(prompts) if isinstance(config, DecodeConfig) else list(config)
    seqs = [DecodeState(list(p), c) for p, c in zip(prompts, configs, strict=True)]
    decoder = SlidingDecoder(model, mask_id, pad_id)
    for seq in seqs:
        decoder.add(seq)
    while decoder.active:
        decoder.step()
    return [s.result() for s in seqs]


def decode_continuous(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    mask_id: int,
    config: DecodeConfig,
    pad_id: int = 0,
    max_batch: int = 16,
) -> Iterator[tuple[int, DecodeResult]]:
    """Decode many prompts, at most `max_batch` rows at a time, admitted as the serving engine admits
    requests (`Admission`): a row that finishes leaves, and the next prompt takes its row at the next step.
    Yields `(index, result)` as each prompt finishes."""
    waiting = deque(enumerate(prompts))
    decoder = SlidingDecoder(model, mask_id, pad_id, max_rows=max_batch)
    index_of: dict[int, int] = {}
    while waiting or decoder.active:
        for _ in range(decoder.admits(len(waiting))):
            index, prompt = waiting.popleft()
            seq = DecodeState(list(prompt), config)
            index_of[id(seq)] = index
            decoder.add(seq)
        for seq, _ in decoder.step():
            if seq.finished:
                yield index_of.pop(id(seq)), seq.result()
