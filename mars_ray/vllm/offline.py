"""A MARS checkpoint decoded by vLLM (`vllm.LLM`), with the native decoders' inputs and results.

`mars-ray generate`, `eval` and `bench decode` take `--engine vllm` through this: the same prompts and
`DecodeConfig`s in, the same `DecodeResult`s out, so every exactness check runs on both engines.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decode_state import DecodeResult, TokenLogprob
from mars_ray.core.dtypes import DtypeName
from mars_ray.vllm.config import mars_engine_args
from mars_ray.vllm.passes import accepted_per_forward, histogram_of

KV_CACHE_BYTES = 1 << 30  # vLLM-CPU otherwise reserves 92% of the machine's memory for its cache


def sampling_params(config: DecodeConfig, own: Mapping[str, object] | None = None, **overrides):
    """vLLM's `SamplingParams` for a `DecodeConfig` (and any of its fields in `overrides`): its stop ids and
    nothing else end a reply (as the native decoders stop), its MARS fields go to the proposer as
    `extra_args`. With `own` (a replica's request: the MARS fields it set itself), only those go, and it
    follows the engine's operating point in the rest (`mars_ray.vllm.settings`)."""
    from vllm import SamplingParams

    mars = {"tau": config.tau, "verify": config.verify, "block_size": config.block_size}
    if own is not None:
        mars = {name: value for name, value in own.items() if value is not None} | {"follow": True}
    fields = dict(
        temperature=config.temperature,
        top_p=config.top_p,
        seed=config.seed,
        max_tokens=config.max_new_tokens,
        min_tokens=config.min_tokens,
        ignore_eos=True,
        stop_token_ids=list(config.stop_token_ids),
        logprobs=config.logprobs,
        skip_special_tokens=False,
        extra_args=mars | {"calibrated": bool(config.slot_temperatures)},
    )
    return SamplingParams(**(fields | overrides))


class VllmDecoder:
    """vLLM on one checkpoint: with the MARS proposer where it is a MARS checkpoint (it has a mask token),
    plain vLLM AR otherwise (a base model beside its MARS model, say)."""

    def __init__(
        self, model: str, dtype: DtypeName = "auto", max_model_len: int | None = None, **engine
    ) -> None:
        from vllm import LLM

        engine.setdefault("kv_cache_memory_bytes", KV_CACHE_BYTES)
        engine |= mars_engine_args(model, dtype)
        self.llm = LLM(max_model_len=max_model_len, **engine)

    def decode(
        self, prompts: Sequence[Sequence[int]], config: DecodeConfig | Sequence[DecodeConfig]
    ) -> list[DecodeResult]:
        """Decode the prompts together (vLLM batches them continuously); results in prompt order."""
        configs = list(config) if isinstance(config, Sequence) else [config] * len(prompts)
        params = [sampling_params(c) for c in configs]
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        results = []
        for output, one in zip(outputs, configs, strict=True):
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            accepted = accepted_per_forward(len(tokens), histogram_of(completion.spec_decode_metrics))
            finish = completion.finish_reason or ""
            results.append(
                DecodeResult(tokens, len(accepted), accepted, finish, logprobs=_logprobs(completion, one))
            )
        return results


def _logprobs(completion, config: DecodeConfig) -> list[TokenLogprob]:
    """vLLM's logprobs of each token (the token itself and the `config.logprobs` likeliest, by rank)."""
    if not completion.logprobs:
        return []
    found = []
    for token, alternatives in zip(completion.token_ids, completion.logprobs, strict=True):
        ranked = sorted(alternatives.items(), key=lambda item: item[1].rank)
        top = tuple((t, lp.logprob) for t, lp in ranked if lp.rank <= (config.logprobs or 0))
        found.append(TokenLogprob(token, alternatives[token].logprob, top))
    return found
