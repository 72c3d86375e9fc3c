"""The one seam between fasttrain and a ``transformers.Trainer``: ``apply(trainer, hot_paths)``.

``fasttrain.Trainer.__init__`` and the ``__init__`` that ``fasttrain.patch()`` wraps call ``apply`` once, after the
Trainer's own ``__init__``; nothing else of fasttrain touches the Trainer. It uses public extension points:

- collator: ``trainer.data_collator`` becomes the Rust equivalent of a transformers (or TRL) collator;
- packing: ``get_train_dataloader`` builds the training loader with that collator wrapped in
  ``data.packing.PackingCollator`` (padded batch -> one padding-free row, where exact), and ``training_step``
  sees the packed batches arrive (the evidence); evaluation loaders stay padded;
- optimizer: the trainer's ``create_optimizer`` (a documented override point) hands ``FusedAdamW`` to the
  Trainer through ``optimizer_cls_and_kwargs``, with the kwargs transformers itself derives from the arguments at
  that moment (hyperparameter search changes them per trial); under DeepSpeed it becomes the client optimizer
  that ZeRO steps on its flat fp32 partitions (the engine clips), unless the DeepSpeed config has an
  ``optimizer`` section (then ``training_step`` finds DeepSpeed's optimizer, to settle the status at its step);
- loss: the model's forward, per instance (``model_init`` wrapped so a rebuilt model gets it too), and
  ``prediction_step`` so a loss-only evaluation takes the fused path;

and private Trainer methods only where no public point exists, each checked against the signature it expects
(a different transformers keeps its own code, and the status says why):

- sampler: ``_get_train_sampler`` (the length-grouped sampler);
- clip: ``_clip_grad_norm`` / ``_get_grad_norm`` (the norm in one pass; the clip applied inside the next step).

Overrides are instance attributes calling the class's own method (a subclass's override runs as before);
they hold the trainer weakly. The Trainer's callbacks, arguments, logs and checkpoints are not touched.

Status is true by construction: ``trainer.fasttrain_status`` maps each path to ``"on"`` only once evidence shows
it ran (FusedAdamW stepped, a deferred clip was applied, the fused loss ran, the Rust collator is the one the
Trainer's loaders call, the Rust sampler was iterated, a packed batch reached training_step); until then ``"off: <why>"``. It is settled, and logged in
one line (INFO, or WARNING when a path the user wanted fell back), after the first optimizer step.
"""

from __future__ import annotations

import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import transformers

from ._logging import log_once, logger
from .hot_paths import HotPaths
from .optim.options import fused_adamw_options

_ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
NOT_RUN = "off: has not run yet"


class _Seam:
    """What fasttrain did to one trainer: the paths asked for, the status, and where to look for evidence."""

    def __init__(self, trainer: Any, paths: HotPaths) -> None:
        self.paths = paths
        self.status: dict[str, str] = {
            name: NOT_RUN if getattr(paths, name) else "off: switched off" for name in HotPaths.names()
        }
        self.trainer = weakref.ref(trainer)
        self.fallbacks: set[str] = set()  # paths the user wanted that could not run
        self.sampler: Any = None  # the Rust sampler we built (weakly referenced by the loader anyway)
        self.trl = False  # a TRL trainer: its fused LM head is served by fasttrain's kernel
        self.trl_decided = False
        self.logged = False
        self.settle_hooked: weakref.ref[Any] | None = (
            None  # the optimizer whose first step settles the status
        )
        self.packer: Any = None  # the PackingCollator of the last training loader built
        self.packed_steps = 0  # training steps whose inputs were a packed batch

    def off(self, name: str, reason: str, fallback: bool = True) -> None:
        """Record why ``name`` does not run; ``fallback`` when the user asked for it and it could apply."""
        if getattr(self.paths, name) and fallback:
            # decided after the status line: say it now, unless the status line already said this very reason
            if self.logged and self.status.get(name) != f"off: {reason}":
                log_once(f"fallback:{name}:{reason}", f"fasttrain: the {name} hot path falls back ({reason})")
            self.fallbacks.add(name)
        self.status[name] = f"off: {reason}"


def seam_of(trainer: Any) -> _Seam:
    return trainer.__dict__["_fasttrain_seam"]


