"""A request's MARS settings on vLLM: `tau`, `verify` and `block_size`, as on the native engine.

They arrive as the request's `extra_args` (the OpenAI API's `vllm_xargs`); a request without them runs
verified at `DEFAULT_TAU`. A request marked `follow` (a mars-ray replica marks those it admits) takes what it
leaves unset from the engine's operating point, which the replica moves at run time (`MarsWorker`): from its
next forward, as on the native engine, so that a batch never mixes an old point with the new one. `calibrated:
false` reads raw confidences where the checkpoint carries calibrated slot temperatures (the tau sweeps of
`mars-ray eval` compare both). They are checked by `DecodeConfig`, the one home of their ranges. The worker
cannot answer a client, so a value that does not pass falls back to plain AR (always exact) and is logged: the
serving layer in front of vLLM checks the fields first and answers a 400 naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from mars_ray.core.decode_config import DecodeConfig, request_point
from mars_ray.core.errors import ConfigError

DEFAULT_TAU = 0.9

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftSettings:
    """How one request drafts: `window` slots per forward (1: no drafting), lossless or relaxed."""

    tau: float
    verify: bool
    window: int
    greedy: bool
    calibrated: bool = True

    @property
    def mode(self) -> str:
        return DecodeConfig.mode_of(self.window, self.verify)

    @property
    def relaxed(self) -> bool:
        """The paper's lossy trade: a carried proposal confident to tau is accepted even where the
        target disagrees. Sampled requests keep vLLM's own rule (their distribution is the target's)."""
        return self.window > 1 and not self.verify and self.greedy


def check(
    extra_args: Mapping | None,
    block_size: int,
    greedy: bool = True,
    point: tuple[float, bool, int] | None = None,
) -> DecodeConfig:
    """The request's fields as a `DecodeConfig`, what it leaves unset from the engine's operating `point`
    (tau, verify, window) if it follows it (None: `DEFAULT_TAU`, verified, the trained window); raises
    `ConfigError` naming the field."""
    extra = dict(extra_args or {})
    for name in ("verify", "calibrated", "follow"):
        if not isinstance(extra.get(name, True), bool):
            raise ConfigError(name, f"invalid value {extra[name]!r}")
    window = extra.get("block_size")
    if isinstance(window, float) and window.is_integer():  # `vllm_xargs` are JSON: a window may come as 2.0
        window = int(window)
    if extra.get("follow") and point is not None:
        tau, verify, window = request_point((extra.get("tau"), extra.get("verify"), window), greedy, point)
    else:
        tau, verify = extra.get("tau", DEFAULT_TAU), extra.get("verify", True)
        window = block_size if window is None else window
    window = DecodeConfig.check_block_size(window, most=block_size)
    return DecodeConfig(tau=tau, verify=verify, block_size=window)


def settings_of(
    extra_args: Mapping | None, block_size: int, greedy: bool, point: tuple[float, bool, int] | None = None
) -> DraftSettings:
    """What the worker runs for a request; AR (exact) where its fields do not pass `check`."""
    try:
        config = check(extra_args, block_size, greedy, point)
    except ConfigError as error:
        log.warning("MARS request fields refused (%s): decoding it as plain AR", error)
        return DraftSettings(tau=1.0, verify=True, window=1, greedy=greedy)
    calibrated = (extra_args or {}).get("calibrated", True)
    return DraftSettings(config.tau, config.verify, config.window, greedy, calibrated)
