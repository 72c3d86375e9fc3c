"""The tiled decoder MLP (``fasttrain.tiling.mlp``) for a Trainer: opt-in, ``FASTTRAIN_TILED_MLP=<tokens>``.

Not a hot path of ``hot_paths.REGISTRY`` (those are on by default): the tiled MLP runs each MLP's forward a second
time in the backward (all but its last projection), which costs more than 2% of a step wherever it tiles on a
model whose MLP is a sizeable part of the step (measured on CPU, a small Qwen3 whose attention-to-MLP ratio is a
Qwen3-8B's at 32k tokens: +3% to +4% of a step's CPU time), so it is a memory-for-time trade the user asks for. ``FASTTRAIN_TILED_MLP=N`` (``on`` or ``1``: 4096) wraps the decoder
MLPs of the trainer's model when ``train()`` builds its training loader (a model built by ``model_init`` too); a
micro-batch of more than ``N`` tokens runs every MLP in chunks of ``N`` tokens, a shorter one runs the plain module.
The wrappers come off at the end of training. The status line says whether, and how many times, the MLPs ran tiled
(the evidence), after the path's own entries.
"""

from __future__ import annotations

import dataclasses
import os
import weakref
from collections.abc import Callable
from typing import Any

from .._logging import log_once
from .ledger import Seam, seam_of
from .trainer_api import on_train_end, override

ENV = "FASTTRAIN_TILED_MLP"


def chunk_tokens() -> int | None:
    """The chunk size ``FASTTRAIN_TILED_MLP`` asks for, or None when it is unset or off."""
    from ..tiling.mlp import DEFAULT_CHUNK_TOKENS

    raw = os.environ.get(ENV, "").strip().lower()
    if raw in ("", "0", "off", "false", "no"):
        return None
    if raw in ("1", "on", "true", "yes"):
        return DEFAULT_CHUNK_TOKENS
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 2:
        raise ValueError(f"{ENV} must be on/off or a number of tokens per chunk (at least 2), got {raw!r}")
    return value


@dataclasses.dataclass
class _Tiling:
    chunk: int
    models: list[Any] = dataclasses.field(default_factory=list)  # models this trainer wrapped, while training
    wrapped: int = 0  # MLPs wrapped at the last start of training
    calls: int = 0  # tiled MLP forwards of earlier trainings
    note: int | None = None  # its entry in seam.others


_STATE: weakref.WeakKeyDictionary[Seam, _Tiling] = weakref.WeakKeyDictionary()


def arm(trainer: Any, seam: Seam) -> None:
    chunk = chunk_tokens()
    if chunk is None:
        return
    _STATE[seam] = _Tiling(chunk)
    override(trainer, "get_train_dataloader", _train_starts)
    override(trainer, "training_step", _step)
    on_train_end(trainer, _train_ended)


def _train_starts(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    from ..tiling.mlp import enable_tiled_mlp

    seam = seam_of(trainer)
    state = _STATE[seam]
    model = trainer.model
    if getattr(trainer, "is_in_train", False) and model is not None and not state.models:
        problem = engine_problem(trainer, seam)
        if problem is not None:
            _say(seam, state, 0, problem)
            return original(*args, **kwargs)
        state.wrapped = enable_tiled_mlp(model, chunk_tokens=state.chunk)
        state.models.append(model)
        if not state.wrapped:
            log_once(
                f"tiled-mlp-none:{type(model).__name__}",
                f"fasttrain: {ENV} is set, but no decoder MLP of {type(model).__name__} can be tiled",
            )
        _say(seam, state, 0)
    return original(*args, **kwargs)


def engine_problem(trainer: Any, seam: Seam) -> str | None:
    """Why the MLPs stay plain under this trainer's engine: FSDP (1 or 2) and ZeRO-3 gather the parameters in module
    hooks that the recomputation in backward does not run."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return "FSDP gathers the MLP's parameters in module hooks the recomputation in backward skips"
    zero = (seam.deepspeed or {}).get("zero_optimization") or {}
    if str(zero.get("stage", 0)) == "3":
        return "DeepSpeed ZeRO-3 gathers the MLP's parameters in module hooks the recomputation in backward skips"
    return None


def _ran(state: _Tiling) -> int:
    from ..tiling.mlp import tiled_mlp_calls

    return state.calls + sum(tiled_mlp_calls(model) for model in state.models)


def _step(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    result = original(*args, **kwargs)
    seam = seam_of(trainer)
    state = _STATE[seam]
    if not seam.logged and state.models:  # the status line is written after the first optimizer step
        _say(seam, state, _ran(state))
    return result


def _say(seam: Seam, state: _Tiling, ran: int, problem: str | None = None) -> None:
    if problem is not None:
        text = f"tiled_mlp=off: {problem}"
    elif ran:
        text = f"tiled_mlp=on ({state.wrapped} MLPs, chunks of {state.chunk} tokens, {ran} tiled forwards)"
    elif state.wrapped:
        text = f"tiled_mlp=off: no micro-batch had more than {state.chunk} tokens ({ENV}={state.chunk})"
    else:
        text = f"tiled_mlp=off: no decoder MLP of the model can be tiled ({ENV} is set)"
    if state.note is None:
        state.note = len(seam.others)
        seam.others.append(text)
    else:
        seam.others[state.note] = text


def _train_ended(trainer: Any) -> None:
    from ..tiling.mlp import disable_tiled_mlp

    state = _STATE[seam_of(trainer)]
    state.calls = _ran(state)
    for model in state.models:
        disable_tiled_mlp(model)
    state.models.clear()
