"""`mars-ray generate`: decode one prompt with a MARS model from the command line."""

from __future__ import annotations

import argparse
import json
import time

from pydantic import BaseModel, ConfigDict, Field

from mars_ray import cli_args, models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.data import chat_prompt_ids
from mars_ray.serve.config import BlockSizeOrNone, Tau
from mars_ray.vllm.config import ENGINE_HELP, Engine


class GenerateConfig(BaseModel):
    """One prompt, decoded with the checkpoint's own decode config (`DecodeConfig.for_model`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str = Field(description="local HF folder, Hub id, or preset (tiny, smollm2-135m)")
    prompt: str = Field(description="user message (chat template applied when present)")
    tau: Tau = Field(1.0, description="confidence threshold; 1.0 = exact greedy AR")
    block_size: BlockSizeOrNone = Field(
        None, description="window: tokens proposed per forward (default: the trained B)"
    )
    allow_wider_window: bool = Field(False, description="allow a window wider than the trained B")
    verify: bool = Field(False, description="verified: exactly greedy at any tau (tau picks the drafts)")
    max_new_tokens: int = Field(256, ge=1, description="reply budget")
    engine: Engine = Field("native", description=ENGINE_HELP)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="decode one prompt, several tokens per forward")
    cli_args.add_config_arguments(parser, GenerateConfig)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    asked = cli_args.config_from_args(GenerateConfig, args)
    if asked.engine == "vllm":  # vLLM holds the weights: load only what the decode config reads
        from mars_ray.vllm.offline import VllmDecoder

        model, tokenizer = models.load_card(asked.model)
        decoder = VllmDecoder(models.resolve(asked.model))
    else:
        model, tokenizer = models.load(asked.model)
    config = DecodeConfig.for_model(
        model,
        tokenizer,
        asked.block_size,
        allow_wider=asked.allow_wider_window,
        tau=asked.tau,
        max_new_tokens=asked.max_new_tokens,
        verify=asked.verify,
    )
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": asked.prompt}])
    start = time.perf_counter()
    if asked.engine == "vllm":
        result = decoder.decode([prompt], config)[0]
    else:
        result = decode_cached(model, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)[0]
    seconds = time.perf_counter() - start
    text = tokenizer.decode(result.tokens, skip_special_tokens=True)
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "token_ids": result.tokens,
                    "forward_passes": result.forward_passes,
                    "tokens_per_forward": round(result.tokens_per_forward, 4),
                    "mode": config.mode,
                }
            )
        )
    else:
        print(text)
        print(
            f"[{len(result.tokens)} tokens, {result.forward_passes} forwards, "
            f"{result.tokens_per_forward:.2f} tokens/forward, {len(result.tokens) / seconds:.1f} tokens/s]"
        )
