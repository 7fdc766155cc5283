"""comm's environment settings (``COMM_PATCH``, ``COMM_PROFILE``, ``COMM_STAGING_CHUNK_BYTES``): read one way,
refused when not understood."""

from __future__ import annotations

import os
from typing import Tuple

_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_switch(name: str, expected: str, also: Tuple[str, ...] = ()) -> str:
    """Environment variable ``name`` read as "on", "off" (also when unset) or one of ``also``; else refused."""
    value = os.environ.get(name, "")
    mode = value.strip().lower()
    if mode in _ON:
        return "on"
    if mode in _OFF:
        return "off"
    if mode in also:
        return mode
    raise ValueError(f"{name}={value!r} is not understood; expected {expected}")


def env_bytes(name: str, default: int) -> int:
    """Environment variable ``name`` as a whole number of bytes, ``default`` when unset or empty; else refused."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{name}={value!r} is not understood; expected a whole number of bytes (0: never)")
    return int(value)
