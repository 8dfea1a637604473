"""Gated MARS adapters: the user's model, kept exactly. With a random non-zero adapter, every real token is
the base model's bit for bit, mask positions are not, and tau = 1 and verified decoding write the base
model's HF greedy text; a gated run trains, resumes and loads through `models.load`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import EOS_ID, MASK_ID, PAD_ID, build_tiny, random_prompts
from test_decoding import hf_greedy
from test_learning import copy_task
from test_lora import tokens_per_forward, train
from test_serve_engine import collect
from test_train_ray import (
    attempts,
    kill_a_worker_after_each_new_checkpoint,
    local_ray,  # noqa: F401 (the module's Ray cluster fixture)
    logged_steps,
    small_config,
)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from mars_ray import data, models
from mars_ray.core import gated
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.objective import ScoredLM, ar_loss, collate_ar, collate_mars, mars_loss
from mars_ray.core.reference import decode_reference
from mars_ray.data import chat_prompt_ids
from mars_ray.serve.config import ModelConfig
from mars_ray.serve.engine import Engine
from mars_ray.serve.types import SamplingParams
from mars_ray.train import lora
from mars_ray.train.config import LoraSettings
from mars_ray.train.run import run_training
from mars_ray.train.steps import (
    TRAINER_STATE,
    Objective,
    accumulate_gradients,
    save_checkpoint,
    verify_checkpoint,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def spec(**fields) -> gated.GatedSpec:
    return gated.GatedSpec(**{"base": "tiny", "r": 4, "alpha": 8.0, "target_modules": TARGETS} | fields)


def mars_ready(family: str, dtype=torch.float64):
    """A tiny model whose mask token's output row is the mean of the others, as `prepare_for_mars` gives a
    real model: a random row could make the base write the mask token itself."""
    model = build_tiny(family, dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight[MASK_ID] = model.lm_head.weight[:MASK_ID].mean(dim=0)
    model.config.mask_token_id = MASK_ID
    return model


def gated_twin(family: str, dtype=torch.float64, trainable: bool = False, stacked: bool = True):
    """(base, the same base with a random non-zero gated adapter), stacked for decoding unless it trains."""
    base, twin = mars_ready(family, dtype), mars_ready(family, dtype)
    gated.attach(twin, spec(), trainable)
    torch.manual_seed(1)
    with torch.no_grad():
        for tensor in gated.adapter_state(twin).values():
            tensor.normal_(0, 0.5)
    if stacked and not trainable:
        gated.stack(twin)
    return base, twin


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_real_tokens_are_the_base_models_bit_for_bit_masks_are_not(family, dtype):
    base, twin = gated_twin(family, dtype)
    # real tokens, then masks, as every decoder lays a window out (a real token after a mask would attend to
    # it, as in any causal LM: no decoder puts one there)
    ids = torch.tensor([[5, 17, 33, 8, MASK_ID, MASK_ID, MASK_ID], [9, 4, 4, 60, 3, 21, MASK_ID]])
    with torch.no_grad():
        expected, got = base(input_ids=ids).logits, twin(input_ids=ids).logits
    real = ids != MASK_ID
    assert torch.equal(got[real], expected[real])
    differs = (got != expected).any(dim=-1)
    assert differs[~real].all()
    # a forward without masks is the base model everywhere, and the gate forgets the last forward's masks
    plain = torch.tensor([[5, 17, 33, 12, 40]])
    with torch.no_grad():
        assert torch.equal(twin(input_ids=plain).logits, base(input_ids=plain).logits)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoding_stacks_the_deltas_that_read_one_input_and_computes_what_each_layer_would(family):
    """`stack`: q/k/v and gate/up as one delta each, o and down alone (4 a layer), each one's A folded into
    its first layer (q, gate, o, down); the mask rows' logits are the layers' own deltas' up to rounding, the
    real rows the base's bit for bit. Decode steps (many masks) run the folded deltas on every row, a
    prompt's forward (a few masks) on the mask rows only: both, here."""
    base, stacked = gated_twin(family)
    _, layered = gated_twin(family, stacked=False)
    layers = stacked.config.num_hidden_layers
    assert len(stacked.mars_gate.stacks) == 4 * layers and not layered.mars_gate.stacks
    folded = {name.rsplit(".", 1)[-1] for name, m in stacked.named_modules() if getattr(m, gated.FOLDED, 0)}
    assert folded == {"q_proj", "gate_proj", "o_proj", "down_proj"}
    assert not any(hasattr(group, "A") for group in stacked.mars_gate.stacks)
    steps = torch.tensor([[5, 17, 33, 8, MASK_ID, MASK_ID], [9, 4, 60, MASK_ID, MASK_ID, MASK_ID]])
    prompt = torch.tensor([[5, 17, 33, 8, 40, 21, 9, 4, 60, 12, MASK_ID, MASK_ID]])
    for ids in (steps, prompt):
        with torch.no_grad():
            got, expected = stacked(input_ids=ids).logits, layered(input_ids=ids).logits
            plain = base(input_ids=ids).logits
        real = ids != MASK_ID
        assert torch.equal(got[real], plain[real])
        torch.testing.assert_close(got[~real], expected[~real], rtol=1e-10, atol=1e-10)
        assert (got[~real] != plain[~real]).any(dim=-1).all()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tau_one_and_verified_decoding_write_the_base_models_greedy_text(family):
    base, twin = gated_twin(family)
    prompts = random_prompts(6, seed=3)
    with torch.no_grad():
        expected = hf_greedy(base, prompts, 16)
        assert not any(MASK_ID in row for row in expected)
        assert hf_greedy(twin, prompts, 16) == expected  # HF generate on the gated model: real tokens only
    stop = (EOS_ID,)
    exact = DecodeConfig(tau=1.0, max_new_tokens=16, stop_token_ids=stop)
    assert [r.tokens for r in decode_cached(twin, prompts, MASK_ID, exact)] == expected
    for tau in (0.9, 0.5, 0.05):  # 0.05: the mask slots draft at almost every forward
        config = DecodeConfig(tau=tau, block_size=4, max_new_tokens=16, stop_token_ids=stop, verify=True)
        results = decode_cached(twin, prompts, MASK_ID, config)
        assert [r.tokens for r in results] == expected
    assert sum(sum(r.drafted) for r in results) > 0
    # the masks are the adapter's: unverified, they write other text, the same through the reference decoder
    loose = DecodeConfig(tau=0.05, block_size=4, max_new_tokens=16, stop_token_ids=stop)
    drafted = [r.tokens for r in decode_cached(twin, prompts, MASK_ID, loose)]
    assert drafted != expected
    assert [decode_reference(twin, p, MASK_ID, loose).tokens for p in prompts] == drafted


