"""Multi-token decoding for MARS models: one acceptance rule, three decoders.

Every decoder runs the same step. Feed the committed context plus mask tokens; slot 0 of the window is the
ordinary next-token prediction (logits at the last real token), slot j the prediction read at mask j-1
(right shift). Propose the greedy (or sampled) token of each slot, always accept slot 0, then accept the
longest prefix whose confidence (fp32 softmax probability) is >= tau. tau >= 1 accepts exactly one token,
which is greedy autoregressive decoding of the same weights.

- `decode_reference`: no cache, recomputes everything; the ground truth (the paper's `MARSSampler`).
- `SlidingDecoder` / `decode_cached` / `decode_continuous`: a KV cache that never keeps a mask's keys and
  values; each step feeds `[tokens accepted last step | masks]` and crops the masks. Rows of a batch
  advance independently over a ragged cache with holes, join at any step and leave at once: the serving
  engine is built on it. With `verify`, the same step is lossless: proposals are checked, not output.
- `decode_block_cached`: the paper's block-level cache for left-padded batches (Table 5).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from mars_ray.core.compile import step_forward
from mars_ray.core.errors import ConfigError

TRAINED_BLOCK_SIZE = "mars_block_size"  # the model config key where training records its B
SLOT_TEMPERATURES = "mars_slot_temperatures"  # where calibration records a temperature per window slot
DEFAULT_BLOCK_SIZE = 4  # the paper's B, for a model that does not record its own
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class DecodeConfig:
    """How one sequence is decoded. `block_size` is the window W of slots per forward (the training B).

    `slot_temperatures[j]` divides slot j's logits before its confidence is read (greedy tokens do not
    change): calibration fits them so that a confidence of c means the token agrees with greedy decoding
    about c of the time. Empty: raw probabilities. Build one for a model with `for_model`.

    `verify`: lossless. The masks' proposals are not output but carried, as real tokens, into the next
    forward, which checks them against its own greedy predictions: the output is exactly greedy decoding
    at any tau, and tau only decides which proposals are worth carrying (tau >= 1 carries none: plain AR).
    Greedy only: the speculative-sampling rule for temperature > 0 is not built, so it is refused.

    `logprobs` (k): every committed token records its log-probability and the k likeliest alternatives,
    read from the fp32 logits of the slot that produced it, before any temperature. A token from slot 0
    and a verified token are the model's own next-token (AR) log-probabilities; a token accepted from a
    mask slot carries that mask's prediction, the probability tau was compared with (uncalibrated).
    """

    tau: float = 1.0
    block_size: int = DEFAULT_BLOCK_SIZE
    max_new_tokens: int = 256
    max_accept: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    slot_temperatures: tuple[float, ...] = ()
    verify: bool = False
    vocab_limit: int | None = None  # ids at or past it (padded embedding rows) are never proposed
    logprobs: int | None = None  # record each token's log-probability and this many alternatives
    min_tokens: int = 0  # stop tokens are never proposed before this many tokens (as min_new_tokens)

    @classmethod
    def for_model(
        cls,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        block_size: int | None = None,
        allow_wider: bool = False,
        calibrated: bool = True,
        **fields,
    ) -> DecodeConfig:
        """The config every caller builds for `model`: stops where `generate` would (EOS ids of the
        tokenizer and the generation config), the window defaults to the B the checkpoint was trained
        with, and the calibrated temperatures it carries are applied (unless `calibrated=False`).

        A window wider than the trained B is refused unless `allow_wider`: its extra slots were never
        trained and their confidences mean nothing.
        """
        trained = getattr(model.config, TRAINED_BLOCK_SIZE, None)
        window = block_size or trained or DEFAULT_BLOCK_SIZE
        if trained and window > trained and not allow_wider:
            raise ConfigError(
                "block_size",
                f"{window} is wider than the B = {trained} this checkpoint was trained with"
                " (allow a wider window explicitly to try it)",
            )
        temperatures = getattr(model.config, SLOT_TEMPERATURES, None) if calibrated else None
        return cls(
            block_size=window,
            stop_token_ids=stop_token_ids(model, tokenizer),
            slot_temperatures=tuple(temperatures or ()),
            vocab_limit=len(tokenizer),
            **fields,
        )

    def __post_init__(self) -> None:
        checks = {
            "tau": self.tau > 0 and math.isfinite(self.tau),
            "block_size": self.block_size >= 1,
            "max_new_tokens": self.max_new_tokens >= 1,
            "max_accept": self.max_accept is None or self.max_accept >= 1,
            "temperature": self.temperature >= 0 and math.isfinite(self.temperature),
            "top_p": 0 < self.top_p <= 1,
            "slot_temperatures": all(t > 0 and math.isfinite(t) for t in self.slot_temperatures),
            "logprobs": self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
            "min_tokens": 0 <= self.min_tokens <= self.max_new_tokens,
        }
        for name, ok in checks.items():
            if not ok:
                raise ConfigError(name, f"invalid value {getattr(self, name)!r}")
        if self.verify and self.temperature > 0:
            raise ConfigError(
                "verify", "verified decoding is greedy only: it cannot be asked with temperature > 0"
            )

    @property
    def window(self) -> int:
        """Slots this sequence may accept per forward: 1 at tau >= 1 (no masks needed at all)."""
        if self.tau >= 1.0:
            return 1
        return min(self.block_size, self.max_accept or self.block_size)


def stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the generation config: where `generate` would stop."""
    ids = {tokenizer.eos_token_id}
    eos = model.generation_config.eos_token_id
    ids.update(eos if isinstance(eos, list) else [eos])
    return tuple(sorted(i for i in ids if i is not None))


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability at the slot that produced it, and the likeliest alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids, including the stop token that ended them
    forward_passes: int  # every forward this sequence took part in (prefill and extend passes included)
    accepted: list[int]  # tokens accepted at each forward that produced tokens
    finish_reason: str  # "stop" or "length"
    drafted: list[int] = field(default_factory=list)  # verified decoding: proposals checked per forward
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, when the config asks

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / max(self.forward_passes, 1)


