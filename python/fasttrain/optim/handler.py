"""The Trainer hook: ``optim="adamw_torch"`` / ``"adamw_torch_fused"`` resolve to ``FusedAdamW``.

transformers picks the optimizer class from ``transformers.trainer_optimizer._OPTIMIZER_HANDLERS``
(``args.optim`` -> handler(OptimizerContext) -> (class, kwargs)); ``trainer.py`` imports that dict by
name, so the entries are replaced in place (never the dict itself). Nothing is patched at import:
``install_optimizer_handlers()`` / ``uninstall_optimizer_handlers()`` (used by ``fasttrain.patch()``)
are idempotent and restore the original handler objects.
"""

from __future__ import annotations

import json
from typing import Any

from .._logging import log_once, logger
from .adamw import FusedAdamW

# optim_args keys FusedAdamW understands (values arrive as strings: "amsgrad=true,backend=torch")
_BOOL_ARGS = ("amsgrad", "maximize")
_STR_ARGS = ("backend",)
_FLOAT_ARGS = ("eps", "weight_decay", "lr")

_NAMES = ("adamw_torch", "adamw_torch_fused")
_originals: dict[str, Any] = {}


def _parse_bool(key: str, value: str) -> bool:
    lowered = str(value).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"optim_args: {key}={value!r} is not a boolean")


def is_deepspeed_optimizer_configured(args: Any) -> bool:
    """True when the TrainingArguments' DeepSpeed config has its own ``optimizer`` section.

    DeepSpeed then builds its optimizer itself and ignores the Trainer's: FusedAdamW would not run.
    """
    config = getattr(args, "deepspeed", None)
    plugin = getattr(args, "hf_deepspeed_config", None)
    if plugin is not None and isinstance(getattr(plugin, "config", None), dict):
        config = plugin.config
    if not config:
        return False
    if isinstance(config, str):
        try:
            with open(config) as f:
                config = json.load(f)
        except (OSError, ValueError):
            return False
    return isinstance(config, dict) and "optimizer" in config


def fused_adamw_handler(ctx: Any) -> tuple[Any, dict[str, Any]]:
    """An ``_OPTIMIZER_HANDLERS`` entry (signature ``(OptimizerContext) -> (cls, kwargs)``) for FusedAdamW.

    Same lr/betas/eps as transformers' ``_get_adamw_torch`` (weight decay comes from the Trainer's
    parameter groups). ``optim_args`` keys FusedAdamW understands are honoured (amsgrad, maximize,
    backend, eps, weight_decay, lr); any other key is refused with a ValueError naming it.
    """
    if is_deepspeed_optimizer_configured(ctx.args):
        log_once(
            "handler.deepspeed_optimizer",
            "fasttrain: the DeepSpeed config has an 'optimizer' section: DeepSpeed builds its own optimizer "
            "and FusedAdamW is not used",
        )
    kwargs = dict(ctx.optimizer_kwargs)
    kwargs.update(ctx.adam_kwargs)
    for key, value in (ctx.optim_args or {}).items():
        if key in _BOOL_ARGS:
            kwargs[key] = _parse_bool(key, value)
        elif key in _STR_ARGS:
            kwargs[key] = str(value)
        elif key in _FLOAT_ARGS:
            try:
                kwargs[key] = float(value)
            except ValueError as err:
                raise ValueError(f"optim_args: {key}={value!r} is not a number") from err
        else:
            raise ValueError(
                f"optim_args: FusedAdamW (optim={ctx.args.optim!r}) does not understand {key!r}; "
                f"known: {', '.join(_BOOL_ARGS + _STR_ARGS + _FLOAT_ARGS)} "
                "(or switch the optimizer hot path off)"
            )
    return FusedAdamW, kwargs


def _handler_table() -> dict[str, Any] | None:
    try:
        from transformers import trainer_optimizer
    except ImportError:
        return None
    table = getattr(trainer_optimizer, "_OPTIMIZER_HANDLERS", None)
    return table if isinstance(table, dict) else None


def install_optimizer_handlers() -> bool:
    """Point ``adamw_torch`` and ``adamw_torch_fused`` at FusedAdamW. Idempotent.

    Returns False (logged once) when this transformers has no handler table to hook.
    """
    table = _handler_table()
    if table is None or not all(name in table for name in _NAMES):
        log_once(
            "handler.no_table",
            "fasttrain: this transformers has no transformers.trainer_optimizer._OPTIMIZER_HANDLERS entry for "
            f"{_NAMES}: the Trainer keeps torch's AdamW",
        )
        return False
    for name in _NAMES:
        if table[name] is not fused_adamw_handler:
            _originals.setdefault(name, table[name])
            table[name] = fused_adamw_handler
    logger.debug("fasttrain: optim %s -> FusedAdamW", _NAMES)
    return True


def uninstall_optimizer_handlers() -> bool:
    """Restore the original handler objects. Idempotent; returns whether anything was restored."""
    table = _handler_table()
    restored = False
    for name, original in list(_originals.items()):
        if table is not None and table.get(name) is fused_adamw_handler:
            table[name] = original
            restored = True
        del _originals[name]
    return restored


def optimizer_handlers_installed() -> bool:
    table = _handler_table()
    return table is not None and all(table.get(name) is fused_adamw_handler for name in _NAMES)


__all__ = [
    "fused_adamw_handler",
    "install_optimizer_handlers",
    "is_deepspeed_optimizer_configured",
    "optimizer_handlers_installed",
    "uninstall_optimizer_handlers",
]
