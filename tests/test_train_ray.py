"""Training on a real local Ray cluster: both stages on 2 workers, plain-transformers reload, tau=1 equals
greedy `generate`, DDP equals the joined batch, and resuming after workers die (slow: Ray Train fits)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import ray
import ray.train
import ray.train.torch
import torch
from ray.util.state import list_actors
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from mars_ray import data, models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.objective import ScoredLM, ar_loss, collate_ar, collate_mars, mars_loss
from mars_ray.train import sharding
from mars_ray.train.config import TrainConfig
from mars_ray.train.run import run_training
from mars_ray.train.steps import (
    IncompleteCheckpoint,
    Objective,
    accumulate_gradients,
    sum_over_workers,
    verify_checkpoint,
    worker_micro_batches,
)

pytestmark = pytest.mark.slow

TESTS = Path(__file__).parent
DASHBOARD_PORT = 8273


@pytest.fixture(scope="module")
def local_ray():
    """One in-process cluster for the module (a fit costs ~35 s of start-up: share it).

    `address="local"` never joins someone else's cluster; the dashboard (own port) serves the state API
    used to find workers to kill; workers import this module for the DDP test's train function.
    """
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=True,
        dashboard_port=DASHBOARD_PORT,
        runtime_env={"env_vars": {"PYTHONPATH": str(TESTS)}},
    )
    yield
    ray.shutdown()


def small_config(tmp_path: Path, name: str, **overrides) -> TrainConfig:
    values = dict(
        model="tiny",
        datasets=["tasks", "chatterbot"],
        tasks_count=300,
        max_length=64,
        name=name,
        output_dir=str(tmp_path),
        steps=6,
        batch_size=4,
        lr=1e-3,
        checkpoint_every=3,
        num_workers=2,
    )
    return TrainConfig(**{**values, **overrides})


def logged_steps(config: TrainConfig, stage: str) -> list[dict]:
    path = config.run_dir / stage / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def two_stage_run(local_ray, tmp_path_factory):
    config = small_config(tmp_path_factory.mktemp("runs"), "e2e")
    return config, run_training(config)


def test_both_stages_run_on_two_workers(two_stage_run):
    config, finals = two_stage_run
    assert list(finals) == ["ar-sft", "mars"]
    for stage in finals:
        steps = logged_steps(config, stage)
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
        assert [s["step"] for s in steps if s["checkpoint"]] == [3, 6]
        assert all(s["tokens_per_s"] > 0 and s["lr"] > 0 and s["loss"] > 0 for s in steps)
        assert all(100 < s["peak_memory_mb"] < 8192 for s in steps)  # a worker process, in MB
    mars = logged_steps(config, "mars")[0]
    assert mars["loss"] == pytest.approx(mars["noisy_loss"] + config.ar_weight * mars["clean_loss"])
    report = json.loads((config.run_dir / "data_report.json").read_text())
    assert [r["source"] for r in report] == ["tasks", "chatterbot"]
    assert report[1]["skipped"]["prompt fills max_length"] > 0  # some dialogs are long


def test_final_folder_loads_in_plain_transformers_and_tau_1_is_greedy(two_stage_run):
    _, finals = two_stage_run
    folder = finals["mars"]
    assert (folder / "model.safetensors").exists() and not (folder / "trainer_state.pt").exists()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()  # no project code
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.mask_token == "<|mask|>"
    assert model.config.mars_block_size == 4  # the window decoders default to
    assert (
        tokenizer.mask_token_id == model.config.mask_token_id < model.get_input_embeddings().weight.shape[0]
    )

    prompts = [
        data.chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in data.verifiable_tasks("heldout", 6)
    ]
    config = DecodeConfig(tau=1.0, max_new_tokens=16, stop_token_ids=(tokenizer.eos_token_id,))
    mars = decode_cached(model, prompts, tokenizer.mask_token_id, config, tokenizer.pad_token_id)
    for prompt, result in zip(prompts, mars, strict=True):
        with torch.no_grad():
            greedy = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        assert result.tokens == greedy


def test_rerunning_a_finished_run_skips_its_stages(two_stage_run):
    config, finals = two_stage_run
    began = time.perf_counter()
    assert run_training(config) == finals
    assert time.perf_counter() - began < 30  # no Ray Train fit
    assert len(logged_steps(config, "mars")) == 6


def attempts(steps: list[dict]) -> list[list[dict]]:
    """The log cut where a new worker group took over: it names the checkpoint it resumed from, and starts
    again after it (a group that fell back to the same checkpoint as the one before it is told by that)."""
    pairs = zip(steps, steps[1:], strict=False)
    cuts = [
        i
        for i, (before, after) in enumerate(pairs, start=1)
        if after["resumed_from"] != before["resumed_from"] or after["step"] <= before["step"]
    ]
    return [steps[a:b] for a, b in zip([0, *cuts], [*cuts, len(steps)], strict=True)]


def kill_a_worker_after_each_new_checkpoint(config: TrainConfig, stage: str, kills: int) -> threading.Thread:
    """SIGKILL one Ray Train worker once the current worker group has logged a checkpoint, `kills` times."""

    def current_group_checkpointed(kill: int) -> bool:
        groups = attempts(logged_steps(config, stage))
        return len(groups) == kill + 1 and any(s["checkpoint"] for s in groups[-1])

    def run() -> None:
        for kill in range(kills):
            while not current_group_checkpointed(kill):
                time.sleep(0.05)
            workers = list_actors(
                address=f"http://127.0.0.1:{DASHBOARD_PORT}",
                filters=[("class_name", "=", "RayTrainWorker"), ("state", "=", "ALIVE")],
            )
            os.kill(workers[0].pid, signal.SIGKILL)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def flip_a_byte(path: Path) -> None:
    data = path.read_bytes()
    middle = len(data) // 2
    path.write_bytes(data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :])


def test_resume_after_worker_deaths_a_damaged_checkpoint_and_a_rerun(local_ray, tmp_path):
    """The first death is absorbed by `FailureConfig` (max_failures=1); the second fails the run. The newest
    checkpoint is then damaged on storage (a bit flipped: it no longer matches its manifest), so the rerun
    of the same name refuses it and resumes from the previous kept one. Each group restarts from the newest
    whole checkpoint, nothing earlier, and every step's loss, in every attempt, is the loss of the same
    step in an uninterrupted run: the model, AdamW's states and the schedule came back whole."""
    layout = dict(datasets=["tasks"], stages=["ar-sft"], steps=15, checkpoint_every=3)
    reference = small_config(tmp_path, "reference", **layout)
    run_training(reference)
    uninterrupted = {s["step"]: s["loss"] for s in logged_steps(reference, "ar-sft")}
    config = small_config(tmp_path, "resume", max_failures=1, **layout)
    killer = kill_a_worker_after_each_new_checkpoint(config, "ar-sft", kills=2)
    with pytest.raises(ray.train.TrainingFailedError):
        run_training(config)
    killer.join(timeout=5)
    assert not killer.is_alive()
    previous, newest = sorted((config.run_dir / "ar-sft").glob("checkpoint_0*"))  # keep_checkpoints=2
    fallback = verify_checkpoint(previous)
    flip_a_byte(newest / "model.safetensors")
    with pytest.raises(IncompleteCheckpoint, match="model.safetensors differs"):
        verify_checkpoint(newest)

    finals = run_training(config)

    groups = attempts(logged_steps(config, "ar-sft"))
    assert len(groups) == 3
    restarted = max(s["step"] for s in groups[0] if s["checkpoint"])
    assert groups[1][0]["resumed_from"] == restarted and groups[1][0]["step"] == restarted + 1
    assert groups[2][0]["resumed_from"] == fallback < int(newest.name.split("_")[1])
    assert groups[2][0]["step"] == fallback + 1
    assert groups[-1][-1]["step"] == 15 and groups[-1][-1]["checkpoint"]
    for group in groups:
        for step in group:
            assert step["loss"] == pytest.approx(uninterrupted[step["step"]], rel=1e-5), step["step"]
    kept = sorted((config.run_dir / "ar-sft").glob("checkpoint_0*"))
    assert [verify_checkpoint(folder) for folder in kept] == [12, 15]  # the refused one was pruned
    assert (finals["ar-sft"] / "model.safetensors").exists()