def accept_length(confidence: Sequence[float], tau: float, limit: int) -> int:
    """How many leading slots to accept: slot 0 always, then while confidence >= tau, at most `limit`.

    tau >= 1 is one token: an fp32 (let alone bf16) probability can round to exactly 1.0.
    """
    if tau >= 1.0:
        return 1
    n = 1
    while n < min(limit, len(confidence)) and confidence[n] >= tau:
        n += 1
    return n


@dataclass
class DecodeState:
    """One sequence being decoded: its prompt, config, output so far and counters.

    `drafts` (verified decoding) are proposals carried into the next forward as real tokens, to be checked
    there; `drafted[i]` is how many the forward that produced `accepted[i]` checked.
    """

    prompt: list[int]
    config: DecodeConfig
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    drafted: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    forward_passes: int = 0
    finish_reason: str | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("prompt must hold at least one token")
        if self.config.temperature > 0:
            self.generator = torch.Generator()
            if self.config.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(self.config.seed)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def room(self) -> int:
        """Tokens it may still produce."""
        return self.config.max_new_tokens - len(self.tokens)

    @property
    def window(self) -> int:
        """Slots its next forward reads: its config's window, capped by the tokens it may still produce
        after its drafts. A mask past them could only propose a token past the budget, and would take a
        position past the context (at its end, past the model's `max_position_embeddings`)."""
        return min(self.config.window, self.room - len(self.drafts))  # >= 1: drafts < room, always

    def reconfigure(self, config: DecodeConfig) -> None:
        """Decode with `config` from the next forward on. A row that no longer verifies drops its drafts:
        they are not cached yet, and a lossy forward would feed (and cache) them without outputting them."""
        self.config = config
        if not config.verify:
            self.drafts = []

    def take(self, proposed: Sequence[int], confidence: Sequence[float]) -> list[int]:
        """Accept the prefix of the proposed window that tau allows; return the committed tokens."""
        cfg = self.config
        limit = min(len(proposed), cfg.max_accept or len(proposed), self.room)
        return self.commit(proposed[: accept_length(confidence, cfg.tau, limit)], drafted=0)

    def commit(self, new: Sequence[int], drafted: int) -> list[int]:
        """Append tokens up to the budget and the first stop token; return what was appended."""
        new = list(new[: self.room])
        for i, token in enumerate(new):
            if token in self.config.stop_token_ids:
                new = new[: i + 1]
                self.finish_reason = "stop"
                break
        self.tokens += new
        self.accepted.append(len(new))
        self.drafted.append(drafted)
        if not self.finished and not self.room:
            self.finish_reason = "length"
        return new

    def record_logprobs(self, new: Sequence[int], logits: torch.Tensor, mask_id: int | None) -> None:
        """Log-probabilities of the tokens just committed, `logits` [len(new), V] the slots they came from
        (normalised without the mask token, see `text_log_probs`)."""
        k = self.config.logprobs
        if k is None or not new:
            return
        log_probs = text_log_probs(logits[: len(new)], mask_id)
        index = torch.tensor(list(new), device=log_probs.device)[:, None]
        chosen = log_probs.gather(-1, index)[:, 0].tolist()
        values, ids = (t.tolist() for t in log_probs.topk(k, dim=-1))
        for token, logprob, top_ids, top_values in zip(new, chosen, ids, values, strict=True):
            self.logprobs.append(TokenLogprob(token, logprob, tuple(zip(top_ids, top_values, strict=True))))

    def result(self) -> DecodeResult:
        return DecodeResult(
            list(self.tokens),
            self.forward_passes,
            list(self.accepted),
            self.finish_reason or "",
            list(self.drafted),
            list(self.logprobs),
        )


