"""The hot paths as Trainer hooks, shared by ``fasttrain.Trainer`` and ``fasttrain.patch()``.

Each hook takes the original (unpatched) bound method as its first argument and decides, per trainer
instance, whether the fasttrain path applies; where it does not, it calls the original and records why in
``trainer.fasttrain_status``. ``fasttrain.Trainer`` calls them from its overrides (original = ``super()``'s
method), ``patch()`` installs them on ``transformers.Trainer`` itself (original = the saved function). A
hook is a no-op on a trainer that another hook layer already handled, so ``fasttrain.Trainer`` under
``patch()`` is not accelerated twice.

Status values: ``"on"``, ``"off: <reason>"`` (switched off or not applicable), and ``"pending"`` before the
path had its first chance to run. One log line at train start lists them all.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import TrainerCallback

from ._logging import log_once, logger
from .hot_paths import HotPaths

_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")

# set by patch(): the hot paths for trainers that were not built by fasttrain.Trainer
patched_hot_paths: HotPaths | None = None


# ---------------------------------------------------------------------------------------------------------
# per-instance bookkeeping


def hot_paths_of(trainer: Any) -> HotPaths:
    paths = getattr(trainer, "hot_paths", None)
    if not isinstance(paths, HotPaths):
        paths = HotPaths.from_env(patched_hot_paths)
        trainer.hot_paths = paths
    return paths


def status_of(trainer: Any) -> dict[str, str]:
    status = getattr(trainer, "fasttrain_status", None)
    if not isinstance(status, dict):
        status = {}
        trainer.fasttrain_status = status
    paths = hot_paths_of(trainer)
    for name in HotPaths.names():
        if name not in status:
            status[name] = "pending" if getattr(paths, name) else "off: switched off"
    return status


def _set(trainer: Any, name: str, value: str) -> None:
    status = status_of(trainer)
    previous = status.get(name)
    status[name] = value
    if value.startswith("off") and previous != value and getattr(hot_paths_of(trainer), name):
        log_once(f"fallback:{name}:{value}", f"fasttrain: {name} hot path falls back to transformers ({value[5:]})")


@contextlib.contextmanager
def _once(trainer: Any, hook: str) -> Iterator[bool]:
    """Yields True for the outermost hook layer only (fasttrain.Trainer under patch() nests two)."""
    flag = f"_fasttrain_in_{hook}"
    if getattr(trainer, flag, False):
        yield False
        return
    setattr(trainer, flag, True)
    try:
        yield True
    finally:
        setattr(trainer, flag, False)


def log_summary(trainer: Any) -> None:
    status = status_of(trainer)
    line = ", ".join(f"{name}={value}" for name, value in status.items())
    logger.warning("fasttrain hot paths: %s", line)


# ---------------------------------------------------------------------------------------------------------
# collator


def swap_collator(trainer: Any) -> None:
    """After ``__init__``: replace a transformers collator by its Rust equivalent (a user's own is kept)."""
    if not hot_paths_of(trainer).collator:
        return _set(trainer, "collator", "off: switched off")
    from .data.collators import native_equivalent

    current = trainer.data_collator
    if getattr(type(current), "__module__", "").startswith("fasttrain."):
        return _set(trainer, "collator", "on")
    native = native_equivalent(current)
    if native is None:
        name = getattr(type(current), "__qualname__", None) or getattr(current, "__name__", repr(current))
        return _set(trainer, "collator", f"off: {name} has no native equivalent")
    trainer.data_collator = native
    _set(trainer, "collator", "on")


# ---------------------------------------------------------------------------------------------------------
# sampler


def train_sampler(original: Callable[..., Any], trainer: Any, train_dataset: Any = None) -> Any:
    with _once(trainer, "sampler") as outer:
        if not outer:
            return original(train_dataset)
        args = trainer.args
        if not hot_paths_of(trainer).sampler:
            _set(trainer, "sampler", "off: switched off")
            return original(train_dataset)
        if getattr(args, "train_sampling_strategy", None) != "group_by_length" and not getattr(
            args, "group_by_length", False
        ):
            _set(trainer, "sampler", "off: group_by_length is not set")
            return original(train_dataset)
        dataset = trainer.train_dataset if train_dataset is None else train_dataset
        from transformers.trainer_utils import has_length

        if dataset is None or not has_length(dataset):
            _set(trainer, "sampler", "off: the training dataset has no length")
            return original(train_dataset)

        from .data.sampler import LengthGroupedSampler

        model_input_name = None
        processing_class = getattr(trainer, "processing_class", None)
        if processing_class is not None and getattr(processing_class, "model_input_names", None):
            model_input_name = processing_class.model_input_names[0]
        lengths = _lengths_before_column_removal(trainer, dataset, model_input_name or "input_ids")
        _set(trainer, "sampler", "on")
        return LengthGroupedSampler(
            args.train_batch_size * args.gradient_accumulation_steps,
            dataset=dataset,
            lengths=lengths,
            model_input_name=model_input_name,
        )


def _lengths_before_column_removal(trainer: Any, dataset: Any, model_input_name: str) -> Any:
    """The Trainer drops unused columns (``length`` too) before it builds the sampler: read the length
    column from the dataset it was given, and otherwise the token lists' Arrow offsets of what is left."""
    from .data.lengths import lengths_from_dataset

    column = getattr(trainer.args, "length_column_name", "length")
    original = trainer.train_dataset
    names = getattr(original, "column_names", None)
    if names is not None and column in names and len(original) == len(dataset):
        return lengths_from_dataset(original, model_input_name, length_column=column)
    return lengths_from_dataset(dataset, model_input_name, length_column=column)


# ---------------------------------------------------------------------------------------------------------
# optimizer and fused clipping


def create_optimizer(original: Callable[..., Any], trainer: Any, model: Any = None) -> Any:
    with _once(trainer, "optimizer") as outer:
        if not outer or trainer.optimizer is not None:
            return original(model)
        args = trainer.args
        reason = _optimizer_blocker(trainer)
        if reason is not None:
            _set(trainer, "optimizer", f"off: {reason}")
            return original(model)
        from .optim import FusedAdamW

        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, trainer.model if model is None else model)
        if cls is FusedAdamW:  # the handler table is patched: nothing to swap
            _set(trainer, "optimizer", "on")
            return original(model)
        if cls is not torch.optim.AdamW:
            _set(trainer, "optimizer", f"off: optim={args.optim} resolved to {cls!r}")
            return original(model)
        kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
        saved = trainer.optimizer_cls_and_kwargs
        trainer.optimizer_cls_and_kwargs = (FusedAdamW, kwargs)
        try:
            optimizer = original(model)
        finally:
            trainer.optimizer_cls_and_kwargs = saved
        _set(trainer, "optimizer", "on")
        return optimizer


