"""A bad setting ends any command with exit code 2 and `error: <field>: <why>`, however it was given: a flag,
a `key=value` override, a YAML value, or a source that a command finds bad when it runs."""

from __future__ import annotations

import typing

import pytest

from mars_ray import models
from mars_ray.cli import main


def error_of(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(list(argv))
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip()


def test_a_flag_out_of_range_names_its_flag(capsys):
    err = error_of(capsys, "calibrate", "--model", "tiny", "--bins", "1")
    assert err.startswith("mars-ray calibrate: error: --bins: ") and "greater than or equal to 2" in err


def test_a_source_found_bad_when_the_command_runs_names_its_place_in_the_list(capsys, tmp_path):
    argv = ["--model", "tiny", "--prompts", "tasks", "./no/such.jsonl", "--output", str(tmp_path)]
    err = error_of(capsys, "distill", *argv)
    assert err.startswith("mars-ray distill: error: prompts[1]: ") and "no/such.jsonl" in err


def test_training_keys_name_their_field_whether_malformed_or_invalid(capsys):
    err = error_of(capsys, "train", "model=tiny", "steps")
    assert err == "mars-ray train: error: overrides: 'steps' is not key=value"
    err = error_of(capsys, "train", "model=tiny", "lr=-1")  # pydantic's refusal, as one line on its field
    assert err.startswith("mars-ray train: error: lr: ") and "\n" not in err


def test_the_quickstart_names_the_stage_it_needs(capsys):
    err = error_of(capsys, "quickstart", "stages=[ar-sft]")
    assert err == "mars-ray quickstart: error: stages: the quickstart evaluates the mars stage, keep it"


def test_prepare_offers_exactly_the_presets(capsys):
    assert set(typing.get_args(models.Preset)) == set(models.PRESETS)
    assert "invalid choice: 'huge'" in error_of(capsys, "prepare", "--model", "huge")


def test_a_rule_checked_by_its_owner_reads_as_the_owner_says_it(capsys):
    """A tau from any flag is checked by `DecodeConfig.check_tau`: its words, on the flag, nothing of
    pydantic's wrapping ("Value error, tau: ...")."""
    err = error_of(capsys, "generate", "--model", "tiny", "--prompt", "hi", "--tau", "1.5")
    assert err == "mars-ray generate: error: --tau: must be in (0, 1], got 1.5"
    err = error_of(capsys, "eval", "--model", "tiny", "--taus", "0.9", "0")
    assert err == "mars-ray eval: error: --taus: must be in (0, 1], got 0.0"