def text_log_probs(logits: torch.Tensor, mask_id: int | None) -> torch.Tensor:
    """fp32 log-probabilities over the vocabulary less the mask token, which is not text: a plain model that
    MARS gave a mask row reports the log-probabilities it reported before, not a softmax that row dilutes."""
    logits = logits.float()
    if mask_id is not None and mask_id < logits.shape[-1]:
        logits = logits.clone()
        logits[..., mask_id] = float("-inf")
    return torch.log_softmax(logits, dim=-1)


def propose(
    logits: torch.Tensor,
    seqs: Sequence[DecodeState],
    first_slot: Sequence[int] | None = None,
    mask_id: int | None = None,
    slots: Sequence[int] | None = None,
) -> tuple[list[list[int]], list[list[float]], torch.Tensor]:
    """Per slot, the greedy (or Gumbel-max sampled) token and its fp32 probability. logits: [n, W, V].

    A row's window starts at column `first_slot[row]` (default 0) and is `slots[row]` columns wide (default:
    to the end); its `slot_temperatures` scale its slots' logits before the probability is read. A mask slot
    (after the first) never proposes the mask token or an id at or past the row's `vocab_limit` (padded
    embedding rows): neither is text. The first slot is the model's own greedy choice, exactly as
    `generate`'s; a sampling row never draws the mask in any slot (`text_log_probs` leaves it out too). It
    draws for its own window's slots only: its random stream, and so a seeded row's tokens, never depend on
    how wide its neighbours' windows made the batch.
    """
    first_slot = first_slot or [0] * len(seqs)
    slots = slots or [logits.shape[1] - start for start in first_slot]
    logits = _never_in_mask_slots(logits.float(), seqs, first_slot, mask_id)
    logits = _no_stop_before_min_tokens(logits, seqs, first_slot)
    tokens = logits.argmax(dim=-1)
    scale = _slot_scales(seqs, logits.shape[1], first_slot)
    scaled = logits if scale is None else logits / scale.to(logits.device)[:, :, None]
    confidence = torch.softmax(scaled, dim=-1).gather(-1, tokens[:, :, None])[:, :, 0]
    for i, seq in enumerate(seqs):
        cfg = seq.config
        if cfg.temperature <= 0:
            continue
        own = slice(first_slot[i], first_slot[i] + slots[i])
        scores = logits[i, own].cpu() / cfg.temperature
        if mask_id is not None and mask_id < scores.shape[-1]:
            scores[:, mask_id] = float("-inf")  # not text, in no slot: the model's own text distribution
        row = torch.softmax(scores, dim=-1)
        if cfg.top_p < 1.0:
            row = _top_p(row, cfg.top_p)
        gumbel = -torch.log(-torch.log(torch.rand(row.shape, generator=seq.generator).clamp_min(1e-20)))
        choice = (row.log() + gumbel).argmax(dim=-1)
        tokens[i, own] = choice.to(tokens.device)
        confidence[i, own] = row.gather(-1, choice[:, None])[:, 0].to(confidence.device)
    return tokens.tolist(), confidence.tolist(), logits