def apply(trainer: Any, hot_paths: HotPaths | None = None) -> None:
    """Switch fasttrain's hot paths on for ``trainer`` (once, right after ``Trainer.__init__``)."""
    seam = _Seam(trainer, HotPaths.from_env(hot_paths))
    trainer.__dict__["_fasttrain_seam"] = seam
    trainer.hot_paths = seam.paths
    trainer.fasttrain_status = seam.status
    _override(trainer, "create_optimizer", _create_optimizer)  # also settles the status after one step
    if _deepspeed_config(trainer) is not None:
        _arm_deepspeed(trainer, seam)
    if seam.paths.collator:
        _swap_collator(trainer, seam)
    if seam.paths.packing:
        _arm_packing(trainer, seam)
    if seam.paths.sampler:
        _arm_sampler(trainer, seam)
    if seam.paths.clip:
        _arm_clip(trainer, seam)
    if seam.paths.loss:
        _arm_loss(trainer, seam)


def _override(trainer: Any, name: str, hook: Callable[..., Any]) -> None:
    """``trainer.<name>(...)`` becomes ``hook(trainer, <the class's bound method>, ...)``; a second hook on the
    same name wraps the first (the first's ``original`` stays the class's method)."""
    method = getattr(type(trainer), name)
    previous = trainer.__dict__.get(name)
    ref = weakref.ref(trainer)

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        this = ref()
        return hook(this, previous if previous is not None else method.__get__(this), *args, **kwargs)

    trainer.__dict__[name] = call


def _private_hook_problem(trainer: Any, name: str, parameters: tuple[str, ...]) -> str | None:
    """Why the private ``Trainer.<name>`` cannot be hooked here (None when it can)."""
    reference = getattr(transformers.Trainer, name, None)
    if reference is None:
        return f"transformers {transformers.__version__} has no Trainer.{name}"
    if tuple(inspect.signature(reference).parameters)[1:] != parameters:
        return f"Trainer.{name} in transformers {transformers.__version__} has another signature"
    owner = next(c for c in type(trainer).__mro__ if name in c.__dict__)
    if owner is not transformers.Trainer:
        return f"{owner.__name__} overrides {name}"
    return None


def _settle(seam: _Seam, optimizer: Any) -> None:
    """After the first optimizer step: every path has had its chance to run. Read the evidence, log one line."""
    trainer = seam.trainer()
    if trainer is None or seam.logged:
        return
    from .optim import FusedAdamW

    status = seam.status
    if status["optimizer"] == NOT_RUN:
        if isinstance(optimizer, FusedAdamW):
            status["optimizer"] = "on"
        else:
            seam.off(
                "optimizer",
                f"the Trainer's optimizer is {type(optimizer).__qualname__}, given or built by it",
            )
    if status["clip"] == NOT_RUN:
        if isinstance(optimizer, FusedAdamW) and optimizer.deferred_clips_applied:
            status["clip"] = "on"
        else:
            seam.off("clip", "the Trainer did not clip through _clip_grad_norm")
    if status["loss"] == NOT_RUN:
        if _fused_loss_calls(trainer):
            status["loss"] = "on"
        elif getattr(trainer, "label_smoother", None) is not None:
            # the Trainer takes the labels out of the inputs and smooths the loss from the logits itself
            smoothing = trainer.args.label_smoothing_factor
            reason = (
                f"label_smoothing_factor={smoothing}: the Trainer computes the smoothed loss from the logits"
            )
            seam.off("loss", reason)
        else:
            seam.off("loss", "no training forward took the fused path (no labels?)")
    if status["collator"] == NOT_RUN:
        # the Trainer's loaders call trainer.data_collator (in worker processes too): ours, if it still is
        if type(trainer.data_collator).__module__.startswith("fasttrain."):
            status["collator"] = "on"
        else:
            seam.off("collator", "trainer.data_collator was replaced after __init__", fallback=False)
    if status["sampler"] == NOT_RUN:
        if seam.sampler is not None and seam.sampler.iterations_started:
            status["sampler"] = "on"
        else:
            seam.off("sampler", "the Trainer built no length-grouped sampler")
    if status["packing"] == NOT_RUN:
        if seam.packed_steps:
            status["packing"] = "on"
        elif seam.packer is not None and seam.packer.last_refusal is not None:
            packer = seam.packer  # packing cheaper batches only is a choice, not a fallback
            reason = f"every batch stayed padded ({packer.last_refusal})"
            seam.off("packing", reason, fallback=not packer.last_refusal_for_cost)
        else:
            seam.off("packing", "no packed batch reached training_step")
    seam.logged = True
    line = ", ".join(f"{name}={value}" for name, value in status.items())
    level = logging.WARNING if seam.fallbacks else logging.INFO
    logger.log(level, "fasttrain hot paths: %s", line)


