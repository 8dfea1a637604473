"""`mars-ray distill`: the model's own greedy replies, written as a dataset training accepts, resumable."""

from __future__ import annotations

import json

import pytest
import ray

from mars_ray import data, models
from mars_ray.core.decode_config import DecodeConfig
from mars_ray.core.decoder import decode_cached
from mars_ray.core.errors import ConfigError
from mars_ray.distill import DistillConfig, distill, prompt_turns
from mars_ray.train.config import TrainConfig
from mars_ray.train.run import prepare_data


@pytest.fixture(scope="module")
def local_ray():
    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def rows_of(folder) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("shard-*.jsonl")) for line in path.open()]


def test_prompt_turns():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert prompt_turns(chat) == chat[:1]  # the reply is replaced
    assert prompt_turns(chat[:1]) == chat[:1]  # a chat that ends on the user is a prompt as it is
    assert prompt_turns([]) is None and prompt_turns(None) is None
    assert prompt_turns([{"role": "assistant", "content": "x"}]) is None


def test_chatterbot_prompts_never_hold_another_splits_text():
    held_out = {m["content"] for r in data.chatterbot_dialogs("heldout") for m in r["messages"]}
    prompts = data.chatterbot_prompts("train")
    assert len(prompts) > 1000
    assert not held_out & {p["messages"][0]["content"] for p in prompts}
    assert all(len(p["messages"]) == 1 and p["messages"][0]["role"] == "user" for p in prompts)


@pytest.mark.slow
def test_distill_writes_greedy_replies_resumably(local_ray, tmp_path):
    config = DistillConfig(
        model="tiny",
        prompts=["tasks", "chatterbot-prompts"],
        tasks_count=10,
        limit=24,
        shard_size=10,
        max_new_tokens=12,
        batch_size=8,
        output=str(tmp_path / "distilled"),
    )
    folder = distill(config)
    rows = rows_of(folder)
    assert len(rows) == 24 and len(list(folder.glob("shard-*.jsonl"))) == 3
    assert {r["source"] for r in rows} == {"chatterbot-prompts", "tasks"}

    # every reply is the model's greedy (tau = 1) reply to its prompt, cut at the token budget
    model, tokenizer = models.load("tiny")
    prompts = [data.chat_prompt_ids(tokenizer, r["messages"][:-1]) for r in rows]
    greedy = decode_cached(
        model,
        prompts,
        tokenizer.mask_token_id,
        DecodeConfig.for_model(model, tokenizer, tau=1.0, max_new_tokens=12),
        tokenizer.pad_token_id,
    )
    for row, result in zip(rows, greedy, strict=True):
        assert row["messages"][-1] == {
            "role": "assistant",
            "content": tokenizer.decode(result.tokens, skip_special_tokens=True).strip(),
        }
        assert row["complete"] == (result.finish_reason == "stop")
        assert row["completion_tokens"] == len(result.tokens)

    # a rerun redoes only the missing shard
    (folder / "shard-00001.jsonl").unlink()
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.jsonl")}
    distill(config)
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.jsonl")}
    assert {k: after[k] for k in before} == before and "shard-00001.jsonl" in after
    assert rows_of(folder) == rows
    # ... under the same config only (the batch may change: it changes no reply)
    distill(config.model_copy(update={"batch_size": 4}))
    with pytest.raises(ConfigError) as error:
        distill(config.model_copy(update={"max_new_tokens": 13}))
    assert error.value.field == "max_new_tokens"

    # training takes the folder as a source; a reply cut at its budget is not closed with EOS
    train = TrainConfig(model="tiny", datasets=[str(folder)], max_length=256, output_dir=str(tmp_path))
    examples, reports = prepare_data(train, tokenizer)
    assert reports[0].kept == 24
    assert reports[0].truncated == sum(not r["complete"] for r in rows)
    for example, row in zip(examples, rows, strict=True):
        ends_with_eos = example.input_ids[-2] == tokenizer.eos_token_id  # ChatML: `<|im_end|>` + newline
        assert ends_with_eos == row["complete"]


def test_incomplete_reply_is_not_closed():
    tokenizer = models.load("tiny")[1]
    chat = [{"role": "user", "content": "Count from 1 to 9."}, {"role": "assistant", "content": "1, 2, 3"}]
    whole = data.tokenize_chat(tokenizer, chat, 512)
    cut = data.tokenize_chat(tokenizer, chat, 512, complete=False)
    assert whole.input_ids[: len(cut.input_ids)] == cut.input_ids
    assert tokenizer.decode(whole.input_ids[len(cut.input_ids) :]) == "<|im_end|>\n"
    assert cut.labels == whole.labels[: len(cut.input_ids)]


def test_distill_config_names_the_bad_field(tmp_path):
    with pytest.raises(ValueError, match="max_new_tokens"):
        DistillConfig(model="tiny", prompts=["tasks"], output=str(tmp_path), max_new_tokens=0)
    with pytest.raises(ConfigError) as error:
        distill(DistillConfig(model="tiny", prompts=["./no/such/file.jsonl"], output=str(tmp_path / "x")))
    assert error.value.field == "prompts[0]"