def _never_in_mask_slots(
    logits: torch.Tensor, seqs: Sequence[DecodeState], first_slot: Sequence[int], mask_id: int | None
) -> torch.Tensor:
    """`logits` with the ids a mask slot must not propose at -inf, in the mask slots only."""
    rows, width, vocab = logits.shape
    banned = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
    if mask_id is not None and mask_id < vocab:
        banned[:, mask_id] = True
    for row, seq in enumerate(seqs):
        if seq.config.vocab_limit is not None:
            banned[row, seq.config.vocab_limit :] = True
    if not banned.any():
        return logits
    columns = torch.arange(width, device=logits.device)[None, :]
    after = columns > torch.tensor(list(first_slot), device=logits.device)[:, None]
    return logits.masked_fill(after[:, :, None] & banned[:, None, :], float("-inf"))


def _no_stop_before_min_tokens(
    logits: torch.Tensor, seqs: Sequence[DecodeState], first_slot: Sequence[int]
) -> torch.Tensor:
    """`logits` with a row's stop tokens at -inf in the columns that predict a token before its
    `min_tokens`-th (HF's `min_new_tokens`). Column c predicts output position c - start, where start is
    the row's first slot, less its drafts (a verified row's drafts are predicted from the columns before)."""
    rows = [
        r
        for r, seq in enumerate(seqs)
        if len(seq.tokens) < seq.config.min_tokens and seq.config.stop_token_ids
    ]
    if not rows:
        return logits
    logits = logits.clone()
    for row in rows:
        seq = seqs[row]
        start = first_slot[row] - len(seq.drafts)
        end = min(logits.shape[1], start + seq.config.min_tokens - len(seq.tokens))
        stops = torch.tensor(seq.config.stop_token_ids, device=logits.device)
        logits[row, max(start, 0) : end, stops] = float("-inf")
    return logits


def _slot_scales(seqs: Sequence[DecodeState], width: int, first_slot: Sequence[int]) -> torch.Tensor | None:
    """[n, W] temperatures per row and column (1 outside a row's list), or None when every row is raw."""
    if not any(seq.config.slot_temperatures for seq in seqs):
        return None
    scale = torch.ones(len(seqs), width)
    for row, (seq, start) in enumerate(zip(seqs, first_slot, strict=True)):
        temperatures = seq.config.slot_temperatures[: width - start]
        scale[row, start : start + len(temperatures)] = torch.tensor(temperatures)
    return scale


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of tokens whose probability reaches `top_p`, renormalised."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return kept / kept.sum(dim=-1, keepdim=True)


@torch.inference_mode()
def decode_reference(
    model: PreTrainedModel, prompt: Sequence[int], mask_id: int, config: DecodeConfig
) -> DecodeResult:
    """The ground truth: each step recomputes `[prompt + output, MASK x (W - 1)]` (W: `DecodeState.window`)
    with plain causal attention."""
    seq = DecodeState(list(prompt), config)
    while not seq.finished:
        context, width = seq.prompt + seq.tokens, seq.window
        ids = torch.tensor([context + [mask_id] * (width - 1)], device=model.device)
        logits = model(input_ids=ids).logits[:, len(context) - 1 :]
        seq.forward_passes += 1
        tokens, confidence, read = propose(logits, [seq], mask_id=mask_id)
        new = seq.take(tokens[0], confidence[0])
        seq.record_logprobs(new, read[0], mask_id)
    return seq.result()