# ---------------------------------------------------------------------------------------------------------
# collator


def _swap_collator(trainer: Any, seam: _Seam) -> None:
    from .data.collators import native_equivalent, replaced_in_kind, why_no_native_equivalent

    current = trainer.data_collator
    if type(current).__module__.startswith("fasttrain."):
        return  # already ours ("on" once the Trainer's loaders run it)
    native = native_equivalent(current)
    if native is None:
        # a masked-LM collator, or one the probe refused (this transformers makes other batches, or has a field
        # we do not know), is a class we replace in kind but not here: a fallback; a user's own function or
        # subclass is simply not ours to replace
        seam.off("collator", why_no_native_equivalent(current), fallback=replaced_in_kind(current))
        return
    trainer.data_collator = native


# ---------------------------------------------------------------------------------------------------------
# packing


def _arm_packing(trainer: Any, seam: _Seam) -> None:
    _override(trainer, "get_train_dataloader", _train_dataloader)
    _override(trainer, "training_step", _packing_evidence)


def _packing_problem(trainer: Any) -> str | None:
    """Why the training batches stay padded (None: they pack, each batch checked again by the packer)."""
    from .data import packing

    args = trainer.args
    problem = packing.collator_problem(trainer.data_collator) or packing.model_problem(trainer.model)
    if problem is not None:
        return problem
    trl = _is_trl_trainer(trainer)
    for name in ("compute_loss", "training_step"):
        owner = next(c for c in type(trainer).__mro__ if name in c.__dict__)
        if owner is not transformers.Trainer and not (trl and owner.__module__.split(".")[0] == "trl"):
            return f"{owner.__name__}.{name} is overridden and may read the padded batch"
    shifts = getattr(trainer, "_loss_shifts_labels", None)
    if shifts is None:
        # transformers 4.x counts num_items_in_batch over every label, each example's first one included: a packed
        # row ignores those, so the loss would be divided by another count than the padded batch's
        return (
            f"transformers {transformers.__version__} counts num_items_in_batch over unshifted labels "
            "(a packed row would change the loss's denominator)"
        )
    if shifts is False:
        return "the Trainer does not treat the loss as a causal LM's (it counts unshifted labels)"
    if trainer.compute_loss_func is not None:
        return "compute_loss_func is set (a loss of the user's own may read the padded shape)"
    if getattr(trainer, "label_smoother", None) is not None:
        return f"label_smoothing_factor={args.label_smoothing_factor} is not verified on packed rows"
    if getattr(args, "neftune_noise_alpha", None) is not None:
        return "neftune_noise_alpha scales its noise by the padded length"
    seen = getattr(args, "include_num_input_tokens_seen", "no")
    if seen not in ("no", False, None):
        return f"include_num_input_tokens_seen={seen!r} counts the padded batch's tokens"
    if args.n_gpu > 1:
        return f"DataParallel over {args.n_gpu} GPUs splits the batch's rows"
    for parallel in ("get_cp_size", "get_sp_size"):
        size = getattr(trainer, parallel, lambda: 1)()
        if size > 1:
            return f"{parallel[4:6]} parallelism of size {size} splits the sequence"
    return None


