"""FusedAdamW options a user can set without touching the script: ``--optim_args "state_dtype=8bit"`` (or
``TrainingArguments(optim_args=...)``), or ``FASTTRAIN_OPTIM_ARGS`` in the environment (optim_args wins)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .._backend import check_backend
from ._state import normalize_state_dtype


def _state_dtype(value: str) -> str | None:
    try:
        return normalize_state_dtype(value, "optim_args")
    except ValueError:
        raise ValueError(
            "use param (moments in the parameter's dtype, as torch's AdamW: the default), float32 or 8bit"
        ) from None


_OPTION_PARSERS: dict[str, Callable[[str], Any]] = {
    "state_dtype": _state_dtype,
    "bf16_stochastic_rounding": lambda v: _parse_bool(v),
    "min_8bit_size": int,
    "sr_seed": int,
    "amsgrad": lambda v: _parse_bool(v),
    "maximize": lambda v: _parse_bool(v),
    "backend": lambda v: check_backend(v, "backend"),
    # not FusedAdamW's: the Trainer registers step_in_backward on the optimizer it builds (integration/in_backward.py)
    "step_in_backward": lambda v: _parse_bool(v),
}
TRAINER_OPTIONS = ("step_in_backward",)  # read by the Trainer's integration, not passed to FusedAdamW


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
    """FusedAdamW keyword arguments from ``FASTTRAIN_OPTIM_ARGS`` and ``args.optim_args`` (a ValueError names,
    in the terms the user wrote them and where, a key FusedAdamW does not understand or a value it cannot read)."""
    sources = {
        key: ("FASTTRAIN_OPTIM_ARGS", value)
        for key, value in _split_options(
            os.environ.get("FASTTRAIN_OPTIM_ARGS"), "FASTTRAIN_OPTIM_ARGS"
        ).items()
    }
    sources.update(
        (key, ("optim_args", value))
        for key, value in _split_options(getattr(args, "optim_args", None), "optim_args").items()
    )
    options = {}
    for key, (where, value) in sources.items():
        parse = _OPTION_PARSERS.get(key)
        if parse is None:
            raise ValueError(
                f"{where}: {key!r} is not an option of fasttrain's AdamW (optim="
                f"{getattr(args.optim, 'value', args.optim)!r}); known: {', '.join(_OPTION_PARSERS)} "
                "(or switch the optimizer hot path off: FASTTRAIN_DISABLE=optimizer)"
            )
        try:
            options[key] = parse(value)
        except ValueError as err:
            raise ValueError(f"{where}: {key}={value!r}: {err}") from None
    return options
