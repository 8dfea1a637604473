"""What a command writes is whole or absent, and a rerun resumes a folder only under the config it began
with (`mars_ray.folders`: training runs, distilled datasets and presets all go through it)."""

from __future__ import annotations

import pytest
import yaml

from mars_ray import folders
from mars_ray.core.errors import ConfigError


def test_a_published_folder_is_whole_or_absent(tmp_path):
    final = tmp_path / "final"

    def crash(folder):
        (folder / "half").write_text("x")
        raise OSError("disk full")

    with pytest.raises(OSError):
        folders.publish(final, crash)
    assert not final.exists()
    folders.publish(final, lambda folder: (folder / "weights").write_text("old"))
    with pytest.raises(OSError):
        folders.publish(final, crash)
    assert [p.name for p in final.iterdir()] == ["weights"]  # the old result stays whole
    folders.publish(final, lambda folder: (folder / "weights").write_text("new"))
    assert (final / "weights").read_text() == "new"


def test_a_written_file_leaves_no_visible_staging(tmp_path):
    folders.write_file(tmp_path / "shard.jsonl", "{}\n")
    assert [p.name for p in tmp_path.iterdir()] == ["shard.jsonl"]


def test_a_rerun_keeps_the_config_but_what_may_change(tmp_path):
    record = tmp_path / "run" / "distill.yaml"
    started = {"model": "tiny", "batch_size": 8, "seed": 1}
    folders.check_rerun(record, started, lambda saved: {"batch_size"}, "output", key="config")
    assert yaml.safe_load(record.read_text()) == {"config": started}
    folders.check_rerun(
        record, {**started, "batch_size": 4}, lambda saved: {"batch_size"}, "output", "config"
    )
    with pytest.raises(ConfigError) as error:
        changed = {"model": "other", "batch_size": 4, "seed": 2}
        folders.check_rerun(record, changed, lambda saved: {"batch_size"}, "output", "config")
    assert error.value.field == "model"
    assert "other values for model, seed: use another output" in error.value.message
    # what may change can depend on what was saved; a flat record is the config itself
    flat = tmp_path / "train" / "config.yaml"
    folders.check_rerun(flat, started, lambda saved: set(), "name")
    assert yaml.safe_load(flat.read_text()) == started
    seen = []
    folders.check_rerun(flat, {**started, "seed": 2}, lambda saved: seen.append(saved) or {"seed"}, "name")
    assert seen == [started]
