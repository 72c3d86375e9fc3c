"""Fused-linear cross-entropy inside causal-LM models: a per-instance forward wrapper.

``enable_fused_loss(model)`` replaces ``forward`` on the causal-LM *instance* (found under PEFT, DDP and
``torch.compile`` wrappers; the class is never touched, nor ``LOSS_MAPPING``, which the Trainer checks
by identity). The wrapper decides per call:

    fused path  iff  labels is not None
                and  (model.training  or  set_eval_fused(model, True) is in force)
                and  logits_to_keep is 0/None, return_dict is not False
                and  the model's loss_function is transformers' ForCausalLMLoss (no custom loss)
                and  the output weight is not a sharded FSDP2 DTensor (a ZeRO-3 partition is gathered by
                     DeepSpeed when read inside the forward)

Otherwise the model's own forward runs unchanged (with logits). So generation and calls without labels
keep logits; evaluation keeps logits unless the caller says it only needs the loss
(``set_eval_fused(model, True)``, meant for the Trainer's ``prediction_loss_only`` evaluation).

The fused path runs the backbone (``model.<base_model_prefix>``, else ``model.model``) with the same arguments
the model's forward would pass it, then computes exactly ``ForCausalLMLoss``: labels padded with ``ignore_index``
and shifted left by one (or ``shift_labels`` as given), the sum of token losses divided by
``num_items_in_batch`` when given, else the mean over non-ignored tokens; Gemma2/Gemma3's
``final_logit_softcapping`` is applied as ``softcap``. It returns ``CausalLMOutputWithPast`` with
``logits=None`` and the backbone's cache / hidden states / attentions. A tied input embedding hands its gradient
rows into the head's gradient without a dense copy (``tied_embedding``; same values).

"Equal" to the unpatched model: in fp32, loss and gradients agree to float rounding (~1e-6 relative).
In bf16 the reference rounds the logits to bf16 (and applies the softcap in bf16) before its fp32
loss; we compute the same bf16 logits chunk by chunk but softcap in fp32 and accumulate the weight
gradient in fp32, so bf16 results agree to bf16 precision (a few 1e-3 relative), not bit for bit.

Distributed: under FSDP2 with the output layer in the root unit (the usual layout: only decoder layers
are sharded separately) the root's forward has already unsharded ``lm_head.weight``, which we read as a
plain tensor and whose gradient FSDP2 reduce-scatters as usual. If the weight is still a sharded DTensor
at call time (lm_head sharded on its own), reading it directly would use a shard, so the call takes the
model's own path and says so once in the log — unless lm_head shares its FSDP2 unit with a module the
backbone runs (Accelerate's FSDP2 preparation: one unit [final norm, lm_head], not resharded after the
forward): then the backbone's call of the norm all-gathers the unit once, and the weight read after the
backbone is whole. Under DeepSpeed ZeRO-3 the weight is a partitioned parameter
(``ds_id``; an empty placeholder outside the forward): read inside the model's forward, DeepSpeed gathers it
whole and registers it as an external parameter of the running module (released after the forward, gathered
again for the backward, its gradient reduce-scattered as usual). So the weight the loss uses is read once
per forward, after the backbone (a weight tied to the input embedding is released again when the embedding's
forward ends), and handed to every chunk; never held from an earlier call. A weight still partitioned after
that read (its shape is not its ``ds_shape``) raises a RuntimeError rather than train on a placeholder.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from .._logging import log_once
from ..families import fused_loss_classes
from ..labels import IGNORE_INDEX, shift_labels
from . import tied_embedding
from .function import fused_linear_cross_entropy
from .lazy_logits import LazyLogitsOutput, logits_thunk
from .model_token_stats import TOKEN_STATS_KWARG, token_stats
from .trl_support import is_trl_head

__all__ = [
    "disable_fused_loss",
    "enable_fused_loss",
    "fused_loss_calls",
    "fused_loss_enabled",
    "fused_loss_problem",
    "fused_loss_usage",
    "set_eval_fused",
]

_STATE_ATTR = "_fasttrain_fused_loss"
_NOT_BACKBONE_ARGS = ("labels", "logits_to_keep")


@dataclasses.dataclass
class _FusedLossState:
    original_forward: Callable[..., Any]
    instance_forward: Any  # the instance attribute `forward` had before, or _MISSING
    signature: inspect.Signature
    var_kwargs_name: str | None
    softcap: float | None
    active: bool = True
    eval_fused: bool = False
    fused_calls: int = 0  # forwards that took the fused path: the evidence behind a status "on"
    logits_reads: int = 0  # of those, the ones whose logits someone read (computed then, on demand)
    loss_backwards: int = 0  # of those, the ones whose loss a backward went through
    token_stats_calls: int = 0  # forwards that answered fasttrain_token_stats (model_token_stats)
    compiled_calls: int = 0  # of the fused forwards, the ones traced by torch.compile: no backward hook there

    def count_logits_read(self) -> None:
        self.logits_reads += 1

    def count_loss_backward(self, grad: torch.Tensor) -> None:
        self.loss_backwards += 1


_MISSING = object()
# the backbone outputs a causal LM's output carries (read here: Dynamo cannot trace ``dataclasses.fields`` of a
# class, and a graph break there would split a compiled forward)
_PASSED_OUTPUT_FIELDS = frozenset(f.name for f in dataclasses.fields(CausalLMOutputWithPast)) - {
    "loss",
    "logits",
}


def find_causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model under DDP / torch.compile / PEFT wrappers."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            model = model._orig_mod
        elif isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif hasattr(model, "get_base_model") and callable(model.get_base_model):  # peft.PeftModel
            model = model.get_base_model()
    return model


def _unsupported_reason(model: nn.Module) -> str | None:
    name = type(model).__name__
    supported = fused_loss_classes()  # checked against their transformers sources and tested (families.py)
    if name not in supported or not type(model).__module__.startswith("transformers.models."):
        return f"{name} is not a causal LM the fused loss knows (supported: {', '.join(sorted(supported))})"
    if is_trl_head(model.__dict__.get("forward")):
        return f"{name} has TRL's fused LM head (its trainer's loss is served by fasttrain.loss.trl_support)"
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        return f"{name}'s output layer is {type(head).__name__}, not a plain nn.Linear (e.g. LoRA on lm_head)"
    if backbone_of(model) is None:
        return f"{name} has no backbone at .{getattr(model, 'base_model_prefix', '?')} or .model"
    return None


def backbone_of(model: nn.Module) -> nn.Module | None:
    """The decoder the causal LM's own forward calls: ``model.<base_model_prefix>``, else ``model.model`` (in
    transformers 4.57 Gemma3ForCausalLM's prefix is ``language_model``, for loading multimodal checkpoints, while
    its forward calls ``self.model``)."""
    for attribute in (getattr(model, "base_model_prefix", ""), "model"):
        backbone = getattr(model, attribute, None) if attribute else None
        if isinstance(backbone, nn.Module):
            return backbone
    return None


def _dtensor_problem(weight: torch.Tensor) -> str | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    if isinstance(weight, DTensor):
        return "the output weight is a sharded FSDP2 DTensor (lm_head sharded on its own)"
    return None


def _unsharded_by_backbone(head: nn.Module, backbone: nn.Module) -> bool:
    """lm_head shares its FSDP2 unit with a module the backbone runs (Accelerate's FSDP2 preparation puts the
    final norm and lm_head in one unit, kept unsharded after the forward): the backbone's call of that module
    all-gathers the unit once, so after the backbone ``head.weight`` is the whole weight."""
    get_state = getattr(head, "_get_fsdp_state", None)
    if get_state is None:
        return False
    in_backbone = {id(m) for m in backbone.modules()}
    return any(m is not head and id(m) in in_backbone for m in getattr(get_state(), "_modules", ()))


def _zero3_problem(weight: torch.Tensor) -> str | None:
    if hasattr(weight, "ds_id") and tuple(weight.shape) != tuple(getattr(weight, "ds_shape", weight.shape)):
        return "the output weight is a DeepSpeed ZeRO-3 partition that was not gathered inside the forward"
    return None


def _unread_weight(head: nn.Module) -> torch.Tensor:
    # the parameter object itself: under ZeRO-3 `head.weight` (and `_parameters["weight"]`: DeepSpeed's
    # parameter dict gathers on item access) in the forward gathers it, which the check before the backbone
    # must not do (the weight would be held whole through the backbone); iterating the items does not gather
    return dict(head._parameters.items())["weight"]


def _fused_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    state: _FusedLossState = self.__dict__[_STATE_ATTR]
    if TOKEN_STATS_KWARG in kwargs:
        return _token_stats_forward(self, state, args, kwargs)
    if not state.active:
        return state.original_forward(*args, **kwargs)
    try:
        arguments = dict(state.signature.bind(*args, **kwargs).arguments)
    except TypeError:
        return state.original_forward(*args, **kwargs)  # let the model raise its own error
    if state.var_kwargs_name is not None:
        arguments.update(arguments.pop(state.var_kwargs_name, {}))

    labels = arguments.get("labels")
    if (
        labels is None
        or arguments.get("fused_lm_head")  # TRL's fused-head call: trl_support serves those
        or not (self.training or state.eval_fused)
        or arguments.get("return_dict") is False
        or arguments.get("logits_to_keep") not in (None, 0)
    ):
        return state.original_forward(*args, **kwargs)
    from transformers.loss.loss_utils import ForCausalLMLoss

    if self.loss_function is not ForCausalLMLoss:
        log_once(
            f"fused-loss-custom:{id(self)}",
            f"fasttrain fused loss: {type(self).__name__} has a custom loss_function; keeping its own path",
        )
        return state.original_forward(*args, **kwargs)
    head = self.get_output_embeddings()
    backbone = backbone_of(self)
    problem = _dtensor_problem(_unread_weight(head))
    if problem is not None and not _unsharded_by_backbone(head, backbone):
        log_once(
            f"fused-loss-shard:{problem}",
            f"fasttrain fused loss: {problem}; keeping the model's own loss path",
        )
        return state.original_forward(*args, **kwargs)

    for name in _NOT_BACKBONE_ARGS:
        arguments.pop(name, None)
    # the model's forward hands its **kwargs (num_items_in_batch, shift_labels, ...) to the backbone too
    tied_embedding.forget(self)
    outputs = backbone(**arguments)
    hidden = outputs[0]  # [batch, seq, hidden]
    weight = _weight_after_backbone(head)

    ignore_index = arguments.get("ignore_index", IGNORE_INDEX)
    shifted = arguments.get("shift_labels")
    if shifted is None:
        shifted = shift_labels(labels, ignore_index)
    loss = fused_linear_cross_entropy(
        hidden,
        tied_embedding.expose(self, weight),
        shifted.to(hidden.device),
        head.bias,
        ignore_index=ignore_index,
        softcap=state.softcap,
        reduction="mean",
        num_items_in_batch=arguments.get("num_items_in_batch"),
    )
    state.fused_calls += 1
    passed = {k: v for k, v in outputs.items() if k in _PASSED_OUTPUT_FIELDS}
    if torch.compiler.is_compiling():
        # Dynamo cannot return the pending logits' closure from a graph: a compiled forward returns no logits,
        # and registers no backward hook (a hook on a traced intermediate breaks the graph): counted apart, so
        # that a missing backward count is not taken for a loss nobody trains on
        state.compiled_calls += 1
        return CausalLMOutputWithPast(loss=loss, logits=None, **passed)
    if loss.requires_grad:
        loss.register_hook(state.count_loss_backward)
    return LazyLogitsOutput(
        loss=loss, logits=logits_thunk(head, hidden, state.softcap, state.count_logits_read), **passed
    )


def _weight_after_backbone(head: nn.Module) -> torch.Tensor:
    """The output weight, read after the backbone, inside the forward, and handed whole to every chunk of the
    head: under ZeRO-3 this read gathers the weight (a tied weight was released again when the embedding's forward
    ended); under FSDP2 the backbone unsharded lm_head's unit (checked before the backbone ran)."""
    weight = head.weight
    problem = _zero3_problem(weight) or _dtensor_problem(weight)
    if problem is not None:
        raise RuntimeError(f"fasttrain fused loss: {problem} (read after the backbone ran)")
    return weight


