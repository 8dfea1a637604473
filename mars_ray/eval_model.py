"""The model `mars-ray eval` (and the learning-curve scripts) decode with: loaded once, decoded at any tau,
confidence and mode on the native decoder or on vLLM, and checked against HF `generate`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Literal

from mars_ray import models
from mars_ray.bench.baseline import hf_greedy_tokens
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeResult
from mars_ray.core.decoder import decode_continuous
from mars_ray.core.dtypes import torch_dtype
from mars_ray.eval_measures import acceptance_rates, agreement

if TYPE_CHECKING:
    from mars_ray.evaluate import EvalConfig

Confidence = Literal["calibrated", "raw"]
Mode = Literal["lossy", "verify"]


class Decoded:
    """One model's replies to one prompt set at one setting."""

    def __init__(self, tokenizer, results: list[DecodeResult]) -> None:
        self.results = results
        self.texts = [tokenizer.decode(r.tokens, skip_special_tokens=True).strip() for r in results]
        tokens = sum(len(r.tokens) for r in results)
        self.tokens_per_forward = tokens / max(sum(r.forward_passes for r in results), 1)


class ModelUnderTest:
    """A loaded model and the decoding its checkpoint asks for."""

    def __init__(self, path: str, config: EvalConfig) -> None:
        self.model, self.tokenizer = models.load(path, dtype=torch_dtype(config.dtype), device=config.device)
        self._configure(config)
        if config.engine == "vllm":
            from mars_ray.vllm.offline import VllmDecoder

            self.vllm = VllmDecoder(models.resolve(path), dtype=config.dtype)

    @classmethod
    def in_memory(cls, model, tokenizer, config: EvalConfig) -> ModelUnderTest:
        """A model already loaded (a training run's live weights), put in eval mode."""
        under_test = cls.__new__(cls)
        under_test.model, under_test.tokenizer = model.eval(), tokenizer
        under_test._configure(config)
        return under_test

    def _configure(self, config: EvalConfig) -> None:
        self.base = DecodeConfig.for_model(
            self.model,
            self.tokenizer,
            config.block_size,
            allow_wider=config.allow_wider_window,
            max_new_tokens=config.max_new_tokens,
        )
        self.batch_size = config.batch_size
        self.vllm = None

    def confidences(self, wanted: Sequence[Confidence]) -> list[Confidence]:
        """The confidence modes that differ for this checkpoint (raw only, if it is not calibrated)."""
        return [c for c in wanted if c == "raw" or self.base.slot_temperatures] or ["raw"]

    def decode(
        self, prompts: list[list[int]], tau: float, confidence: Confidence, mode: Mode = "lossy"
    ) -> Decoded:
        temperatures = self.base.slot_temperatures if confidence == "calibrated" else ()
        config = replace(self.base, tau=tau, slot_temperatures=temperatures, verify=mode == "verify")
        tok = self.tokenizer
        if self.vllm is not None:
            return Decoded(tok, self.vllm.decode(prompts, config))
        found = dict(
            decode_continuous(
                self.model, prompts, tok.mask_token_id, config, tok.pad_token_id, self.batch_size
            )
        )
        return Decoded(tok, [found[i] for i in range(len(prompts))])

    def greedy_mismatches(self, prompts: list[list[int]], results: list[DecodeResult]) -> int:
        """How many replies differ from HF `generate(do_sample=False)` on the same weights, one prompt at
        a time (a left-padded batch is checked first; only the rows where it differs are run alone, since
        padding itself can move a near-tie in HF's own kernels)."""

        def generate(chunk: list[list[int]]) -> list[list[int]]:
            tok, decode = self.tokenizer, self.base
            return hf_greedy_tokens(
                self.model, chunk, decode.max_new_tokens, decode.stop_token_ids, tok.pad_token_id
            )

        mismatches = 0
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start : start + self.batch_size]
            got = [r.tokens for r in results[start : start + len(chunk)]]
            for prompt, expected, mine in zip(chunk, generate(chunk), got, strict=True):
                mismatches += expected != mine and generate([prompt])[0] != mine
        return mismatches


def curve_point(
    under_test: ModelUnderTest,
    prompts: dict[str, list[list[int]]],
    reference: dict[str, list[str]],
    answers: list[str] | None,
    tau: float,
) -> dict:
    """One point of a learning curve, per source: tokens per forward at `tau` (raw confidences), lossy and
    verified; the lossy text's agreement (exact, similarity) with the model's own tau = 1 reply, and of
    both with the base model's reply (`reference`); for tasks, exact-match accuracy at tau = 1 and at
    `tau`. `verified_exact` is the share of verified replies equal to the tau = 1 reply (always 1)."""
    point = {}
    for source, source_prompts in prompts.items():
        greedy = under_test.decode(source_prompts, 1.0, "raw")
        fast = under_test.decode(source_prompts, tau, "raw")
        verified = under_test.decode(source_prompts, tau, "raw", "verify")
        point[source] = {
            "tokens_per_forward": fast.tokens_per_forward,
            "verified_tokens_per_forward": verified.tokens_per_forward,
            "verified_exact": agreement(verified.texts, greedy.texts)[0],
            "acceptance": acceptance_rates(fast.results, under_test.base.block_size),
            "self": agreement(fast.texts, greedy.texts),
            "base_greedy": agreement(greedy.texts, reference[source]),
            "base": agreement(fast.texts, reference[source]),
        }
        if source == "tasks" and answers is not None:
            point[source]["accuracy"] = [agreement(run.texts, answers)[0] for run in (greedy, fast)]
    return point