def _optimizer_blocker(trainer: Any) -> str | None:
    if not hot_paths_of(trainer).optimizer:
        return "switched off"
    args = trainer.args
    if trainer.optimizer_cls_and_kwargs is not None:
        return "the Trainer was given optimizer_cls_and_kwargs"
    if str(getattr(args.optim, "value", args.optim)) not in _ADAMW_OPTIMS:
        return f"optim={getattr(args.optim, 'value', args.optim)} is not an AdamW fasttrain replaces"
    if getattr(trainer, "is_deepspeed_enabled", False):
        from .optim.handler import is_deepspeed_optimizer_configured

        if is_deepspeed_optimizer_configured(args):
            return "the DeepSpeed config has its own optimizer section"
        # ZeRO wraps the client optimizer around its flat fp32 partitions: not tested with FusedAdamW
        return "DeepSpeed: the client optimizer stays torch's AdamW (FusedAdamW is untested under ZeRO)"
    return None


def find_fused_adamw(optimizer: Any) -> Any:
    """The FusedAdamW under Accelerate's (and others') optimizer wrappers, or None."""
    from .optim import FusedAdamW

    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, FusedAdamW):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
        seen += 1
    return None


def clip_grad_norm(original: Callable[..., Any], trainer: Any, model: Any) -> Any:
    """``Trainer._clip_grad_norm``: the norm in one pass, the clip applied inside the next AdamW step."""
    with _once(trainer, "clip") as outer:
        if not outer:
            return original(model)
        fused, reason = _fused_clip_target(trainer, model)
        if fused is None:
            _set(trainer, "clip", f"off: {reason}")
            return original(model)
        _set(trainer, "clip", "on")
        return fused.defer_clip_grad_norm_(trainer.args.max_grad_norm)


def grad_norm(original: Callable[..., Any], trainer: Any, model: Any, grad_norm: Any = None) -> Any:
    """``Trainer._get_grad_norm`` without clipping (max_grad_norm=0): the norm pass alone, no rescaling."""
    with _once(trainer, "grad_norm") as outer:
        if not outer or grad_norm is not None:
            return original(model, grad_norm=grad_norm)
        fused, _ = _fused_clip_target(trainer, model)
        if fused is None:
            return original(model, grad_norm=grad_norm)
        return original(model, grad_norm=fused.defer_clip_grad_norm_(float("inf")))


