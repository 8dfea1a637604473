"""A gated MARS folder on vLLM (`mars_ray.vllm.gated`): vLLM loads the base, the proposer attaches the
folder's adapter; verified greedy text is the base's (vLLM AR and HF greedy `generate` on the base) at
any tau, and lossy requests write what the native lossy decoder writes with the same gated model, so the
adapter is applied at the mask rows exactly as the native `Gate` applies it.

Real vLLM (the CPU build) in this process, tiny random checkpoints of two families written to disk.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_vllm_mars import (
    MAX_MODEL_LEN,
    generate,
    greedy,
    hf_greedy,
    native_lossy,
    prompts,
    write_checkpoint,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_ray import models
from mars_ray.core import gated
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.vllm_engine import replica_engine_args
from mars_ray.vllm import speculative_config
from mars_ray.vllm.config import mars_engine_args
from mars_ray.vllm.gated import engine_args

pytestmark = pytest.mark.slow
vllm = pytest.importorskip("vllm")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_gated(family: str, root) -> tuple[str, str]:
    """(base folder, gated folder on it): the base a MARS-ready random model (its mask token's output row
    the mean of the others, as `prepare` gives a real model), the adapter random and non-zero."""
    base = write_checkpoint(family, root / "base")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base)
    mask_id = tokenizer.mask_token_id
    with torch.no_grad():
        model.lm_head.weight[mask_id] = model.lm_head.weight[:mask_id].mean(dim=0)
    model.config.mask_token_id = mask_id
    model.save_pretrained(base)
    spec = gated.GatedSpec(base=base, r=4, alpha=8.0, target_modules=TARGETS)
    gated.attach(model, spec)
    torch.manual_seed(2)
    with torch.no_grad():
        for tensor in gated.adapter_state(model).values():
            tensor.normal_(0, 0.3)
    folder = root / "gated"
    folder.mkdir()
    gated.save(model, folder)
    tokenizer.save_pretrained(folder)
    return base, str(folder)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folders(request, tmp_path_factory):
    return write_gated(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def engines(folders):
    """vLLM AR on the base, and vLLM with MARS on the gated folder; fp32."""
    base, folder = folders
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    common = dict(dtype="float32", max_model_len=MAX_MODEL_LEN, enforce_eager=True, seed=0)
    ar = vllm.LLM(model=base, **common)
    mars = vllm.LLM(
        **(common | engine_args(folder)),
        speculative_config=speculative_config(folder),
        per_request_spec_decode_metrics="summary",
    )
    yield ar, mars
    del ar, mars


def test_verified_gated_decoding_is_the_bases_greedy_text(engines, folders):
    ar, mars = engines
    base, _ = folders
    batch = prompts(6, seed=5)
    expected = generate(ar, batch, greedy(24))
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert expected == [hf_greedy(hf_base, p, 24) for p in batch]
    for tau in (0.9, 0.5, 0.05):
        assert generate(mars, batch, greedy(24, tau=tau)) == expected


def test_lossy_gated_requests_decode_as_the_native_gated_model(engines, folders):
    """The masks' proposals are the adapter's: accepted unverified they write what the native decoder
    writes with the same gated folder (vLLM's first token is plain greedy; see test_vllm_mars)."""
    ar, mars = engines
    _, folder = folders
    model, tokenizer = models.load(folder, dtype=torch.float32)
    batch = prompts(6, seed=11)
    got = generate(mars, batch, greedy(24, tau=0.5, verify=False))
    assert got == native_lossy(ar, model, tokenizer, batch, 24, tau=0.5)
    assert got != generate(ar, batch, greedy(24))  # the adapter's drafts are not the base's greedy text


def test_engine_args_follow_the_folder(folders):
    """A gated folder runs on its base with the adapter; a trained MARS folder drafts; a base `prepare` gave
    a mask token but no trained B is plain vLLM AR (nothing drafts on it: distill and baselines use it).
    "auto" is the dtype the weights were saved in, as the native engine and `from_pretrained` read it."""
    base, folder = folders
    args = mars_engine_args(folder)
    assert (args["model"], args["tokenizer"], args["enforce_eager"]) == (base, folder, True)
    assert args["hf_overrides"]["mars_gated_adapter"].endswith(gated.WEIGHTS)
    assert mars_engine_args(base)["speculative_config"] == speculative_config(base)
    prepared = models.prepare("tiny")
    assert mars_engine_args(prepared) == {"model": str(prepared), "dtype": "float32"}  # as saved: not vLLM's
    assert mars_engine_args(folder, "bfloat16")["dtype"] == "bfloat16"  # a named dtype passes through


def test_a_vllm_replica_compiles_unless_told_not_to_and_a_gated_folder_runs_eagerly(folders):
    """vLLM's compiled graphs are the replica's default, as `vllm serve`'s (eager mode cost most of a
    replica's gap to a standalone server); `compile: false` is enforce_eager; the gate needs eager steps."""
    base, folder = folders

    def eager(model: str, **fields) -> bool:
        config = ModelConfig(model=model, engine="vllm", **fields)
        return replica_engine_args(config, model, MAX_MODEL_LEN)["enforce_eager"]

    assert not eager(base)
    assert eager(base, compile=False)
    assert eager(folder)


def test_the_vllm_serving_engine_serves_a_gated_folder(engines, folders):
    """`engine: vllm` on a gated folder (the replica's engine, without Serve): verified replies are vLLM AR's
    on the base; lossy ones are the native gated decoder's (the adapter applied in the replica's vLLM)."""
    import asyncio

    from mars_ray.serve.config import ModelConfig
    from mars_ray.serve.protocol import EngineMetrics
    from mars_ray.serve.types import SamplingParams
    from mars_ray.serve.vllm_engine import VllmEngine

    ar, _ = engines
    _, folder = folders
    batch = prompts(3, seed=7)
    config = ModelConfig(
        model=folder, name="gated", engine="vllm", dtype="float32", max_context=MAX_MODEL_LEN
    )

    async def replies(engine, verify: bool) -> list[tuple[list[int], str]]:
        finals = []
        for prompt in batch:
            tokens, mode = [], None
            params = SamplingParams(max_tokens=24, tau=0.5, verify=verify)
            async for chunk in engine.generate(prompt, params):
                tokens, mode = tokens + chunk.token_ids, chunk.mode
            finals.append((tokens, mode))
        return finals

    async def run():
        engine = VllmEngine.load(config, EngineMetrics())
        try:
            return await replies(engine, True), await replies(engine, False)
        finally:
            await engine.close()

    verified, lossy = asyncio.run(run())
    assert verified == [(tokens, "verify") for tokens in generate(ar, batch, greedy(24))]
    model, tokenizer = models.load(folder, dtype=torch.float32)
    assert lossy == [(tokens, "mars") for tokens in native_lossy(ar, model, tokenizer, batch, 24, tau=0.5)]
