"""The one error for a bad setting: it carries the field it is about, so no caller parses a message."""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that is missing or invalid; `field` names it as its owner knows it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)  # both in `args`, so the error pickles across Ray intact
        self.field, self.message = field, message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