def _token_stats_forward(self: nn.Module, state: _FusedLossState, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``model(..., fasttrain_token_stats=labels)``: per-token log-probs without the logits (``model_token_stats``),
    in training and evaluation alike (a reference model scores under ``no_grad``)."""
    labels = kwargs.pop(TOKEN_STATS_KWARG)
    if not state.active:
        raise RuntimeError(
            f"fasttrain: token log-probs were asked of {type(self).__name__} while its fused forward is off"
        )
    arguments = dict(state.signature.bind(*args, **kwargs).arguments)
    if state.var_kwargs_name is not None:
        arguments.update(arguments.pop(state.var_kwargs_name, {}))
    for name in (*_NOT_BACKBONE_ARGS, "return_dict"):
        arguments.pop(name, None)
    head = self.get_output_embeddings()
    backbone = backbone_of(self)
    problem = _dtensor_problem(_unread_weight(head))
    if problem is not None and not _unsharded_by_backbone(head, backbone):
        raise RuntimeError(f"fasttrain token log-probs: {problem}")
    hidden = backbone(**arguments)[0]
    state.token_stats_calls += 1
    return token_stats(hidden, _weight_after_backbone(head), head.bias, labels, state.softcap)


def _state(model: nn.Module) -> _FusedLossState | None:
    return find_causal_lm(model).__dict__.get(_STATE_ATTR)


def fused_loss_problem(model: nn.Module) -> str | None:
    """Why this model's loss cannot be fused (None: it can), without enabling anything."""
    return _unsupported_reason(find_causal_lm(model))


def enable_fused_loss(model: nn.Module) -> str | None:
    """Wrap the causal LM's forward (this instance only). Returns None when enabled, else a short reason
    why the model keeps its own path; it logs nothing (the caller reports the reason once). Idempotent."""
    target = find_causal_lm(model)
    state = target.__dict__.get(_STATE_ATTR)
    if state is not None:
        state.active = True
        tied_embedding.install(target)
        return None
    reason = _unsupported_reason(target)
    if reason is not None:
        return reason  # the caller reports it (once, in the status line)
    original = target.forward
    signature = inspect.signature(original)
    var_kwargs = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    softcap = getattr(target.config, "final_logit_softcapping", None)
    target.__dict__[_STATE_ATTR] = _FusedLossState(
        original_forward=original,
        instance_forward=target.__dict__.get("forward", _MISSING),
        signature=signature,
        var_kwargs_name=var_kwargs,
        softcap=float(softcap) if softcap else None,
    )
    # A bound method (not a plain function) so wrappers that take `model.forward.__func__` (Accelerate's
    # mixed-precision output conversion) keep working; `wraps` keeps the signature the Trainer inspects.
    target.forward = types.MethodType(_bound_wrapper(original), target)
    tied_embedding.install(target)
    return None


def wrap_again_if_replaced(model: nn.Module) -> bool:
    """Put the fused forward back on top when something replaced it after ``enable_fused_loss`` (the Trainer's
    ``use_liger_kernel=True`` installs Liger's fused-linear-cross-entropy forward on the instance when training
    starts). The replacement becomes the original forward (the path for calls without labels); the fused path
    runs the backbone, so layer kernels patched into it stay. True when it wrapped again."""
    target = find_causal_lm(model)
    state = target.__dict__.get(_STATE_ATTR)
    current = target.__dict__.get("forward")
    if (
        state is None
        or current is None
        or getattr(getattr(current, "__func__", None), "_fasttrain_fused", False)
    ):
        return False
    signature = inspect.signature(current)
    state.original_forward = current
    state.instance_forward = current
    state.signature = signature
    state.var_kwargs_name = next(
        (p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None
    )
    target.forward = types.MethodType(_bound_wrapper(current), target)
    return True


def _bound_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(getattr(original, "__func__", original))
    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return _fused_forward(self, *args, **kwargs)

    forward._fasttrain_fused = True  # type: ignore[attr-defined]
    return forward


def disable_fused_loss(model: nn.Module) -> None:
    """Restore the original forward exactly. If something has wrapped our forward since, the wrapper
    stays in place but passes every call straight to the original forward."""
    target = find_causal_lm(model)
    state = target.__dict__.get(_STATE_ATTR)
    if state is None:
        return
    current = target.__dict__.get("forward")
    tied_embedding.uninstall(target)
    if getattr(getattr(current, "__func__", None), "_fasttrain_fused", False):
        if state.instance_forward is _MISSING:
            del target.forward
        else:
            target.forward = state.instance_forward
        del target.__dict__[_STATE_ATTR]
    else:
        state.active = False


def fused_loss_enabled(model: nn.Module) -> bool:
    state = _state(model)
    return state is not None and state.active


def fused_loss_calls(model: nn.Module) -> int:
    """How many forwards of this model took the fused path so far (0 when it is not enabled)."""
    state = _state(model)
    return 0 if state is None else state.fused_calls


@dataclasses.dataclass(frozen=True)
class FusedLossUsage:
    """How a model's fused forwards were used so far: the evidence behind the status and the switch-off rule."""

    calls: int = 0  # forwards that took the fused path
    logits_reads: int = 0  # of those, the ones whose logits someone read
    loss_backwards: int = 0  # of those, the ones whose loss a backward went through
    token_stats: int = 0  # forwards that answered fasttrain_token_stats
    compiled: int = 0  # fused forwards traced by torch.compile (their backwards are not counted)

    def since(self, earlier: FusedLossUsage) -> FusedLossUsage:
        return FusedLossUsage(*(a - b for a, b in zip(self.counts(), earlier.counts(), strict=True)))

    def __add__(self, other: FusedLossUsage) -> FusedLossUsage:
        return FusedLossUsage(*(a + b for a, b in zip(self.counts(), other.counts(), strict=True)))

    def counts(self) -> tuple[int, ...]:
        return dataclasses.astuple(self)


def fused_loss_usage(model: nn.Module) -> FusedLossUsage:
    """The counters of this model's fused forwards (all zero when the fused loss is not enabled on it)."""
    state = _state(model)
    if state is None:
        return FusedLossUsage()
    return FusedLossUsage(
        state.fused_calls,
        state.logits_reads,
        state.loss_backwards,
        state.token_stats_calls,
        state.compiled_calls,
    )


def set_eval_fused(model: nn.Module, enabled: bool) -> None:
    """Let evaluation (``model.training`` False) with labels take the fused path (``logits=None``): for
    callers that only need the loss, e.g. the Trainer's ``prediction_loss_only`` evaluation."""
    state = _state(model)
    if state is not None:
        state.eval_fused = bool(enabled)