def _fused_clip_target(trainer: Any, model: Any) -> tuple[Any, str]:
    if not hot_paths_of(trainer).clip:
        return None, "switched off"
    fused = find_fused_adamw(trainer.optimizer)
    if fused is None:
        return None, "the optimizer is not fasttrain's FusedAdamW"
    from accelerate.utils import DistributedType

    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return None, "DeepSpeed clips inside its engine"
    if kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        return None, "FSDP1 clips through its own wrapper"
    if kind not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP):
        return None, f"distributed type {kind} is not supported by the fused clip"
    if getattr(accelerator, "scaler", None) is not None:
        return None, "fp16 GradScaler: gradients are unscaled by Accelerate before clipping"
    has_mixed = getattr(trainer, "_has_mixed_mesh_grads", None)
    if callable(has_mixed) and has_mixed(model):
        return None, "gradients on several device meshes"
    if not _optimizer_covers_all_grads(fused, model):
        return None, "the model has gradients the optimizer does not update"
    return fused, ""


def _optimizer_covers_all_grads(optimizer: Any, model: Any) -> bool:
    # The Trainer clips model.parameters(); the fused norm runs over the optimizer's parameters. They agree
    # when every parameter with a gradient is one the optimizer updates (checked once: the sets are static).
    cached = getattr(optimizer, "_fasttrain_covers_model", None)
    if cached is not None:
        return cached
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    covered = all(id(p) in owned for p in model.parameters() if p.requires_grad)
    optimizer._fasttrain_covers_model = covered
    return covered


# ---------------------------------------------------------------------------------------------------------
# loss


def ensure_fused_loss(trainer: Any) -> None:
    """Before the first loss: wrap the model's forward so the loss never materialises the logits.

    Checked per model object, since ``model_init`` (hyperparameter search) builds a new model in ``train()``."""
    model = trainer.model
    if model is None or getattr(trainer, "_fasttrain_loss_model", None) is model:
        return
    trainer._fasttrain_loss_model = model
    if not hot_paths_of(trainer).loss:
        return _set(trainer, "loss", "off: switched off")
    owner = _compute_loss_owner(trainer)
    if owner is not None:
        # A subclass's own compute_loss (TRL's SFTTrainer computes token accuracy from them, say) may read
        # the logits that the fused path never makes: keep the model's own path.
        return _set(trainer, "loss", f"off: {owner}.compute_loss is overridden and may need the logits")
    from .loss.model_patch import enable_fused_loss

    reason = enable_fused_loss(model)
    _set(trainer, "loss", "on" if reason is None else f"off: {reason}")


def _compute_loss_owner(trainer: Any) -> str | None:
    """The name of the class whose compute_loss the trainer runs, unless it is transformers' or ours."""
    import transformers

    for cls in type(trainer).__mro__:
        if "compute_loss" in cls.__dict__:
            if cls is transformers.Trainer or cls.__module__.startswith("fasttrain."):
                return None
            return cls.__qualname__
    return None


def compute_loss(original: Callable[..., Any], trainer: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any):
    with _once(trainer, "loss") as outer:
        if outer:
            ensure_fused_loss(trainer)
        return original(model, inputs, *args, **kwargs)


def prediction_step(original: Callable[..., Any], trainer: Any, model: Any, inputs: Any, prediction_loss_only: bool, *args: Any, **kwargs: Any):
    """In evaluation the logits are kept unless only the loss is wanted."""
    with _once(trainer, "prediction_step") as outer:
        if outer:
            ensure_fused_loss(trainer)  # an evaluation before any training decides here
        if not outer or status_of(trainer)["loss"] != "on":
            return original(model, inputs, prediction_loss_only, *args, **kwargs)
        from .loss.model_patch import set_eval_fused

        set_eval_fused(trainer.model, bool(prediction_loss_only))
        try:
            return original(model, inputs, prediction_loss_only, *args, **kwargs)
        finally:
            set_eval_fused(trainer.model, False)


class HotPathReport(TrainerCallback):
    """At train start, once the optimizer, dataloader and model wrappers exist: settle every path's status
    and say in one log line which hot paths are active and which fell back and why."""

    def __init__(self, trainer: Any) -> None:
        self._trainer = weakref.ref(trainer)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self._trainer()
        if trainer is None:
            return
        ensure_fused_loss(trainer)
        status = status_of(trainer)
        if status["optimizer"] == "pending":
            fused = find_fused_adamw(trainer.optimizer) is not None
            _set(trainer, "optimizer", "on" if fused else "off: the Trainer was given its optimizer")
        if status["clip"] == "pending":
            fused, reason = _fused_clip_target(trainer, trainer.model)
            _set(trainer, "clip", "on" if fused is not None else f"off: {reason}")
        if status["sampler"] == "pending":
            _set(trainer, "sampler", "off: the Trainer built no length-grouped sampler")
        log_summary(trainer)


def attach(trainer: Any) -> None:
    """After ``Trainer.__init__``: swap the collator and register the status report (once per trainer)."""
    if getattr(trainer, "_fasttrain_attached", False):
        return
    trainer._fasttrain_attached = True
    status_of(trainer)
    swap_collator(trainer)
    trainer.add_callback(HotPathReport(trainer))