def _train_dataloader(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The training loader, its collator wrapped by the packer for as long as the loader is built (its
    ``collate_fn`` keeps the packer; evaluation loaders read ``trainer.data_collator`` and stay padded)."""
    from .data.packing import FLASH_ATTENTION, PackingCollator, PackingCost

    seam = seam_of(trainer)
    problem = _packing_problem(trainer)
    if problem is not None:
        seam.off("packing", problem, fallback=False)
        return original(*args, **kwargs)
    collator = trainer.data_collator
    attention = getattr(trainer.model.config, "_attn_implementation", None)
    cost = PackingCost(trainer.model.config, attention)
    seam.packer = PackingCollator(collator, flash=attention in FLASH_ATTENTION, cost=cost)
    if not seam.logged:
        seam.status["packing"] = NOT_RUN  # an earlier loader may have said off
    trainer.data_collator = seam.packer
    try:
        return original(*args, **kwargs)
    finally:
        trainer.data_collator = collator


def _packing_evidence(
    trainer: Any, original: Callable[..., Any], model: Any, inputs: Any, *args: Any, **kwargs: Any
) -> Any:
    from .data.packing import PackedBatch

    if isinstance(inputs, PackedBatch):
        seam_of(trainer).packed_steps += 1
    return original(model, inputs, *args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# sampler


def _grouping_asked(args: Any) -> bool:
    return getattr(args, "train_sampling_strategy", None) == "group_by_length" or bool(
        getattr(args, "group_by_length", False)
    )


def _arm_sampler(trainer: Any, seam: _Seam) -> None:
    if not _grouping_asked(trainer.args):
        seam.off("sampler", "group_by_length is not set", fallback=False)
        return
    problem = _private_hook_problem(trainer, "_get_train_sampler", ("train_dataset",))
    if problem is not None:
        seam.off("sampler", problem)
        return
    _override(trainer, "_get_train_sampler", _train_sampler)


def _train_sampler(trainer: Any, original: Callable[..., Any], train_dataset: Any = None) -> Any:
    seam = seam_of(trainer)
    dataset = trainer.train_dataset if train_dataset is None else train_dataset
    from transformers.trainer_utils import has_length

    if not _grouping_asked(trainer.args) or dataset is None or not has_length(dataset):
        return original(train_dataset)
    from .data.lengths import lengths_from_dataset
    from .data.sampler import LengthGroupedSampler

    processing_class = getattr(trainer, "processing_class", None)
    names = getattr(processing_class, "model_input_names", None)
    model_input_name = names[0] if names else None
    # The Trainer drops unused columns (`length` too) before it builds the sampler: read the length column
    # from the dataset it was given when it is the same rows, else the token lists' Arrow offsets.
    column = trainer.args.length_column_name
    given = trainer.train_dataset
    # An empty dataset takes transformers' own decision on the dataset it sees, so that it fails where
    # transformers' sampler fails (IndexError at construction when that dataset has no length column).
    source = (
        given if column in getattr(given, "column_names", ()) and len(given) == len(dataset) > 0 else dataset
    )
    if len(source) == 0 and column not in getattr(source, "column_names", ()):
        lengths = None  # the sampler then raises IndexError at construction, as transformers' does
    else:
        lengths = lengths_from_dataset(source, model_input_name or "input_ids", length_column=column)
    seam.sampler = LengthGroupedSampler(
        trainer.args.train_batch_size * trainer.args.gradient_accumulation_steps,
        dataset=dataset,
        lengths=lengths,
        model_input_name=model_input_name,
    )
    return seam.sampler


# ---------------------------------------------------------------------------------------------------------
# optimizer


def _create_optimizer(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    seam = seam_of(trainer)
    model = (args[0] if args else kwargs.get("model")) or trainer.model
    fused_kwargs = _fused_adamw_kwargs(trainer, seam, model) if trainer.optimizer is None else None
    if fused_kwargs is None:
        optimizer = original(*args, **kwargs)
    else:
        from .optim import FusedAdamW

        trainer.optimizer_cls_and_kwargs = (FusedAdamW, fused_kwargs)
        try:
            optimizer = original(*args, **kwargs)
        finally:
            trainer.optimizer_cls_and_kwargs = None
    # not Accelerate's DummyOptim (a DeepSpeed `optimizer` section): training_step finds DeepSpeed's optimizer
    if isinstance(optimizer, torch.optim.Optimizer) and not seam.logged:
        _settle_after_first_step(seam, optimizer)
    return optimizer


def _fused_adamw_kwargs(trainer: Any, seam: _Seam, model: Any) -> dict[str, Any] | None:
    """FusedAdamW's kwargs for the AdamW the Trainer would build now, or None (the reason in the status)."""
    if not seam.paths.optimizer:
        return None
    args = trainer.args
    optim = str(getattr(args.optim, "value", args.optim))
    reason, fallback = None, True
    if trainer.optimizer_cls_and_kwargs is not None:
        reason, fallback = "the Trainer was given optimizer_cls_and_kwargs", False
    elif optim not in _ADAMW_OPTIMS:
        reason, fallback = f"optim={optim} is not an AdamW fasttrain replaces", False
    elif "optimizer" in (_deepspeed_config(trainer) or {}):
        reason, fallback = _DEEPSPEED_OPTIMIZER, False
    else:
        cls, kwargs = trainer.get_optimizer_cls_and_kwargs(args, model)
        if cls is not torch.optim.AdamW:
            reason = f"optim={optim} resolved to {cls.__module__}.{cls.__qualname__}"
    if reason is not None:
        seam.off("optimizer", reason, fallback)
        return None
    # lr, betas and eps as transformers derives them; weight decay comes with the Trainer's parameter groups
    kwargs = {k: v for k, v in kwargs.items() if k not in ("fused", "foreach")}
    options = fused_adamw_options(args)
    if _deepspeed_config(trainer) is not None and options.get("bf16_stochastic_rounding"):
        raise ValueError(
            "optim_args: bf16_stochastic_rounding=true has no effect under DeepSpeed ZeRO: FusedAdamW steps "
            "DeepSpeed's fp32 master partitions and DeepSpeed rounds them to bf16 itself; drop the option"
        )
    return {**kwargs, **options}


def _initialising_state_for_load() -> bool:
    """Inside torch's ``_init_optim_state``: loading a sharded optimizer checkpoint (FSDP2 resume, through
    ``set_optimizer_state_dict``) first steps the optimizer once with zero gradients and lr 0 to create its state.
    That step is no training step: settling there would declare the clip and loss off before they could run."""
    frame = sys._getframe(1)
    for _ in range(8):  # the hook is called a few frames below the optimizer's step
        frame = frame.f_back
        if frame is None:
            return False
        if frame.f_code.co_name == "_init_optim_state" and "checkpoint" in frame.f_code.co_filename:
            return True
    return False


def _settle_after_first_step(seam: _Seam, optimizer: torch.optim.Optimizer) -> None:
    # One hook per optimizer (under DeepSpeed the Trainer calls create_optimizer twice and gets the same one
    # back). It stays registered and does nothing once settled: removing itself would mutate the optimizer's
    # hook dict while torch iterates it ("OrderedDict mutated during iteration" as soon as any post-hook
    # follows ours).
    hooked = seam.settle_hooked
    if hooked is not None and hooked() is optimizer:
        return

    def hook(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not seam.logged and not _initialising_state_for_load():
            _settle(seam, opt)

    optimizer.register_step_post_hook(hook)
    seam.settle_hooked = weakref.ref(optimizer)


# ---------------------------------------------------------------------------------------------------------
# DeepSpeed

_DEEPSPEED_OPTIMIZER = "DeepSpeed's config chose the optimizer (its `optimizer` section)"


def _deepspeed_config(trainer: Any) -> dict[str, Any] | None:
    """The DeepSpeed config dict of a trainer that runs under DeepSpeed, else None."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return None
    plugin = getattr(trainer.accelerator.state, "deepspeed_plugin", None)
    return getattr(plugin, "deepspeed_config", None) or {}


def _arm_deepspeed(trainer: Any, seam: _Seam) -> None:
    """Under DeepSpeed the engine clips (``gradient_clipping``) and its ZeRO optimizer steps the client
    optimizer (FusedAdamW, on DeepSpeed's flat fp32 partitions) unless the config has an ``optimizer`` section.
    Then the Trainer's create_optimizer returns Accelerate's DummyOptim and DeepSpeed builds the optimizer inside
    its engine: the status settles at that optimizer's first step, found at the first training_step (the engine
    exists by then). Not create_scheduler: DeepSpeed's scheduler callable calls it on a copy of the trainer."""
    if "optimizer" in _deepspeed_config(trainer):
        if seam.paths.optimizer:
            seam.off("optimizer", _DEEPSPEED_OPTIMIZER, fallback=False)
        _override(trainer, "training_step", _training_step)


def _training_step(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    seam = seam_of(trainer)
    if not seam.logged and seam.settle_hooked is None:
        optimizer = trainer.optimizer
        while getattr(optimizer, "optimizer", None) is not None:  # Accelerate's, DeepSpeed's, ZeRO's wrappers
            optimizer = optimizer.optimizer
        if isinstance(optimizer, torch.optim.Optimizer):
            _settle_after_first_step(seam, optimizer)
    return original(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------------
# clipping


def _arm_clip(trainer: Any, seam: _Seam) -> None:
    clipping = bool(trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0)
    if not seam.paths.optimizer:
        seam.off("clip", "the optimizer hot path is switched off", fallback=False)
        return
    if _deepspeed_config(trainer) is not None:
        # the engine clips the partitions before its optimizer steps: a fused clip would clip twice
        seam.off("clip", _DEEPSPEED_CLIPS, fallback=False)
        return
    problem = _private_hook_problem(trainer, "_clip_grad_norm", ("model",)) or _private_hook_problem(
        trainer, "_get_grad_norm", ("model", "grad_norm")
    )
    if problem is not None:
        seam.off("clip", problem, fallback=clipping)
        return
    if not clipping:
        # no clipping asked: the norm the Trainer logs still comes from the one-pass kernel (_get_grad_norm)
        seam.off("clip", f"max_grad_norm={trainer.args.max_grad_norm}: no clipping", fallback=False)
    _override(trainer, "_clip_grad_norm", _clip_grad_norm)
    _override(trainer, "_get_grad_norm", _get_grad_norm)


_DEEPSPEED_CLIPS = "DeepSpeed clips inside its engine"  # its gradient_clipping setting


def _clip_grad_norm(trainer: Any, original: Callable[..., Any], model: Any) -> Any:
    """The norm in one pass; the clip applied inside the next FusedAdamW step (no pass over the gradients)."""
    fused = _fused_clip_target(trainer, model)
    if fused is None:
        return original(model)
    return fused.defer_clip_grad_norm_(trainer.args.max_grad_norm)


def _get_grad_norm(trainer: Any, original: Callable[..., Any], model: Any, grad_norm: Any = None) -> Any:
    """Without clipping (max_grad_norm=0) the Trainer still logs the norm: compute it in one pass."""
    if grad_norm is None:
        fused = _fused_clip_target(trainer, model)
        if fused is not None:
            grad_norm = fused.defer_clip_grad_norm_(float("inf"))
    return original(model, grad_norm=grad_norm)


def _fused_clip_target(trainer: Any, model: Any) -> Any:
    """The FusedAdamW whose next step can apply the clip, or None (the reason recorded in the status)."""
    from accelerate.utils import DistributedType

    from .optim import FusedAdamW

    seam = seam_of(trainer)
    optimizer = trainer.optimizer
    while optimizer is not None and not isinstance(optimizer, FusedAdamW):
        optimizer = getattr(optimizer, "optimizer", None)  # Accelerate's (and others') wrappers
    accelerator = trainer.accelerator
    kind = accelerator.distributed_type
    reader = _gradient_reading_callback(trainer)
    reason, fallback = None, True
    if optimizer is None:
        reason, fallback = "the optimizer is not fasttrain's FusedAdamW", seam.paths.optimizer
    elif reader is not None:
        reason = f"callback {reader} reads gradients between the clip and the step"
    elif kind == DistributedType.DEEPSPEED:
        reason, fallback = _DEEPSPEED_CLIPS, False
    elif kind == DistributedType.FSDP and not getattr(accelerator, "is_fsdp2", False):
        reason = "FSDP1 clips through its own wrapper"
    elif kind not in (
        DistributedType.NO,
        DistributedType.MULTI_CPU,
        DistributedType.MULTI_GPU,
        DistributedType.FSDP,
    ):
        reason = f"distributed type {getattr(kind, 'value', kind)} is not supported by the fused clip"
    elif getattr(accelerator, "scaler", None) is not None:
        reason = "fp16 GradScaler: Accelerate unscales the gradients before clipping"
    elif callable(getattr(trainer, "_has_mixed_mesh_grads", None)) and trainer._has_mixed_mesh_grads(model):
        reason = "gradients on several device meshes"
    elif not _optimizer_covers_all_grads(optimizer, model):
        reason = "the model has gradients the optimizer does not update"
    if reason is not None:
        if trainer.args.max_grad_norm and trainer.args.max_grad_norm > 0:
            seam.off("clip", reason, fallback)
        return None
    return optimizer


def _gradient_reading_callback(trainer: Any) -> str | None:
    """A callback that may look at the gradients after the clip (they stay unclipped until the step)."""
    base = transformers.TrainerCallback
    for callback in trainer.callback_handler.callbacks:
        cls = type(callback)
        for event in ("on_pre_optimizer_step", "on_optimizer_step"):
            if getattr(cls, event, None) is not getattr(base, event):
                return f"{cls.__name__}.{event}"
    return None


def _optimizer_covers_all_grads(optimizer: Any, model: Any) -> bool:
    # The Trainer clips model.parameters(); the fused norm runs over the optimizer's parameters. They agree
    # when every trainable parameter is one the optimizer updates (checked once: the sets are static).
    cached = optimizer.__dict__.get("_fasttrain_covers_model")
    if cached is None:
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        cached = all(id(p) in owned for p in model.parameters() if p.requires_grad)
        optimizer.__dict__["_fasttrain_covers_model"] = cached
    return cached


# ---------------------------------------------------------------------------------------------------------
# loss


def _compute_loss_owner(trainer: Any) -> type | None:
    """The class whose compute_loss the trainer runs, unless it is transformers' own."""
    owner = next(c for c in type(trainer).__mro__ if "compute_loss" in c.__dict__)
    return None if owner is transformers.Trainer else owner


def _is_trl_trainer(trainer: Any) -> bool:
    return any(cls.__module__.split(".")[0] == "trl" for cls in type(trainer).__mro__)


def _arm_loss(trainer: Any, seam: _Seam) -> None:
    if _is_trl_trainer(trainer):
        # TRL computes its losses and metrics through its fused LM head, which it installs after
        # Trainer.__init__ returns: serve it from fasttrain's kernel at the first compute_loss
        seam.trl = True
        _override(trainer, "compute_loss", _trl_compute_loss)
        return
    owner = _compute_loss_owner(trainer)
    if owner is not None:
        # A subclass's own compute_loss may read the logits that the fused path never makes.
        seam.off("loss", f"{owner.__name__}.compute_loss is overridden and may need the logits")
        return
    if trainer.model_init is not None:
        model_init = trainer.model_init
        trainer.model_init = functools.wraps(model_init)(
            lambda *a: _enable_fused_loss(seam, model_init(*a))  # hyperparameter search rebuilds the model
        )
    if trainer.model is not None:
        _enable_fused_loss(seam, trainer.model)
    _override(trainer, "prediction_step", _prediction_step)


def _trl_compute_loss(trainer: Any, original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    seam = seam_of(trainer)
    if not seam.trl_decided:
        seam.trl_decided = True
        from .loss.trl_support import enable_for_trainer

        reason = enable_for_trainer(trainer)
        if reason is not None:
            seam.off("loss", reason)
    return original(*args, **kwargs)


def _enable_fused_loss(seam: _Seam, model: Any) -> Any:
    from .loss.model_patch import enable_fused_loss

    reason = enable_fused_loss(model)
    if reason is not None:
        seam.off("loss", reason)
    elif seam.status["loss"] != "on":
        seam.status["loss"] = NOT_RUN
    return model


def _fused_loss_calls(trainer: Any) -> int:
    if seam_of(trainer).trl:
        from .loss.trl_support import fused_calls

        return fused_calls(trainer)
    from .loss.model_patch import fused_loss_calls

    return fused_loss_calls(trainer.model) if trainer.model is not None else 0


def _prediction_step(
    trainer: Any,
    original: Callable[..., Any],
    model: Any,
    inputs: Any,
    prediction_loss_only: bool,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """A loss-only evaluation takes the fused path too; otherwise the logits are made as before."""
    from .loss.model_patch import set_eval_fused

    if not prediction_loss_only:
        return original(model, inputs, prediction_loss_only, *args, **kwargs)
    set_eval_fused(trainer.model, True)
    try:
        return original(model, inputs, prediction_loss_only, *args, **kwargs)
    finally:
        set_eval_fused(trainer.model, False)
