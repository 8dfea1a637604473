"""Bad training configs fail before any Ray worker starts (Ray is not even initialised), naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import ray
import torch
from pydantic import ValidationError

from mars_ray.train.config import TrainConfig, load_config
from mars_ray.train.run import check_rerun, run_training


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model: tiny\nsteps: 10\nlr: 1e-3\ndatasets: [tasks]\n")
    config = load_config(path, ["steps=20", "datasets=tasks,chatterbot", "stages=[mars]"])
    assert (config.steps, config.lr, config.datasets, config.stages) == (
        20,
        1e-3,
        ["tasks", "chatterbot"],
        ["mars"],
    )
    assert config.global_batch == config.batch_size * config.grad_accum * config.num_workers
    assert TrainConfig(model="tiny", steps=None, epochs=2, batch_size=4, num_workers=2).total_steps(100) == 25


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({}, "model"),  # required
        ({"model": "/no/such/model"}, "model"),
        ({"model": "tiny", "block_size": 1}, "block_size"),
        ({"model": "tiny", "block_size": 4, "block_offsets": 5}, "block_offsets"),
        ({"model": "tiny", "stages": ["pretrain"]}, "stages"),
        ({"model": "tiny", "lr": -1}, "lr"),
        ({"model": "tiny", "bacth_size": 8}, "bacth_size"),
        ({"model": "tiny", "datasets": []}, "datasets"),
        ({"model": "tiny", "strategy": "zero3"}, "strategy"),
        ({"model": "tiny", "lora": {"r": 0}}, "lora"),
        ({"model": "tiny", "lora": {"rank": 8}}, "lora"),
        ({"model": "tiny", "strategy": "fsdp", "lora": {}}, "lora"),  # LoRA shards nothing worth it
    ],
)
def test_bad_values_name_the_field(values, field):
    with pytest.raises(ValidationError) as error:
        TrainConfig(**values)
    assert error.value.errors()[0]["loc"][0] == field
    assert field in str(error.value)


def test_overrides_must_be_key_value():
    with pytest.raises(ValueError, match="not key=value"):
        load_config(None, ["model=tiny", "steps"])


@pytest.fixture
def no_worker_starts(tmp_path):
    """Neither Ray (unless another test started it) nor a stage's Ray Train run folder comes to life."""
    was_running = ray.is_initialized()
    yield
    assert ray.is_initialized() == was_running
    assert not list(tmp_path.glob("*/ar-sft")) and not list(tmp_path.glob("*/mars"))


def test_bad_data_fails_before_any_worker_starts(tmp_path, no_worker_starts):
    no_messages = tmp_path / "text.jsonl"
    no_messages.write_text(json.dumps({"text": "hello"}) + "\n")
    bad_data = TrainConfig(model="tiny", datasets=["tasks", str(no_messages)], output_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"datasets\[1\]: .* no 'messages' column"):
        run_training(bad_data)
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    with pytest.raises(ValueError, match="datasets: no usable rows"):
        run_training(TrainConfig(model="tiny", datasets=[str(empty)], output_dir=str(tmp_path)))


def test_a_rerun_must_keep_the_config(tmp_path, no_worker_starts):
    config = dict(model="tiny", datasets=["tasks"], tasks_count=20, output_dir=str(tmp_path), name="r")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.yaml").write_text(
        json.dumps(TrainConfig(**config, lr=1e-3).model_dump())  # JSON is YAML
    )
    with pytest.raises(ValueError, match="other values for lr"):
        run_training(TrainConfig(**config, lr=2e-3))


def test_a_rerun_may_move_to_other_workers_with_the_same_global_batch(tmp_path):
    config = dict(model="tiny", datasets=["tasks"], output_dir=str(tmp_path), name="r", strategy="fsdp")
    check_rerun(TrainConfig(**config, num_workers=2, batch_size=4))
    check_rerun(TrainConfig(**config, num_workers=1, batch_size=4, grad_accum=2, cpus_per_worker=2))
    with pytest.raises(ValueError, match="other values for cpus_per_worker, grad_accum"):
        check_rerun(TrainConfig(**config, num_workers=1, batch_size=4))  # 4 examples a step, no longer 8


def test_auto_precision_is_bf16_only_where_it_is_native(monkeypatch):
    config = TrainConfig(model="tiny")
    assert config.autocast_dtype("cuda") == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert config.autocast_dtype("cpu") is None  # emulated bf16 would be slower than fp32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert config.autocast_dtype("cpu") == torch.bfloat16
    assert TrainConfig(model="tiny", precision="fp32").autocast_dtype("cuda") is None
    assert TrainConfig(model="tiny", precision="bf16").autocast_dtype("cpu") == torch.bfloat16


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")), ids=str)
def test_every_shipped_config_validates(path):
    load_config(path)
