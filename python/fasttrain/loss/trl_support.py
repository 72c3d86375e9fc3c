"""TRL's SFTTrainer and DPOTrainer on fasttrain's kernel: serve TRL's fused LM-head contract.

TRL (1.16) computes these trainers' losses and metrics from ``model(..., labels=..., fused_lm_head=True)``, a
per-instance forward that ``trl.trainer.utils.add_fused_lm_head`` installs at ``__init__``: it runs the backbone
and returns a ``FusedCausalLMOutput`` (per-token ``log_probs`` and, as configured, ``entropy``,
``log_sum_sq_probs``, ``mean_logits``, ``is_top1``, plus ``label_mask`` and the loss) without the logits.
``enable_for_trainer`` keeps that contract and that public switch, and puts fasttrain's chunked kernel behind
it (``fused_token_log_probs``: Triton on CUDA, the chunked torch path elsewhere), for the policy model and
DPO's reference model, instance by instance:

- under mixed precision, Accelerate wraps the model's forward in autocast when the Trainer prepares the
  model (after TRL installed its head): fasttrain's forward goes in TRL's place under that same wrapper, so
  both paths run under the autocast the reference runs under;
- calls without ``fused_lm_head=True`` (generation, ``compute_loss_func``, logits for metrics) go to TRL's
  forward unchanged, and so do calls fasttrain does not serve (MoE router logits, a ZeRO-3 partitioned head);
- the head's settings (temperature, logit scale, softcap, requested outputs, backbone attribute) are read from
  the forward TRL installed (its closure): that is private to TRL, so it is gated on the TRL versions this was
  tested with (``TESTED_TRL``) and on the names being there; otherwise a reason is returned and TRL keeps
  its own head;
- SFT's ``nll`` loss is ``-sum(log_probs) / n``: its gradient is ``-1/n`` on every scored token, so the forward
  computes the gradients for it (``uniform_grad``; used only where exact, see ``chunked_head``; else
  recomputed). DPO's gradients differ per sequence: the backward recomputes.

TRL's own kernel may still be the faster one on a GPU: ``KERNEL_CHOICE`` says which kernel serves each device
type and trainer, decided by ``benchmarks/gpu/bench_loss_gpu.py --trl``; where it says ``"trl"``,
``enable_for_trainer`` returns that reason and TRL's head stays.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any

import torch
from torch import nn

from .._logging import log_once
from .model_patch import find_causal_lm
from .token_logprobs import fused_token_log_probs

__all__ = ["KERNEL_CHOICE", "TESTED_TRL", "disable_for_trainer", "enable_for_trainer", "fused_calls"]

# TRL versions whose add_fused_lm_head layout this module was tested against: [first, last-excluded).
TESTED_TRL = ("1.16", "2.0")
# Which kernel serves TRL's fused head, per (device type, trainer kind): "fasttrain" or "trl".
# CPU: measured, fasttrain's is faster for both (benchmarks/results/loss_trl_cpu.md).
# CUDA: not measured yet; fasttrain's until benchmarks/gpu/bench_loss_gpu.py --trl says otherwise (SFT saves a
# matmul with fasttrain's speculation; DPO runs the same four matmuls as TRL, so the per-row kernels decide).
KERNEL_CHOICE = {
    ("cpu", "sft"): "fasttrain",
    ("cpu", "dpo"): "fasttrain",
    ("cuda", "sft"): "fasttrain",
    ("cuda", "dpo"): "fasttrain",
}

_STATE_ATTR = "_fasttrain_trl_head"
_CLOSURE_NAMES = (
    "backbone_attr",
    "cast_lm_head_to_fp32",
    "final_logit_softcapping",
    "logit_scale",
    "outputs",
    "temperature",
    "text_config",
)


@dataclasses.dataclass
class _HeadState:
    trl_forward: Any  # the bound forward TRL installed: every call fasttrain does not serve goes there
    settings: dict[str, Any]  # read from TRL's forward (see _CLOSURE_NAMES)
    uniform_grad: bool
    # the model's instance attributes fasttrain replaced, to put back on disable
    replaced: dict[str, Any] = dataclasses.field(default_factory=dict)
    installed: Any = None  # the forward fasttrain installed (disable restores only if it is still there)
    active: bool = True
    fused_calls: int = 0
    num_items: Any = None  # what the trainer's compute_loss got: SFT's nll divides by it (uniform_grad)


def _trl_problem() -> str | None:
    try:
        import trl
        from packaging.version import Version
    except ImportError:
        return "TRL does not import"
    version = Version(trl.__version__)
    first, end = (Version(v) for v in TESTED_TRL)
    if not first <= version < end:
        try:
            from trl.trainer.utils import add_fused_lm_head  # noqa: F401
        except ImportError:
            return (
                f"TRL {trl.__version__} has no fused LM head: its trainers read the logits (entropy, token "
                "accuracy), so their loss keeps TRL's path"
            )
        return f"TRL {trl.__version__}: fasttrain serves TRL's fused LM head for TRL >= {first}, < {end}"
    return None


def _trainer_kind(trainer: Any) -> str | None:
    from trl import DPOTrainer, SFTTrainer

    if isinstance(trainer, SFTTrainer):
        return "sft"
    if isinstance(trainer, DPOTrainer):
        return "dpo"
    return None


def _is_trl_head(forward: Any) -> bool:
    import trl.trainer.utils

    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    # functools.wraps gave it the class forward's names: recognise TRL's function by its code object
    return (
        code is not None
        and code.co_name == "_fused_forward"
        and code.co_filename == trl.trainer.utils.__file__
    )


def _wraps(forward: Any, func: Any) -> bool:
    """Whether ``forward`` is ``func`` under decorators that keep ``__wrapped__`` (Accelerate's, torch's autocast)."""
    current = getattr(forward, "__func__", forward)
    for _ in range(16):
        if current is func:
            return True
        current = getattr(current, "__wrapped__", None)
        if current is None:
            return False
    return False


def _find_trl_head(model: nn.Module) -> tuple[Any, bool] | str:
    """(TRL's bound forward, whether Accelerate's mixed-precision wrapper is around it), or why none is found."""
    forward = model.__dict__.get("forward")
    if _is_trl_head(forward):
        return forward, False
    # Accelerator.prepare_model under fp16/bf16 keeps the forward it wrapped in `_original_forward`
    original = model.__dict__.get("_original_forward")
    if _is_trl_head(original) and _wraps(forward, original.__func__):
        return original, True
    return f"{type(model).__name__} has no TRL fused LM head (add_fused_lm_head) installed"


def _read_trl_head(model: nn.Module) -> tuple[Any, bool, dict[str, Any]] | str:
    """(TRL's bound forward, whether it is under Accelerate's autocast wrapper, its settings), or why this
    model's forward is not TRL's known fused head."""
    found = _find_trl_head(model)
    if isinstance(found, str):
        return found
    forward, wrapped = found
    func = forward.__func__
    cells = dict(zip(func.__code__.co_freevars, func.__closure__ or (), strict=True))
    missing = [name for name in _CLOSURE_NAMES if name not in cells]
    if missing:
        return f"TRL's fused LM head has a layout fasttrain does not know (no {', '.join(missing)})"
    settings = {name: cells[name].cell_contents for name in _CLOSURE_NAMES}
    if settings["cast_lm_head_to_fp32"]:
        return "TRL's fused LM head casts the head to fp32 (cast_lm_head_to_fp32): kept TRL's"
    head = model.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        return f"{type(model).__name__}'s output layer has no 2-D weight"
    return forward, wrapped, settings


def _install(model: nn.Module, trainer: Any, wrapped: bool, state: _HeadState) -> None:
    ours = types.MethodType(_make_forward(type(model)), model)
    state.replaced = {
        name: model.__dict__[name] for name in ("forward", "_original_forward") if name in model.__dict__
    }
    model.__dict__[_STATE_ATTR] = state
    if not wrapped:
        model.forward = ours
    else:
        # Put ours where TRL's forward was, under the wrapper Accelerator.prepare_model builds (autocast, then
        # outputs to fp32): the fused path then runs under the autocast TRL's ran under.
        from accelerate.utils import convert_outputs_to_fp32, get_mixed_precision_context_manager

        accelerator = trainer.accelerator
        autocast = get_mixed_precision_context_manager(accelerator.native_amp, accelerator.autocast_handler)
        model._original_forward = ours
        model.forward = types.MethodType(convert_outputs_to_fp32(autocast(ours.__func__)), model)
    state.installed = model.__dict__["forward"]


def _models(trainer: Any, kind: str) -> list[nn.Module]:
    # TRL adds its head to the PEFT base model (get_base_model) and to DPO's separate reference model
    models = [find_causal_lm(trainer.model)]
    ref = getattr(trainer, "ref_model", None) if kind == "dpo" else None
    if ref is not None:
        models.append(find_causal_lm(ref))
    return models


def enable_for_trainer(trainer: Any) -> str | None:
    """Serve this TRL trainer's fused LM head (policy and reference model) from fasttrain's kernel. Returns
    None when it does, else why not (TRL's own head then stays everywhere). Logs nothing; idempotent."""
    problem = _trl_problem()
    if problem is not None:
        return problem
    kind = _trainer_kind(trainer)
    if kind is None:
        return f"{type(trainer).__name__} is not a TRL SFTTrainer or DPOTrainer"
    device_type = trainer.args.device.type
    if KERNEL_CHOICE.get((device_type, kind), "fasttrain") == "trl":
        return f"TRL's own fused LM head measured faster for {kind} on {device_type} (KERNEL_CHOICE)"
    uniform = kind == "sft" and getattr(trainer.args, "loss_type", "nll") in ("nll", "chunked_nll")
    plans = []
    for model in _models(trainer, kind):
        if _STATE_ATTR in model.__dict__:
            model.__dict__[_STATE_ATTR].active = True
            continue
        found = _read_trl_head(model)
        if isinstance(found, str):
            return found
        plans.append((model, found))
    for model, (
        trl_forward,
        wrapped,
        settings,
    ) in plans:  # all or nothing: the status is then true for every model
        _install(model, trainer, wrapped, _HeadState(trl_forward, settings, uniform))
    if uniform:
        _see_num_items(trainer, [_state(m) for m in _models(trainer, kind)])
    return None


def _see_num_items(trainer: Any, states: list) -> None:
    """SFT's nll is ``-sum(log_probs) / num_items_in_batch``, a value compute_loss gets and the model's forward
    does not: a per-instance wrapper hands it to the fused head, whose forward then computes the gradients for
    exactly that upstream (``uniform_grad``). Without it the head would guess the count and, where the guess
    is off, the backward would recompute."""
    if "compute_loss" in trainer.__dict__ and getattr(trainer.compute_loss, "_fasttrain_num_items", False):
        return
    original = trainer.compute_loss

    @functools.wraps(original)
    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        for state in states:
            state.num_items = num_items_in_batch
        try:
            return original(
                model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
            )
        finally:
            for state in states:
                state.num_items = None

    compute_loss._fasttrain_num_items = True  # type: ignore[attr-defined]
    trainer.compute_loss = compute_loss


def _state(model: nn.Module) -> _HeadState | None:
    return model.__dict__.get(_STATE_ATTR)


def disable_for_trainer(trainer: Any) -> None:
    """Put TRL's own fused head back (exactly, where nothing has wrapped the forward since)."""
    kind = _trainer_kind(trainer) or "sft"
    if getattr(trainer.__dict__.get("compute_loss"), "_fasttrain_num_items", False):
        del trainer.compute_loss
    for model in _models(trainer, kind):
        state = _state(model)
        if state is None:
            continue
        if model.__dict__.get("forward") is state.installed:
            for name in ("forward", "_original_forward"):
                model.__dict__.pop(name, None)
            model.__dict__.update(state.replaced)
            del model.__dict__[_STATE_ATTR]
        else:
            state.active = False


def fused_calls(trainer: Any) -> int:
    """How many forwards of this trainer's models took fasttrain's kernel (the evidence behind a status)."""
    kind = _trainer_kind(trainer) or "sft"
    return sum(state.fused_calls for m in _models(trainer, kind) if (state := _state(m)) is not None)


def _make_forward(model_cls: type) -> Any:
    # Keep the class forward's signature: generate() and the Trainer's column filter inspect it
    @functools.wraps(model_cls.forward)
    def forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        state: _HeadState = self.__dict__[_STATE_ATTR]
        reason = None if fused_lm_head and state.active else "not served"
        if reason is None:
            reason = _call_problem(self, state, kwargs)
        if reason is not None:
            if reason != "not served":
                log_once(f"trl-head:{reason}", f"fasttrain: {reason}; this call keeps TRL's fused LM head")
            return state.trl_forward(
                *args,
                fused_lm_head=fused_lm_head,
                labels=labels,
                shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch,
                **kwargs,
            )
        return _fused_head(self, state, args, kwargs, labels, shift_labels, num_items_in_batch)

    forward._fasttrain_trl_head = True  # type: ignore[attr-defined]
    return forward


def _call_problem(model: nn.Module, state: _HeadState, kwargs: dict[str, Any]) -> str | None:
    if kwargs.get("output_router_logits") or getattr(
        state.settings["text_config"], "output_router_logits", False
    ):
        return "MoE router logits (aux loss) are left to TRL's fused head"
    if hasattr(model.get_output_embeddings().weight, "ds_id"):
        return "the output weight is a DeepSpeed ZeRO-3 partitioned parameter"
    return None


def _fused_head(model, state, args, kwargs, labels, shift_labels, num_items_in_batch):
    """TRL's ``_fused_forward`` (same inputs, same FusedCausalLMOutput) with fasttrain's kernel."""
    from trl.trainer.utils import FusedCausalLMOutput

    settings = state.settings
    kwargs["use_cache"] = False
    hidden = getattr(model, settings["backbone_attr"])(*args, **kwargs).last_hidden_state
    if shift_labels is None:
        hidden, labels = hidden[:, :-1], labels[:, 1:]
    else:
        labels = shift_labels
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    hidden, labels = hidden.to(weight.device), labels.to(weight.device)
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without distributed
        DTensor = ()
    if isinstance(weight, DTensor):  # FSDP2: gather the head once, as TRL does
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    mask = labels != -100
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    # the upstream of each scored log-prob under SFT's nll: TRL divides by the compute_loss's num_items_in_batch
    expected = state.num_items if state.num_items is not None else count
    expected = -1.0 / torch.as_tensor(expected, dtype=torch.float32, device=hidden.device).clamp(min=1)
    state.fused_calls += 1
    # only the scored positions go through the head (a host sync on a GPU, as in TRL's compact path)
    stats = fused_token_log_probs(
        hidden[mask],
        weight,
        labels[mask],
        bias,
        temperature=settings["temperature"],
        logit_scale=settings["logit_scale"],
        softcap=settings["final_logit_softcapping"],
        outputs=tuple(settings["outputs"]),
        uniform_grad=expected if state.uniform_grad else False,
    )
    # masked_scatter keeps an all-masked batch connected to the graph (a differentiable zero), as TRL does
    log_probs, entropy, log_sum_sq, mean_logits, is_top1 = (
        None if x is None else x.new_zeros(mask.shape).masked_scatter(mask, x) for x in stats
    )
    return FusedCausalLMOutput(
        loss=-log_probs.sum() / count,
        log_probs=log_probs,
        entropy=entropy,
        log_sum_sq_probs=log_sum_sq,
        mean_logits=mean_logits,
        is_top1=is_top1,
        label_mask=mask,
        aux_loss=None,
    )