@pytest.mark.slow
def test_compiled_steps_keep_the_gate():
    """`compile_steps` on a gated model (the engine's `compile`): the gate's hooks run inside the compiled
    forward, so every step states its own mask positions; the same tokens as eager, exact and drafted."""
    from mars_ray.core.compile import compile_steps

    _, eager = gated_twin("llama", torch.float32)
    _, compiled = gated_twin("llama", torch.float32)
    compile_steps(compiled)
    torch._dynamo.utils.counters.clear()
    prompts = random_prompts(4, seed=5)
    for tau, verify in ((1.0, False), (0.3, True), (0.3, False)):
        config = DecodeConfig(tau=tau, block_size=4, max_new_tokens=12, stop_token_ids=(EOS_ID,))
        config = replace(config, verify=verify)
        expected = [r.tokens for r in decode_cached(eager, prompts, MASK_ID, config)]
        assert [r.tokens for r in decode_cached(compiled, prompts, MASK_ID, config)] == expected
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the steps did run compiled


def test_a_gated_model_refuses_a_forward_without_input_ids(tiny_llama):
    _, twin = gated_twin("llama")
    with pytest.raises(ValueError, match="input_ids"):
        twin(inputs_embeds=torch.zeros((1, 3, 64), dtype=torch.float64))
    with pytest.raises(ValueError, match="already"):
        gated.attach(twin, spec())


