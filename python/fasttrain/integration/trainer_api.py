"""The few ways fasttrain reaches into a Trainer, each written once: overriding a method on one instance, checking
a private hook before using it, and the questions several paths ask of a trainer (is it TRL's? does it group by
length? which input names its examples' length? does it run under DeepSpeed?)."""

from __future__ import annotations

import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any

import transformers

from .._classes import from_package, mro_owner


def _bind(attribute: Any, obj: Any) -> Any:
    """``attribute`` (as found in a class's ``__dict__``) as ``obj.<name>`` would give it."""
    get = getattr(type(attribute), "__get__", None)
    return attribute if get is None else get(attribute, obj, type(obj))


def override(trainer: Any, name: str, hook: Callable[..., Any], *, replaces: bool = False) -> None:
    """``trainer.<name>(...)`` becomes ``hook(trainer, original, ...)``, on this instance only.

    ``original`` is what the call reaches without the hook: an earlier hook of fasttrain's on the same name, else
    the class's method looked up at call time, so a method patched or mocked on the class after the trainer was
    built is still called. ``replaces=True`` marks a hook that does the method's work itself: if the class's method
    has changed since the hook was installed, the call goes to the new method and the hook steps aside.

    A call that re-enters the hook while it runs (``mock.patch.object(Cls, name, wraps=trainer.<name>)`` wraps this
    very override) goes on to what the hook would call, without running the hook a second time.
    """
    cls = type(trainer)
    armed = inspect.getattr_static(cls, name)  # the class's method when the hook was installed
    previous = trainer.__dict__.get(name)
    ref = weakref.ref(trainer)
    running = threading.local()

    def resolve(this: Any) -> Any:
        return previous if previous is not None else _bind(inspect.getattr_static(type(this), name), this)

    @functools.wraps(getattr(armed, "__func__", armed))  # names and docs; no reference to the trainer
    def call(*args: Any, **kwargs: Any) -> Any:
        this = ref()
        if getattr(running, "active", False):
            return (previous if previous is not None else _bind(armed, this))(*args, **kwargs)
        if replaces and previous is None and inspect.getattr_static(type(this), name) is not armed:
            return resolve(this)(*args, **kwargs)
        running.active = True
        try:
            return hook(this, resolve(this), *args, **kwargs)
        finally:
            running.active = False

    trainer.__dict__[name] = call


def on_train_end(trainer: Any, hook: Callable[[Any], None]) -> None:
    """``hook(trainer)`` after the Trainer's ``on_train_end`` event (the end of every ``train()``)."""
    after_event(trainer, "on_train_end", hook)


def after_event(trainer: Any, event: str, hook: Callable[[Any], None]) -> None:
    """``hook(trainer)`` after the callback handler's ``event`` (e.g. ``on_train_begin``: after the model is
    prepared, before the first step), through the trainer's callback handler: the callbacks themselves stay the
    user's. The handler's method is looked up at call time; the trainer is held weakly."""
    handler = trainer.callback_handler
    previous = handler.__dict__.get(event)
    ref, handler_ref = weakref.ref(trainer), weakref.ref(handler)  # no cycle through the handler's __dict__

    def call(*args: Any, **kwargs: Any) -> Any:
        owner = handler_ref()
        control = (previous or _bind(inspect.getattr_static(type(owner), event), owner))(*args, **kwargs)
        this = ref()
        if this is not None:
            hook(this)
        return control

    handler.__dict__[event] = call


def private_hook_missing(name: str, parameters: tuple[str, ...]) -> str | None:
    """Why the private ``Trainer.<name>`` is not the one fasttrain knows (None when it is): this transformers lacks
    it or has another signature."""
    reference = getattr(transformers.Trainer, name, None)
    if reference is None:
        return f"transformers {transformers.__version__} has no Trainer.{name}"
    if tuple(inspect.signature(reference).parameters)[1:] != parameters:
        return f"Trainer.{name} in transformers {transformers.__version__} has another signature"
    return None


def private_hook_problem(trainer: Any, name: str, parameters: tuple[str, ...]) -> str | None:
    """Why the private ``Trainer.<name>`` cannot be hooked on this trainer (None when it can): this transformers
    lacks it or has another signature, or the trainer's class overrides it."""
    missing = private_hook_missing(name, parameters)
    if missing is not None:
        return missing
    owner = mro_owner(type(trainer), name)
    if owner is not transformers.Trainer:
        return f"{owner.__name__} overrides {name}"
    return None


def overriding_class(trainer: Any, name: str, *, trl_allowed: bool = False) -> type | None:
    """The class whose ``<name>`` the trainer runs when it is not transformers' own (nor TRL's, if allowed)."""
    owner = mro_owner(type(trainer), name)
    if owner is transformers.Trainer or (trl_allowed and from_package(owner, "trl")):
        return None
    return owner


def is_trl_trainer(trainer: Any) -> bool:
    return from_package(type(trainer), "trl")


def groups_by_length(args: Any) -> bool:
    """Whether the arguments ask for length-grouped batches (5.x ``train_sampling_strategy``, 4.x ``group_by_length``)."""
    return getattr(args, "train_sampling_strategy", None) == "group_by_length" or bool(
        getattr(args, "group_by_length", False)
    )


def model_input_name(trainer: Any) -> str | None:
    """The input that gives an example's length, as the Trainer's sampler reads it (the processor's first input)."""
    names = getattr(getattr(trainer, "processing_class", None), "model_input_names", None)
    return names[0] if names else None


def deepspeed_config(trainer: Any) -> dict[str, Any] | None:
    """The DeepSpeed config dict of a trainer that runs under DeepSpeed, else None."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return getattr(plugin, "deepspeed_config", None) or {}


def launched_alone_problem(trainer: Any) -> str | None:
    """Why this process trains alone although a launcher started several (None when it does not): transformers runs
    FSDP without an accelerator as one separate training per process, for example."""
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    world = int(getattr(trainer.args, "world_size", 1) or 1)
    if launched > 1 and world == 1:
        return (
            f"{launched} processes were launched (WORLD_SIZE={launched}) but the Trainer trains as one process in "
            "each: every process runs its own whole training, not one distributed run"
        )
    return None
