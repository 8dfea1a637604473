"""The MARS drafter vLLM loads (`speculative_config={"method": "custom_class", "model": PROPOSER, ...}`).

No draft model: the target is its own drafter. Each forward of a drafting request carries W - 1 masks after
its proposals; what the masks predict (read by `acceptance.read_forward` before vLLM samples) becomes the
next forward's proposals, as far as tau trusts them, when every proposal of this forward held. A request
that is still prefilling, or runs at tau = 1 (W = 1), drafts nothing: that is vLLM's plain AR step.

vLLM hands a custom proposer token lists only, so the proposer reads the logits through one hook on the
model runner's `_sample`, installed when vLLM first builds a proposer in its worker process; a runner
without a MARS proposer samples exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import AutoTokenizer

from mars_ray.core import gated
from mars_ray.core.decode_config import (
    DEFAULT_BLOCK_SIZE,
    SLOT_TEMPERATURES,
    TRAINED_BLOCK_SIZE,
    DecodeConfig,
)
from mars_ray.core.errors import ConfigError
from mars_ray.vllm import cpu_fix
from mars_ray.vllm import gated as vllm_gated
from mars_ray.vllm.acceptance import Proposals, Vocabulary, keep_confident, read_forward
from mars_ray.vllm.settings import DraftSettings, settings_of

GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature


class MarsProposer:
    """Drafts for every request of the batch from the mask rows of the forward that just ran."""

    def __init__(self, vllm_config) -> None:
        model_config = vllm_config.model_config
        hf_config = self.hf_config = model_config.hf_config
        tokenizer = AutoTokenizer.from_pretrained(
            model_config.tokenizer, trust_remote_code=model_config.trust_remote_code
        )
        if tokenizer.mask_token_id is None:
            raise ConfigError("model", f"{model_config.model}: no mask token in its tokenizer (not MARS)")
        self.block_size = int(getattr(hf_config, TRAINED_BLOCK_SIZE, None) or DEFAULT_BLOCK_SIZE)
        self.max_drafts = int(vllm_config.speculative_config.num_speculative_tokens)
        self.vocabulary = Vocabulary(
            mask_id=int(tokenizer.mask_token_id),
            limit=len(tokenizer),
            slot_temperatures=tuple(getattr(hf_config, SLOT_TEMPERATURES, None) or ()),
        )
        self._batch: list[DraftSettings] = []
        self._read: list[Proposals | None] = []
        self.point: tuple[float, bool, int] | None = None  # the operating point, once a replica sets one
        _install_hook()

    def follow(self, tau: float, verify: bool, block_size: int) -> None:
        """The operating point that requests marked `follow` take what they leave unset from, from the next
        forward on (`MarsWorker`, called by a replica)."""
        DecodeConfig.check_tau(tau)
        self.point = (tau, bool(verify), DecodeConfig.check_block_size(block_size, most=self.block_size))

    def load_model(self, target_model, *args, **kwargs) -> None:
        """vLLM loads a drafter's weights here; the target is this drafter, plus the gated adapter where the
        checkpoint is a gated folder (`mars_ray.vllm.gated`)."""
        if getattr(self.hf_config, gated.MARKER, None):
            vllm_gated.attach(target_model, self.hf_config)

    def observe(self, req_ids: Sequence[str], requests: dict, logits: torch.Tensor, metadata) -> None:
        """One forward's logits, before vLLM samples from them (see `acceptance`)."""
        self._batch = []
        for req_id in req_ids:
            params = requests[req_id].sampling_params
            greedy = params is None or params.temperature < GREEDY_BELOW
            extra = params.extra_args if params is not None else None
            self._batch.append(settings_of(extra, self.block_size, greedy, self.point))
        drafts: list[list[int]] = [[] for _ in req_ids]
        if metadata is not None:
            flat = metadata.draft_token_ids.tolist()
            start = 0
            for i, count in enumerate(metadata.num_draft_tokens):
                drafts[i], start = flat[start : start + count], start + count
        self._read = read_forward(logits, drafts, self._batch, self.vocabulary)

    def propose(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec, token_ids_cpu, **kwargs
    ) -> list[list[int]]:
        """Each request's drafts for its next forward: the confident proposals read from this forward's
        masks if all it carried held, then W - 1 masks."""
        if len(sampled_token_ids) != len(self._batch):  # no forward was read for this batch
            return [[] for _ in sampled_token_ids]
        drafts = []
        for sampled, settings, read in zip(sampled_token_ids, self._batch, self._read, strict=True):
            if not sampled or settings.window == 1:
                drafts.append([])
                continue
            carried: list[int] = []
            if read is not None and len(sampled) == read.carried + 1:
                carried = keep_confident(read, settings.tau, settings.window - 1)
            masks = [self.vocabulary.mask_id] * (settings.window - 1)
            drafts.append((carried + masks)[: self.max_drafts])
        self._batch, self._read = [], []
        return drafts


_hooked = False


def _install_hook() -> None:
    """Wrap the model runner's `_sample` once per process: a runner whose drafter is a `MarsProposer`
    shows it each forward's logits first. (vLLM's CPU runner inherits the GPU runner's `_sample`.)"""
    global _hooked
    if _hooked:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    cpu_fix.install()
    original = GPUModelRunner._sample

    def _sample(self, logits, spec_decode_metadata):
        drafter = getattr(self, "drafter", None)
        if isinstance(drafter, MarsProposer) and logits is not None:
            drafter.observe(self.input_batch.req_ids, self.requests, logits, spec_decode_metadata)
        return original(self, logits, spec_decode_metadata)

    GPUModelRunner._sample = _sample
    _hooked = True