def test_the_gated_step_is_the_noisy_loss_of_one_joined_forward_without_the_clean_graph():
    """`Objective.loss_sums` on a gated model runs the clean stream on its own, under no_grad, and attends
    to its cache: the same noisy loss and adapter gradients as the joined [noisy | clean] forward, no clean
    loss, and no gradient for any base weight."""
    examples = copy_task(6, seed=2)
    objective = Objective("mars", 4, 1.0, MASK_ID, PAD_ID, EOS_ID, offsets=(0, 2))
    _, twin = gated_twin("llama", trainable=True)
    split = objective.loss_sums(ScoredLM(twin), examples, "cpu")
    split["total"].backward()
    grads = {name: p.grad.clone() for name, p in twin.named_parameters() if p.requires_grad}
    twin.zero_grad()
    joined = collate_mars(examples, 4, MASK_ID, PAD_ID, EOS_ID, offsets=(0, 2))
    loss = mars_loss(ScoredLM(twin)(**joined.model_inputs()), joined, ar_weight=0.0)
    (loss.total * len(examples)).backward()
    torch.testing.assert_close(split["total"], loss.noisy * len(examples))
    assert split["clean"] == 0 and loss.clean > 0
    assert grads and set(grads) == {name for name, p in twin.named_parameters() if p.grad is not None}
    assert all(n.startswith(gated.GATE) or gated.DELTA in n for n in grads)
    for name, parameter in twin.named_parameters():
        if name in grads:
            torch.testing.assert_close(grads[name], parameter.grad)


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer for the tiny models' ids, its mask token at MASK_ID (as a MARS folder's tokenizer has)."""
    vocab = {"<pad>": PAD_ID, "<bos>": 1, "<eos>": EOS_ID, "<mask>": MASK_ID}
    vocab |= {f"t{i}": i for i in range(3, MASK_ID)}
    backend = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", mask_token="<mask>"
    )


def fingerprint(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def instruct(tmp_path_factory) -> Path:
    """The user's model: an AR model that learned the copy task, in a folder with its tokenizer."""
    torch.manual_seed(0)
    model = build_tiny("llama", sharpness=1.0, dtype=torch.float32).train()

    def ar(examples):
        batch = collate_ar(examples, PAD_ID)
        return ar_loss(ScoredLM(model)(**batch.model_inputs()), batch)

    train(model, ar, copy_task(4000, seed=0), 300, 3e-3)
    folder = tmp_path_factory.mktemp("instruct")
    model.save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def gated_steps(adapted, objective: Objective, optimizer, steps: range) -> None:
    """MARS steps of a gated adapter through the training loop's own step (`accumulate_gradients`)."""
    scored = ScoredLM(adapted.get_base_model())
    examples = copy_task(4000, seed=0)
    for step in steps:
        batch = examples[(step * 16) % len(examples) :][:16]
        accumulate_gradients(scored, objective, [batch], objective.normaliser(batch), 1, torch.device("cpu"))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.slow  # ~500 training steps in one process
def test_a_gated_run_learns_resumes_and_loads_as_the_users_model_plus_drafts(instruct, tmp_path):
    """Gated MARS on the user's model, a checkpoint half way, resumed from it in a fresh model, exported:
    `models.load` of final/ gives the base with the gate, whose verified decoding writes exactly what HF
    `generate` writes with the untouched base (loaded by plain transformers), several tokens per forward."""
    untouched = fingerprint(instruct)
    settings = LoraSettings(r=8, alpha=16, gated=True)
    objective = Objective("mars", 4, 1.0, MASK_ID, PAD_ID, EOS_ID)

    def start(saved: Path | None = None):
        torch.manual_seed(0)
        model, tokenizer = models.load(str(instruct), dtype=torch.float32)
        adapted = lora.with_adapters(model, settings, saved).train()
        adapted.get_base_model().config.mars_block_size = 4  # as the loop sets it for stage mars
        trainable = [p for p in adapted.get_base_model().parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=3e-3)
        return adapted, tokenizer, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    adapted, tokenizer, optimizer, scheduler = start()
    gated_steps(adapted, objective, optimizer, range(0, 100))
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(checkpoint, adapted, tokenizer, optimizer, scheduler, 100)
    assert verify_checkpoint(checkpoint) == 100
    saved = gated.adapter_state(adapted.get_base_model())

    resumed, tokenizer, optimizer, scheduler = start(checkpoint)
    optimizer.load_state_dict(torch.load(checkpoint / TRAINER_STATE)["optimizer"])
    state = gated.adapter_state(resumed.get_base_model(), keep_vars=True)
    assert set(state) == set(saved) and all(torch.equal(state[k], saved[k]) for k in saved)
    assert all(p.requires_grad for p in state.values())
    gated_steps(resumed, objective, optimizer, range(100, 250))
    resumed.save_pretrained(tmp_path / "final-adapter")
    tokenizer.save_pretrained(tmp_path / "final-adapter")
    lora.export(tmp_path / "final-adapter", str(instruct), tmp_path / "final", 4)

    final = tmp_path / "final"
    assert fingerprint(instruct) == untouched
    with pytest.raises(OSError):  # no weights in a gated folder: never a model without its gate
        AutoModelForCausalLM.from_pretrained(final)
    model, tokenizer = models.load(str(final))
    assert gated.is_gated(model) and model.config.mars_block_size == 4
    assert gated.read_spec(final).base == str(instruct.resolve())
    base = AutoModelForCausalLM.from_pretrained(instruct).eval()  # plain transformers: the user's model
    held_out = [e.input_ids[:9] for e in copy_task(24, seed=1)]
    with torch.no_grad():
        expected = hf_greedy(base, held_out, 12)
    for tau in (1.0, 0.9, 0.5):
        config = DecodeConfig.for_model(model, tokenizer, tau=tau, max_new_tokens=12, verify=True)
        results = decode_cached(model, held_out, tokenizer.mask_token_id, config, tokenizer.pad_token_id)
        assert [r.tokens for r in results] == expected
        if tau == 0.9:
            print(f"gated verified tokens per forward at tau=0.9: {tokens_per_forward(results):.2f}")
            assert tokens_per_forward(results) > 1.3


