"""FusedAdamW options a user can set without touching the script: ``--optim_args "state_dtype=8bit"`` (or
``TrainingArguments(optim_args=...)``), or ``FASTTRAIN_OPTIM_ARGS`` in the environment (optim_args wins)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

_OPTION_PARSERS: dict[str, Callable[[str], Any]] = {
    "state_dtype": str,  # None/"param" (the reference), "float32", "8bit": FusedAdamW checks the value
    "bf16_stochastic_rounding": lambda v: _parse_bool(v),
    "min_8bit_size": int,
    "sr_seed": int,
    "amsgrad": lambda v: _parse_bool(v),
    "maximize": lambda v: _parse_bool(v),
    "backend": str,
}


def _parse_bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{value!r} is not a boolean (true/false)")


def _split_options(text: str | None, where: str) -> dict[str, str]:
    options = {}
    for item in (text or "").replace(" ", "").split(","):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"{where}: {item!r} is not key=value")
        options[key] = value
    return options


def fused_adamw_options(args: Any) -> dict[str, Any]:
    """FusedAdamW keyword arguments from ``FASTTRAIN_OPTIM_ARGS`` and ``args.optim_args`` (a ValueError names
    a key FusedAdamW does not understand or a value it cannot read)."""
    raw = {**_split_options(os.environ.get("FASTTRAIN_OPTIM_ARGS"), "FASTTRAIN_OPTIM_ARGS")}
    raw.update(_split_options(getattr(args, "optim_args", None), "optim_args"))
    options = {}
    for key, value in raw.items():
        parse = _OPTION_PARSERS.get(key)
        if parse is None:
            raise ValueError(
                f"optim_args: FusedAdamW (optim={args.optim!r}) does not understand {key!r}; known: "
                f"{', '.join(_OPTION_PARSERS)} (or switch the optimizer hot path off: FASTTRAIN_DISABLE=optimizer)"
            )
        try:
            options[key] = parse(value)
        except ValueError as err:
            raise ValueError(f"optim_args: {key}={value!r}: {err}") from None
    return options
