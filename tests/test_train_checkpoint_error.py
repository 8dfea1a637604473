"""A checkpoint a crash left behind is refused with the one typed error, which crosses Ray whole."""

from __future__ import annotations

import pickle

from mars_ray.core.errors import ConfigError
from mars_ray.train.steps import IncompleteCheckpoint


def test_an_incomplete_checkpoint_is_a_config_error_that_crosses_processes_whole(tmp_path):
    error = IncompleteCheckpoint(tmp_path, "model.safetensors", "is missing")
    assert isinstance(error, ConfigError) and error.field == "checkpoint"
    assert str(error) == f"checkpoint: {tmp_path} is incomplete: model.safetensors is missing"
    copy = pickle.loads(pickle.dumps(error))
    assert (type(copy), copy.folder, copy.path, copy.problem, str(copy)) == (
        IncompleteCheckpoint,
        tmp_path,
        "model.safetensors",
        "is missing",
        str(error),
    )