def _check_cacheable(config) -> None:
    """Refuse a model whose attention this cache cannot express: every layer must attend to every valid
    key through the 4D mask it is given (no sliding windows or hybrid layers, an implementation that
    honours a 4D mask)."""
    layers = getattr(config, "layer_types", None) or []
    if any(kind != "full_attention" for kind in layers) or (
        not layers and getattr(config, "sliding_window", None)
    ):
        raise ConfigError(
            "model", f"{config.model_type}: sliding-window or hybrid attention layers are not supported"
        )
    if config._attn_implementation not in ("sdpa", "eager"):
        raise ConfigError(
            "attn_implementation",
            f"{config._attn_implementation!r} ignores a 4D attention mask: use sdpa or eager",
        )


class RaggedCache:
    """One rectangular KV cache for rows of different lengths; row r's real keys are where `valid[r]`.

    Holes (left padding, slack from rows that advanced less than others) are never attended and positions
    count real tokens only, so every row computes what it would alone. Rows join empty and leave at once.
    """

    def __init__(self, model: PreTrainedModel, compiled: bool = True) -> None:
        """`compiled`: cached steps run `step_forward(model)` (compiled after `compile_steps`)."""
        _check_cacheable(model.config)
        self.model = model
        self.step = step_forward(model) if compiled else model
        self.device = model.device
        self.kv = DynamicCache(config=model.config)
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)  # [rows, T]
        self.next_position = torch.zeros(0, dtype=torch.long, device=self.device)  # [rows]
        self.eager = model.config._attn_implementation == "eager"

    def _layers(self):
        return [layer for layer in self.kv.layers if layer.is_initialized and layer.keys.dim() == 4]

    def forward(
        self, input_ids: torch.Tensor, real: torch.Tensor, keep: int, logits_to_keep: int
    ) -> torch.Tensor:
        """Run `input_ids` [rows, S] after the cache; cache the first `keep` columns; return the last logits.

        `real` marks the columns that exist (False = hole). Real columns see every valid cached key and the
        real columns before them; a hole sees only itself, so no softmax row is empty.
        """
        positions = (self.next_position[:, None] + real.cumsum(dim=1) - 1).clamp(min=0)
        layers = self._layers()
        # Compiled: a step into keys to attend (a prompt into an empty or all-hole cache is compute-bound).
        run = self.step if layers and self.valid.shape[1] >= 2 and bool(self.valid.any()) else self.model
        mask = self._mask(real, always=run is not self.model)
        if run is not self.model:  # a first forward caches views; one layout means one compiled graph
            for layer in layers:
                layer.keys, layer.values = _static_heads(layer.keys), _static_heads(layer.values)
            width = input_ids.shape[1]
            logits_to_keep = torch.arange(width - logits_to_keep, width, device=self.device)
        out = run(
            input_ids=input_ids,
            position_ids=positions,
            attention_mask=mask,
            past_key_values=self.kv,  # `cache` from transformers 5.24; vLLM pins 5.19
            use_cache=True,
            logits_to_keep=logits_to_keep,
        )
        if keep < input_ids.shape[1]:
            self.kv.crop(keep - input_ids.shape[1])
        kept = real[:, :keep]
        self.valid = torch.cat([self.valid, kept], dim=1)
        self.next_position = self.next_position + kept.sum(dim=1)
        return out.logits

    def _mask(self, real: torch.Tensor, always: bool = False) -> torch.Tensor | None:
        """The 4D mask for a forward of `real`'s columns, or None where there is no hole anywhere (unless
        `always`: a compiled step always takes a mask, so that a mask or none is not two graphs).

        Without holes the mask is plain causal; left to the model, it is built the way HF `generate` builds
        it (at batch 1: none, and SDPA's own causal kernel), so a hole-free forward takes the same kernels
        as `generate` and tau = 1 equals it bit for bit in bf16 as well, and runs faster.
        """
        if not always and bool(real.all()) and bool(self.valid.all()):
            return None
        rows, width = real.shape
        cached = self.valid.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        own = causal[None] & real[:, None, :]
        own |= torch.eye(width, dtype=torch.bool, device=self.device)[None]
        mask = torch.cat([self.valid[:, None, :].expand(rows, width, cached), own], dim=2)[:, None]
        if self.eager:
            mask = torch.zeros(mask.shape, dtype=self.model.dtype, device=self.device).masked_fill(
                ~mask, torch.finfo(self.model.dtype).min
            )
        return mask

    def forget_last(self, counts: Sequence[int]) -> None:
        """Turn each row's last `counts[r]` cached keys into holes (rejected proposals): never attended
        again, and the row's next position is where the first of them was."""
        if not any(counts):
            return
        counts_t = torch.tensor(list(counts), device=self.device)
        from_end = self.valid.flip(1).to(torch.long).cumsum(dim=1).flip(1)  # valid keys at or after
        self.valid &= ~(from_end <= counts_t[:, None])
        self.next_position = self.next_position - counts_t
        self.compact()

    def add_rows(self, count: int) -> None:
        """Append `count` empty rows (all holes)."""
        self.valid = torch.cat([self.valid, self.valid.new_zeros((count, self.valid.shape[1]))])
        self.next_position = torch.cat([self.next_position, self.next_position.new_zeros(count)])
        for layer in self._layers():
            layer.keys = torch.cat([layer.keys, layer.keys.new_zeros((count, *layer.keys.shape[1:]))])
            layer.values = torch.cat([layer.values, layer.values.new_zeros((count, *layer.values.shape[1:]))])

    def take_rows(self, rows: Sequence[int], other: RaggedCache) -> None:
        """Rows `rows` (empty until now) take the keys and values of `other`'s rows, in order; the time
        axis grows on the left (holes) when `other` is longer."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.device)
        if not other._layers() or not other.valid.shape[1]:  # nothing cached there
            self.next_position[index] = other.next_position
            return
        grow = other.valid.shape[1] - self.valid.shape[1]
        if grow > 0:
            self.valid = torch.cat([self.valid.new_zeros((self.valid.shape[0], grow)), self.valid], dim=1)
            for layer in self._layers():
                holes = layer.keys.new_zeros((*layer.keys.shape[:2], grow, layer.keys.shape[3]))
                layer.keys = torch.cat([holes, layer.keys], dim=2)
                layer.values = torch.cat([holes.clone(), layer.values], dim=2)
        width = other.valid.shape[1]
        self.valid[index, -width:] = other.valid
        self.next_position[index] = other.next_position
        for mine, theirs in zip(self._layers(), other._layers(), strict=True):
            mine.keys[index, :, -width:] = theirs.keys
            mine.values[index, :, -width:] = theirs.values

    def split_rows(self, indices: Sequence[int]) -> RaggedCache:
        """A new cache holding these rows (in this order), which this one gives up."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        moved = RaggedCache(self.model)
        moved.valid, moved.next_position = self.valid[index], self.next_position[index]
        for mine, theirs in zip(self.kv.layers, moved.kv.layers, strict=True):
            if mine.is_initialized and mine.keys.dim() == 4:
                theirs.lazy_initialization(mine.keys, mine.values)
                theirs.keys, theirs.values = mine.keys[index], mine.values[index]
        gone = set(indices)
        self.keep_rows([r for r in range(self.valid.shape[0]) if r not in gone])
        return moved

    def keep_rows(self, indices: Sequence[int]) -> None:
        """Keep only these rows (in this order); the others' keys and values are freed."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.device)
        self.valid = self.valid[index]
        self.next_position = self.next_position[index]
        for layer in self._layers():
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        self.compact()

    def compact(self, min_holes: int = 32) -> None:
        """Drop hole columns once they are a quarter of the cache: each row's keys move right, in order."""
        total = self.valid.shape[1]
        width = int(self.valid.sum(dim=1).max()) if self.valid.shape[0] else 0
        if total - width < max(min_holes, total // 4):
            return
        # A stable sort puts every row's real keys last, in their original order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, total - width :]
        self.valid = self.valid.gather(1, order)
        for layer in self._layers():
            index = order[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys, layer.values = layer.keys.gather(2, index), layer.values.gather(2, index)


def _static_heads(t: torch.Tensor) -> torch.Tensor:
    """Cached keys or values [rows, heads, time, head_dim] as a compiled step wants them: row-major (even
    along size-1 dims; a first forward caches views), heads and head_dim marked static (so they are never
    taken for a batch or a width that happens to be the same size)."""
    expected, stride = [], 1
    for size in reversed(t.shape):
        expected.append(stride)
        stride *= size
    if t.stride() != tuple(reversed(expected)):
        t = t.clone(memory_format=torch.contiguous_format)
    torch._dynamo.mark_static(t, 1)
    torch._dynamo.mark_static(t, 3)
    return t


def right_align(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows packed into one [n, longest] tensor with holes on the left; also which columns are real."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    real = torch.zeros(ids.shape, dtype=torch.bool)
    for row, tokens in enumerate(rows):
        if tokens:
            ids[row, width - len(tokens) :] = torch.tensor(list(tokens))
            real[row, width - len(tokens) :] = True
    return ids, real


class SlidingDecoder:
    """Continuous multi-token decoding: every row accepts >= 1 token at every forward.

    A step runs named stages: join (cache the prompts of rows that were added, then let them into the
    batch), propose (one forward of every row's `[uncached tokens | drafts | W-1 masks]`, right-aligned with
    holes on the left, so the masks are always the last W-1 columns and one crop removes them from every
    row: no mask KV is ever kept), accept (per row, by tau or, for a verifying row, by agreement with the
    greedy predictions), advance (what the next forward feeds; finished rows leave). The uncached tokens are
    last step's accepted ones, or a joining row's last prompt token; drafts are a verifying row's carried
    proposals. W is the widest window in the batch; a row at tau >= 1 only reads slot 0.

    Rows that join while others run wait outside the batch while their prompts (all but the last token) are
    cached in a side cache, at most `prefill_budget` tokens a step (chunked prefill, oldest first; None: all
    at once), so the running rows' forwards stay one window wide and a long prompt delays each of their
    steps by at most one budget's worth of prefill. Rows added to an idle decoder join at once: nobody waits.
    """

    def __init__(
        self, model: PreTrainedModel, mask_id: int, pad_id: int = 0, prefill_budget: int | None = None
    ) -> None:
        if prefill_budget is not None and prefill_budget < 1:
            raise ConfigError("prefill_budget", f"must be at least 1, got {prefill_budget}")
        self.model, self.mask_id, self.pad_id = model, mask_id, pad_id
        self.prefill_budget = prefill_budget
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
        """Cache the next chunk of the joining rows' prompts (oldest first, at most `prefill_budget` tokens,
        never a prompt's last token, which the decode forward feeds like any row's last accepted token);
        rows with nothing left to cache join the batch. Into an idle decoder every joining row joins at
        once, and the decode forward caches the rest of its prompt itself."""
        if not self.joining:
            return
        if self.seqs:
            budget = math.inf if self.prefill_budget is None else self.prefill_budget
            chunks = []
            for pending in self.unprefilled:
                size = int(min(len(pending) - 1, budget))
                chunks.append(pending[:size])
                budget -= size
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
    """Decode many prompts, at most `max_batch` rows at a time: a row that finishes leaves, and once a
    quarter of the rows are free the next prompts join together (one prefill forward for all of them).
    Yields `(index, result)` as each prompt finishes."""
    waiting = deque(enumerate(prompts))
    decoder = SlidingDecoder(model, mask_id, pad_id)
    index_of: dict[int, int] = {}
    while waiting or decoder.active:
        free = max_batch - len(decoder.seqs) - len(decoder.joining)
        for _ in range(min(len(waiting), free) if free >= max(1, max_batch // 4) else 0):
            index, prompt = waiting.popleft()
            seq = DecodeState(list(prompt), config)
            index_of[id(seq)] = index
            decoder.add(seq)
        for seq, _ in decoder.step():
            if seq.finished:
                yield index_of.pop(id(seq)), seq.result()


@torch.inference_mode()
def decode_block_cached(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    mask_id: int,
    config: DecodeConfig | Sequence[DecodeConfig],
    cache_block: int = 32,
    pad_id: int = 0,
    fuse_extend: bool = False,
) -> list[DecodeResult]:
    """The paper's block-level KV cache (`MARSBlockCachedSampler`) over a left-padded batch.

    Prefill once. Then per block of `cache_block` slots: forward the block (accepted tokens + masks)
    against the block-start cache without keeping it, accept per row from its fill point to the block end,
    repeat until every row's block is full (full rows idle), then an extend pass appends the block to the
    cache and yields the next block's slot-0 logits. Rows are synchronised at block ends so the batch
    cache stays rectangular. `fuse_extend` folds each extend into the next block's first forward
    (`[block | masks]`, keeping only the block): same tokens, one forward fewer per block.
    A row that finishes leaves the batch at once. `config.block_size` is not used here: the window is
    the rest of the block, capped by `max_accept`.
    """
    configs = [config] * len(prompts) if isinstance(config, DecodeConfig) else list(config)
    if any(c.verify for c in configs):
        raise ConfigError("verify", "the block-cached decoder does not verify; use the sliding decoder")
    seqs = [DecodeState(list(p), c) for p, c in zip(prompts, configs, strict=True)]
    live = list(seqs)
    cache = RaggedCache(model)
    cache.add_rows(len(live))
    device = cache.device

    ids, real = right_align([seq.prompt for seq in live], pad_id)
    last = cache.forward(ids.to(device), real.to(device), ids.shape[1], 1)[:, -1]  # slot-0 logits of block 1
    for seq in live:
        seq.forward_passes += 1

    all_real = torch.ones((len(live), cache_block), dtype=torch.bool, device=device)
    block = torch.full((len(live), cache_block), mask_id, dtype=torch.long, device=device)
    filled = [0] * len(live)
    pending_extend = False
    while live:
        if pending_extend and fuse_extend:
            # Extend and first inner forward at once: `[full block | masks]`, cache only the block.
            masks = torch.full_like(block, mask_id)
            both = torch.cat([block, masks], dim=1)
            logits = cache.forward(both, torch.cat([all_real, all_real], dim=1), cache_block, cache_block + 1)
            last, logits = logits[:, 0], logits[:, 1:]
            block, filled, pending_extend = masks, [0] * len(live), False
        else:
            logits = cache.forward(block, all_real, 0, cache_block)
        for seq in live:
            seq.forward_passes += 1
        slots = torch.cat([last[:, None], logits[:, :-1]], dim=1)
        tokens, confidence, _ = propose(slots, live, filled, mask_id)
        for row, seq in enumerate(live):
            start = filled[row]
            if start == cache_block:
                continue  # this row's block is full: it idles until the others fill theirs
            new = seq.take(tokens[row][start:], confidence[row][start:])
            block[row, start : start + len(new)] = torch.tensor(new, device=device)
            filled[row] += len(new)

        keep = [row for row, seq in enumerate(live) if not seq.finished]
        if len(keep) < len(live):
            live, filled = [live[r] for r in keep], [filled[r] for r in keep]
            index = torch.tensor(keep, dtype=torch.long, device=device)
            block, last, all_real = block[index], last[index], all_real[index]
            cache.keep_rows(keep)
        if live and min(filled) == cache_block:
            if fuse_extend:
                pending_extend = True
                continue
            last = cache.forward(block, all_real, cache_block, 1)[:, -1]
            for seq in live:
                seq.forward_passes += 1
            block = torch.full_like(block, mask_id)
            filled = [0] * len(live)
    return [s.result() for s in seqs]
