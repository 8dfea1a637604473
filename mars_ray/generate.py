"""`mars-ray generate`: decode one prompt with a MARS model from the command line."""

from __future__ import annotations

import argparse
import json
import time

from mars_ray import models
from mars_ray.core.decoding import DecodeConfig, decode_cached
from mars_ray.data import chat_prompt_ids


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="decode one prompt, several tokens per forward")
    parser.add_argument(
        "--model", required=True, help="local HF folder, Hub id, or preset (tiny, smollm2-135m)"
    )
    parser.add_argument("--prompt", required=True, help="user message (chat template applied when present)")
    parser.add_argument("--tau", type=float, default=1.0, help="confidence threshold; 1.0 = exact greedy AR")
    parser.add_argument(
        "--block-size", type=int, help="window: tokens proposed per forward (default: the trained B)"
    )
    parser.add_argument(
        "--allow-wider-window", action="store_true", help="allow a window wider than the trained B"
    )
    parser.add_argument(
        "--verify", action="store_true", help="verified: exactly greedy at any tau (tau picks the drafts)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> None:
    model, tokenizer = models.load(args.model)
    config = DecodeConfig.for_model(
        model,
        tokenizer,
        args.block_size,
        allow_wider=args.allow_wider_window,
        tau=args.tau,
        max_new_tokens=args.max_new_tokens,
        verify=args.verify,
    )
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": args.prompt}])
    start = time.perf_counter()
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
                    "mode": "verify" if config.verify else "mars" if config.window > 1 else "ar",
                }
            )
        )
    else:
        print(text)
        print(
            f"[{len(result.tokens)} tokens, {result.forward_passes} forwards, "
            f"{result.tokens_per_forward:.2f} tokens/forward, {len(result.tokens) / seconds:.1f} tokens/s]"
        )