def test_the_serving_engine_serves_a_gated_folder_as_the_base_models_greedy_text(tmp_path):
    """A gated folder on the `tiny` preset (a random non-zero adapter, calibrated temperatures in its
    config.json), loaded by the engine as it loads any model (`Engine.load`, i.e. `models.load`), drafts at
    its mask slots with the adapter, and its verified requests at tau 0.3 write the text HF `generate`
    writes with the untouched base."""
    model, tokenizer = models.load("tiny")
    gated.attach(model, gated.GatedSpec(models.resolve("tiny"), 4, 8.0, ["q_proj", "v_proj", "up_proj"]))
    torch.manual_seed(0)
    with torch.no_grad():
        for tensor in gated.adapter_state(model).values():
            tensor.normal_(0, 0.5)
    gated.save(model, tmp_path)
    tokenizer.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())  # as `mars-ray calibrate --write` does
    stored["mars_slot_temperatures"] = [1.0, 1.5, 2.0, 2.0]
    (tmp_path / "config.json").write_text(json.dumps(stored))
    base = AutoModelForCausalLM.from_pretrained(models.resolve("tiny")).eval()
    asks = [[{"role": "user", "content": f"Count from {i} to 9."}] for i in (1, 2)]
    prompts = [chat_prompt_ids(tokenizer, ask) for ask in asks]

    async def run():
        engine = Engine.load(ModelConfig(model=str(tmp_path), verify=True, tau=0.3, max_batch_size=2))
        window = torch.tensor([prompts[0] + [tokenizer.mask_token_id] * 3])
        with torch.no_grad():
            drafts, plain = engine.model(input_ids=window).logits[0], base(input_ids=window).logits[0]
        assert torch.equal(drafts[:-3], plain[:-3]) and (drafts[-3:] != plain[-3:]).any(dim=-1).all()
        done = await asyncio.gather(*[collect(engine, p, SamplingParams(max_tokens=12)) for p in prompts])
        await engine.close()
        return done

    done = asyncio.run(run())
    greedy = []
    for prompt in prompts:
        with torch.no_grad():
            out = base.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12)
        greedy.append(tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True))
    assert [text for text, _ in done] == greedy
    assert all(last.mode == "verify" for _, last in done)


@pytest.mark.slow  # Ray Train fits
@pytest.mark.usefixtures("local_ray")
def test_a_gated_ray_run_resumes_after_a_worker_dies_and_final_is_the_base_plus_its_gate(tmp_path):
    """`lora.gated` on 2 DDP workers, one killed after the first checkpoint: the run resumes from the gated
    checkpoint; final/ names the untouched base, holds no weights of it, and loads (`models.load`) as the
    base with its gate, whose verified decoding writes exactly the base's HF greedy text."""
    config = small_config(
        tmp_path, "gated", stages=["mars"], steps=9, max_failures=1, lora={"r": 4, "alpha": 8, "gated": True}
    )
    killer = kill_a_worker_after_each_new_checkpoint(config, "mars", kills=1)
    final = run_training(config)["mars"]
    killer.join(timeout=5)
    steps = logged_steps(config, "mars")
    groups = attempts(steps)
    assert len(groups) == 2 and groups[1][0]["resumed_from"] == 3 and groups[1][-1]["step"] == 9
    assert all(s["clean_loss"] == 0 and s["noisy_loss"] > 0 for s in steps)

    spec = gated.read_spec(final)
    assert spec.base == models.resolve("tiny") and (spec.r, spec.alpha) == (4, 8.0)
    assert not list(final.glob("model*.safetensors")) and not (final / "trainer_state.pt").exists()
    with pytest.raises(OSError):
        AutoModelForCausalLM.from_pretrained(final)
    model, tokenizer = models.load(str(final), dtype=torch.float64)
    assert gated.is_gated(model) and model.config.mars_block_size == 4
    base = AutoModelForCausalLM.from_pretrained(spec.base, dtype=torch.float64).eval()
    prompts = [chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in data.verifiable_tasks("heldout", 4)]
    eos = tokenizer.eos_token_id
    config = DecodeConfig.for_model(model, tokenizer, tau=0.5, max_new_tokens=16, verify=True)
    for prompt in prompts:
        with torch.no_grad():
            greedy = base.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        (result,) = decode_cached(model, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)
        assert result.tokens == greedy
