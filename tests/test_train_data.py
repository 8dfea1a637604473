"""Chat data for training: any `messages` source, the template, prompt masking, truncation, and a report
that counts every skipped row by reason."""

from __future__ import annotations

import json

import datasets
import pytest

from mars_ray import data, models
from mars_ray.core.objective import IGNORE, collate_mars


@pytest.fixture(scope="module")
def tokenizer():
    return models.load("tiny")[1]


def chat(*turns: str) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def test_only_the_last_assistant_turn_is_supervised(tokenizer):
    messages = chat("Count from 1 to 3.", "1, 2, 3", "Again?", "1, 2, 3")
    example = data.tokenize_chat(tokenizer, messages, max_length=512)
    ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    prompt = tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False)
    assert example.input_ids == ids
    assert example.labels == [IGNORE] * len(prompt) + ids[len(prompt) :]
    answer = [t for t in example.labels if t != IGNORE]
    assert tokenizer.decode(answer).startswith("1, 2, 3<|im_end|>")


def test_report_counts_every_skipped_row_by_reason(tokenizer, tmp_path):
    long_prompt = " ".join(["apple"] * 200)
    rows = [
        {"messages": chat("hi", "hello")},
        {"messages": chat("Spell it.", "a-b-c " * 40)},  # kept, cut to max_length
        {"messages": chat(long_prompt, "ok")},  # the prompt alone is too long
        {"messages": None},
        {"messages": [{"role": "user", "content": None}, {"role": "assistant", "content": "x"}]},
        {"messages": chat("only a question")},
        {"messages": [{"role": "user", "content": "hi"}, "not a message"]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    examples, report = data.tokenize_chats(data.load_chats(str(path)), tokenizer, 48, "chats.jsonl")

    assert (report.rows, report.kept, report.truncated) == (7, 2, 1)
    assert report.skipped == {
        "prompt fills max_length": 1,
        "missing messages": 1,
        "malformed message": 2,
        "last turn not assistant": 1,
    }
    assert [len(e.input_ids) for e in examples][1] == 48
    assert all(len(e.labels) == len(e.input_ids) for e in examples)
    assert "2/7 rows kept (1 truncated)" in report.summary()
    assert json.loads(json.dumps(report.to_dict()))["skipped"]["malformed message"] == 2


def test_sources_bundled_files_and_missing_messages(tmp_path):
    assert len(data.load_chats("tasks", "train", tasks_count=10)) == 10
    assert data.load_chats("chatterbot").column_names[0] == "messages"
    parquet = tmp_path / "chats.parquet"
    data.load_chats("tasks", tasks_count=5).to_parquet(str(parquet))
    assert len(data.load_chats(str(parquet))) == 5

    no_messages = tmp_path / "text.jsonl"
    no_messages.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match="no 'messages' column"):
        data.load_chats(str(no_messages))
    with pytest.raises(FileNotFoundError):
        data.load_chats("./does/not/exist.jsonl")
    with pytest.raises(ValueError, match="splits train, calibration, heldout"):
        data.load_chats("tasks", "test")


CUT_AT = 50  # max_length: not a multiple of the block size (4), so a row cut there would be extended


def cut_and_whole_rows() -> list[dict]:
    """A distilled reply cut at its budget, a reply cut at `CUT_AT`, and a whole one."""
    return [
        {"messages": chat("Count from 1 to 9.", "1, 2, 3, 4"), "complete": False},
        {"messages": chat("Spell it.", "a-b-c " * 40), "complete": True},
        {"messages": chat("Count from 1 to 3.", "1, 2, 3"), "complete": True},
    ]


def assert_eos_supervised_only_where_the_reply_ended(examples, tokenizer) -> None:
    """Of `cut_and_whole_rows`' examples, only the whole reply's MARS batch scores EOS."""
    assert [e.complete for e in examples] == [False, False, True]
    batch = collate_mars(examples, 4, tokenizer.mask_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id)
    assert (batch.targets == tokenizer.eos_token_id).any(dim=1).tolist() == [False, False, True]


def test_a_cut_reply_never_teaches_eos(tokenizer):
    rows = datasets.Dataset.from_list(cut_and_whole_rows())
    examples, report = data.tokenize_chats(rows, tokenizer, CUT_AT, "rows")
    assert report.truncated == 2
    assert_eos_supervised_only_where_the_reply_ended(examples, tokenizer)


def test_no_heldout_or_calibration_task_has_a_train_twin():
    """Tasks are split by content, not wording: "Count from 13 to 18." in held-out and "List the numbers
    from 13 to 18." in train would be the same task on both sides. Every kind is checked."""
    train = {(r["task"], r["answer"]) for r in data.verifiable_tasks("train", 4000)}
    for split in ("heldout", "calibration"):
        rows = data.verifiable_tasks(split, 400)
        assert len({r["task"] for r in rows}) == 9  # every kind of task
        twins = [r["messages"][0]["content"] for r in rows if (r["task"], r["answer"]) in train]
        assert twins == [], f"{split}: {len(twins)} of {len(rows)} tasks are also in train, e.g. {twins[:3]}"
