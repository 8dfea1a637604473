"""What MARS records in a checkpoint's `config.json` beside the model's own config, written in one place.

Training records the block size B its masks learned (decoders default their window to it), calibration the
confidence temperature of each window slot. Both go through `CheckpointMeta`: onto a model's config before
`save_pretrained` (`apply`), or into a saved folder's `config.json`, its other keys untouched (`write`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import PretrainedConfig

from mars_ray.core.decode_config import SLOT_TEMPERATURES, TRAINED_BLOCK_SIZE
from mars_ray.folders import write_file

CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class CheckpointMeta:
    """MARS's keys of a model config; None: not recorded (and left as it is by `apply` and `write`)."""

    block_size: int | None = None  # B of the mars stage
    slot_temperatures: list[float] | None = None  # per window slot, slot 0 first (always 1.0)

    @classmethod
    def of(cls, config: PretrainedConfig) -> CheckpointMeta:
        """What a loaded model's config records."""
        return cls(getattr(config, TRAINED_BLOCK_SIZE, None), getattr(config, SLOT_TEMPERATURES, None))

    def recorded(self) -> dict:
        """The recorded values under their config keys."""
        values = {TRAINED_BLOCK_SIZE: self.block_size, SLOT_TEMPERATURES: self.slot_temperatures}
        return {key: value for key, value in values.items() if value is not None}

    def apply(self, config: PretrainedConfig) -> None:
        """Onto a model's config, which `save_pretrained` then writes."""
        for key, value in self.recorded().items():
            setattr(config, key, value)

    def write(self, folder: Path) -> None:
        """Into the `config.json` of the saved model `folder` (a gated folder's too), whole or not at all."""
        path = Path(folder) / CONFIG_FILE
        stored = json.loads(path.read_text())
        write_file(path, json.dumps({**stored, **self.recorded()}, indent=2) + "\n")