def one_distributed_step(loop_config: dict) -> None:
    """On each worker: its share of one global batch (2 micro-steps), forward and backward under DDP or FSDP;
    rank 0 saves the losses and the full gradients (gathered from the shards under FSDP)."""
    rank, world_size = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    batch = loop_config["batch"]
    for stage in ("ar-sft", "mars"):
        model, tokenizer = models.load("tiny", dtype=torch.float32)
        if loop_config["strategy"] == "fsdp":
            wrapped = sharding.shard(ScoredLM(model), torch.device("cpu"), world_size, None)
        else:
            wrapped = ray.train.torch.prepare_model(ScoredLM(model))
        objective = Objective(
            stage, 4, 1.0, tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id
        )
        shares = worker_micro_batches(range(len(batch)), rank, world_size, grad_accum=2)
        micro_batches = [[batch[i] for i in share] for share in shares]
        losses = accumulate_gradients(
            wrapped, objective, micro_batches, objective.normaliser(batch), world_size, torch.device("cpu")
        )
        losses = sum_over_workers(losses, torch.device("cpu"))
        grads = {
            name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in model.named_parameters()
        }
        if rank == 0:
            torch.save({"losses": losses, "grads": grads}, Path(loop_config["out"]) / f"{stage}.pt")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_distributed_step_equals_one_process_on_the_joined_batch(local_ray, tmp_path, strategy):
    """Two workers, each its share of the batch in two micro-steps: DDP (gradients all-reduced) and FSDP
    (sharded, reduce-scattered) both give the loss and gradients of one process on the joined batch."""
    model, tokenizer = models.load("tiny", dtype=torch.float32)
    rows = data.load_chats("tasks", tasks_count=8)
    batch, _ = data.tokenize_chats(rows, tokenizer, 64, "tasks")  # unequal lengths and token counts
    trainer = ray.train.torch.TorchTrainer(
        one_distributed_step,
        train_loop_config={"batch": batch, "out": str(tmp_path), "strategy": strategy},
        scaling_config=ray.train.ScalingConfig(num_workers=2),
        run_config=ray.train.RunConfig(name=strategy, storage_path=str(tmp_path)),
    )
    trainer.fit()

    for stage in ("ar-sft", "mars"):
        model.zero_grad()
        if stage == "ar-sft":
            joined = collate_ar(batch, tokenizer.pad_token_id)
            loss = ar_loss(ScoredLM(model)(**joined.model_inputs()), joined)
        else:
            joined = collate_mars(
                batch, 4, tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id
            )
            loss = mars_loss(ScoredLM(model)(**joined.model_inputs()), joined).total
        loss.backward()
        distributed = torch.load(tmp_path / f"{stage}.pt")
        assert distributed["losses"]["total"] == pytest.approx(loss.item(), rel=1e-5)
        for name, parameter in model.named_parameters():
            torch.testing.assert_close(distributed["grads"][name], parameter.grad, rtol=1e-4, atol=1e-6)


