"""What a command writes is whole or absent, and a rerun resumes it only under the config that began it.

Training runs, distilled datasets and model presets are folders a crash may interrupt and a rerun finishes:
a file or a folder appears under its name only once it is complete (`write_file`, `publish`), and the
folder records the config it was started with, which a rerun must keep (`check_rerun`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

import yaml

from mars_ray.core.errors import ConfigError


def write_file(path: Path, text: str) -> None:
    """Write `text` to a hidden file beside `path` (no reader lists it), then rename it: `path` is whole."""
    staging = path.with_name(f".{path.name}.partial")
    staging.write_text(text)
    os.replace(staging, path)


def publish(final: Path, fill: Callable[[Path], None]) -> None:
    """Fill a staging folder beside `final`, then swap it in: `final` is whole or absent."""
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    fill(staging)
    shutil.rmtree(final, ignore_errors=True)
    staging.rename(final)


def check_rerun(
    record: Path,
    current: dict,
    resumable: Callable[[dict], Collection[str]],
    folder_field: str,
    key: str | None = None,
) -> None:
    """Refuse to resume the folder of `record` under other values than it was started with, then record
    `current` there: what the folder holds depends on them.

    `record` is a YAML file holding the config (under `key`, or as the whole file); the fields in
    `resumable(saved config)` may change (where and how wide the work runs, not what it writes). A refusal
    is a `ConfigError` on the first changed field; `folder_field` is the setting that picks another folder.
    """
    if record.exists():
        saved = yaml.safe_load(record.read_text())
        saved = saved[key] if key else saved
        allowed = resumable(saved)
        fixed = sorted(
            k for k in current.keys() | saved.keys() if saved.get(k) != current.get(k) and k not in allowed
        )
        if fixed:
            raise ConfigError(
                fixed[0],
                f"{record.parent} was started with other values for {', '.join(fixed)}: use another"
                f" {folder_field}, or the same values to resume",
            )
    record.parent.mkdir(parents=True, exist_ok=True)
    write_file(record, yaml.safe_dump({key: current} if key else current, sort_keys=False))
