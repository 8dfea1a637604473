"""MARS's keys of a checkpoint's config.json are written through one typed object, other keys untouched."""

from __future__ import annotations

import json

from conftest import build_tiny

from mars_ray.checkpoint_meta import CheckpointMeta
from mars_ray.core.decode_config import SLOT_TEMPERATURES, TRAINED_BLOCK_SIZE


def test_training_and_calibration_record_their_keys(tmp_path):
    model = build_tiny("llama")
    assert CheckpointMeta.of(model.config) == CheckpointMeta()
    CheckpointMeta(block_size=4).apply(model.config)  # as training does before save_pretrained
    model.save_pretrained(tmp_path)
    before = json.loads((tmp_path / "config.json").read_text())
    assert before[TRAINED_BLOCK_SIZE] == 4

    CheckpointMeta(slot_temperatures=[1.0, 1.5, 2.0, 2.5]).write(tmp_path)  # as calibration does
    after = json.loads((tmp_path / "config.json").read_text())
    assert after == {**before, SLOT_TEMPERATURES: [1.0, 1.5, 2.0, 2.5]}  # the block size is kept
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []

    reloaded = type(model.config).from_pretrained(tmp_path)
    assert CheckpointMeta.of(reloaded) == CheckpointMeta(4, [1.0, 1.5, 2.0, 2.5])