def test_lora_run_resumes_from_adapter_checkpoints_and_exports_merged_and_unmerged(local_ray, tmp_path):
    """A LoRA MARS run whose worker dies after a checkpoint resumes from the adapter it saved; final/ is a
    plain transformers folder, final-adapter/ the same model as a peft adapter on the untouched base."""
    config = small_config(
        tmp_path, "lora", stages=["mars"], steps=9, max_failures=1, lora={"r": 4, "alpha": 8}
    )
    killer = kill_a_worker_after_each_new_checkpoint(config, "mars", kills=1)
    finals = run_training(config)
    killer.join(timeout=5)
    groups = attempts(logged_steps(config, "mars"))
    assert len(groups) == 2 and groups[1][0]["resumed_from"] == 3 and groups[1][-1]["step"] == 9

    final, adapter = finals["mars"], finals["mars"].with_name("final-adapter")
    assert (adapter / "adapter_config.json").exists() and not (adapter / "trainer_state.pt").exists()
    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float64).eval()  # no peft
    assert merged.config.mars_block_size == 4
    assert not any("lora" in name for name in merged.state_dict())
    base, tokenizer = models.load("tiny", dtype=torch.float64)
    moved = [n for n, p in base.state_dict().items() if not torch.equal(p, merged.state_dict()[n])]
    assert "model.embed_tokens.weight" in moved and any("q_proj" in n for n in moved)
    assert not any("norm" in n for n in moved)  # only adapted layers and the mask row

    from peft import PeftModel

    unmerged = PeftModel.from_pretrained(base, adapter).eval()
    prompts = [
        data.chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in data.verifiable_tasks("heldout", 4)
    ]
    config = DecodeConfig(tau=1.0, max_new_tokens=16, stop_token_ids=(tokenizer.eos_token_id,))
    for prompt in prompts:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            # final/ merged W + BA in the run's fp32; the unmerged model adds BA in fp64
            torch.testing.assert_close(unmerged(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
            greedy = merged.generate(
                ids,
                do_sample=False,
                max_new_tokens=16,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[0, len(prompt) :].tolist()
        (result,) = decode_cached(merged, [prompt], tokenizer.mask_token_id, config, tokenizer.pad_token_id)
        assert result.tokens == greedy


def test_fsdp_run_resumes_from_sharded_checkpoints_on_fewer_workers_and_matches_ddp(local_ray, tmp_path):
    """FSDP on 2 workers, a worker killed after the first checkpoint (no restarts: the run fails); the
    rerun on 1 worker with the same global batch reshards the checkpoint and finishes. Every step's loss is
    the loss of an uninterrupted DDP run of the same config, so nothing of the model, AdamW's states or
    the schedule was lost in the shards; final/ is a plain transformers folder."""
    layout = dict(stages=["mars"], datasets=["tasks"], steps=8, checkpoint_every=3, max_failures=0)
    reference = small_config(tmp_path, "ddp", **layout)
    run_training(reference)
    config = small_config(tmp_path, "fsdp", strategy="fsdp", **layout)
    killer = kill_a_worker_after_each_new_checkpoint(config, "mars", kills=1)
    with pytest.raises(ray.train.TrainingFailedError):
        run_training(config)
    killer.join(timeout=5)
    (checkpoint,) = (config.run_dir / "mars").glob("checkpoint_000003")
    shards = sorted(p.name for p in (checkpoint / sharding.SHARDS).iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (checkpoint / "checkpoint.rank1.json").exists() and not (checkpoint / "model.safetensors").exists()

    resumed = config.model_copy(update={"num_workers": 1, "batch_size": 8})
    finals = run_training(resumed)
    groups = attempts(logged_steps(config, "mars"))
    assert groups[-1][0]["resumed_from"] == 3 and groups[-1][-1]["step"] == 8
    by_step = {s["step"]: s for group in groups for s in group}  # the resumed steps replace the lost ones
    # FSDP and DDP reduce in different orders, and AdamW turns fp32 rounding into a drift that grows with
    # the steps (measured on this config: 2e-6 relative at step 2, before any resume, 1.2e-4 at step 8); a
    # lost model shard, AdamW state or schedule moves the loss far more than that.
    for expected in logged_steps(reference, "mars"):
        assert by_step[expected["step"]]["loss"] == pytest.approx(expected["loss"], rel=1e-3)

    final = finals["mars"]
    assert not [p for p in final.iterdir() if "checkpoint" in p.name or p.name == sharding.SHARDS]
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)  # no project code
    ddp = AutoModelForCausalLM.from_pretrained(run_training(reference)["mars"], dtype=torch.float32)
    # Not weight by weight: where a gradient is ~0, summation order flips its sign and AdamW moves that
    # weight by +-lr either way. The function the weights compute agrees.
    ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ddp(ids).logits, rtol=0, atol=1e-2)
