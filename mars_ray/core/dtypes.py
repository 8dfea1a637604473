"""The one home of weight dtypes a user may name: the allowed names and their torch dtype."""

from __future__ import annotations

from typing import Literal, get_args

import torch

from mars_ray.core.errors import ConfigError

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
DTYPE_NAMES: tuple[str, ...] = get_args(DtypeName)


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype called `name`; None for "auto" (keep the dtype the weights were saved in)."""
    if name not in DTYPE_NAMES:
        raise ConfigError("dtype", f"{name!r} is not one of {', '.join(DTYPE_NAMES)}")
    return None if name == "auto" else getattr(torch, name)
