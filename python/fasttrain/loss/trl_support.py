"""TRL's SFTTrainer and DPOTrainer on fasttrain's kernel: serve TRL's fused LM-head contract.

TRL (1.16) computes these trainers' losses and metrics from ``model(..., labels=..., fused_lm_head=True)``, a
per-instance forward that ``trl.trainer.utils.add_fused_lm_head`` installs at ``__init__``: it runs the backbone
and returns a ``FusedCausalLMOutput`` (per-token ``log_probs`` and, as configured, ``entropy``,
``log_sum_sq_probs``, ``mean_logits``, ``is_top1``, plus ``label_mask`` and the loss) without the logits.
``serve(models, ...)`` keeps that contract and that public switch, and puts fasttrain's chunked kernel behind
it (``fused_token_log_probs``: Triton on CUDA, the chunked torch path elsewhere), model instance by model instance
(the trainer-side choices -- which models, which trainer kind, the autocast -- are ``fasttrain.integration``'s):

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
  recomputed): ``upstream_count`` hands it the ``n`` the trainer's compute_loss divides by. DPO's gradients differ
  per sequence: the backward recomputes.

``TRAINERS`` is the one table of TRL trainers fasttrain serves (``integration.loss_trl`` reads it to tell a trainer's
kind): each entry's class, and which kernel serves its head on each device type (TRL's own kernel may still be the
faster one on a GPU, decided by ``benchmarks/bench_loss.py --device cuda --cases
trl_sft,trl_dpo``; where it says ``"trl"``, ``serve``
returns that reason and TRL's head stays).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .._logging import log_once
from ..labels import IGNORE_INDEX
from ..labels import shift_labels as shift_labels_of
from .token_logprobs import fused_token_log_probs

__all__ = [
    "TESTED_TRL",
    "TRAINERS",
    "TrlTrainer",
    "fused_calls",
    "is_trl_head",
    "serve",
    "stop_serving",
    "trl_problem",
    "upstream_count",
]

# TRL versions whose add_fused_lm_head layout this module was tested against: [first, last-excluded).
TESTED_TRL = ("1.16", "2.0")


@dataclasses.dataclass(frozen=True)
class TrlTrainer:
    """A TRL trainer whose fused LM head fasttrain serves (its subclasses too). An entry goes in ``TRAINERS`` once the
    trainer passes against plain TRL as in tests/test_trl_patch.py and tests/test_trl_rl.py."""

    class_name: str  # the class in ``trl``
    # which kernel serves its head on each device type, "fasttrain" or "trl"
    kernel: dict[str, str] = dataclasses.field(
        default_factory=lambda: {"cpu": "fasttrain", "cuda": "fasttrain"}
    )

    @property
    def kind(self) -> str:
        """The trainer's short name ("sft" for SFTTrainer), as the status and ``serve`` use it."""
        return self.class_name.removesuffix("Trainer").lower()


# CPU: measured, fasttrain's kernel is the faster one (benchmarks/results/loss_trl_cpu.md). CUDA: not measured yet;
# fasttrain's until `bench_loss.py --device cuda --cases trl_sft,trl_dpo` says otherwise (SFT saves a matmul with fasttrain's
# speculation; DPO runs the same four matmuls as TRL, so the per-row kernels decide).
TRAINERS: dict[str, TrlTrainer] = {
    t.kind: t
    for t in (
        TrlTrainer("SFTTrainer"),
        TrlTrainer("DPOTrainer"),
        TrlTrainer("GRPOTrainer"),
        TrlTrainer("RLOOTrainer"),
        TrlTrainer("KTOTrainer"),
    )
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


def trl_problem() -> str | None:
    """Why this TRL's fused head cannot be served (None when it can)."""
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
                f"TRL {trl.__version__} has no fused LM head (the contract fasttrain serves, added in TRL "
                f"{first}): its trainers compute their log-probs and metrics from the full logits inside their "
                "own loss, so their loss keeps TRL's path"
            )
        return f"TRL {trl.__version__}: fasttrain serves TRL's fused LM head for TRL >= {first}, < {end}"
    return None


def is_trl_head(forward: Any) -> bool:
    """Whether ``forward`` (a model's instance attribute) is the head ``trl.trainer.utils.add_fused_lm_head`` installs."""
    code = getattr(getattr(forward, "__func__", None), "__code__", None)
    # functools.wraps gave it the class forward's names: recognise TRL's function by its code object
    if code is None or code.co_name != "_fused_forward":
        return False
    from trl.trainer import utils as trl_utils

    return code.co_filename == trl_utils.__file__


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
    if is_trl_head(forward):
        return forward, False
    # Accelerator.prepare_model under fp16/bf16 keeps the forward it wrapped in `_original_forward`
    original = model.__dict__.get("_original_forward")
    if is_trl_head(original) and _wraps(forward, original.__func__):
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
    head = model.get_output_embeddings()
    if not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.dim() != 2:
        return f"{type(model).__name__}'s output layer has no 2-D weight"
    return forward, wrapped, settings


def _install(model: nn.Module, mixed_precision: Callable[[], Any], wrapped: bool, state: _HeadState) -> None:
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
        from accelerate.utils import convert_outputs_to_fp32

        autocast = mixed_precision()
        model._original_forward = ours
        model.forward = types.MethodType(convert_outputs_to_fp32(autocast(ours.__func__)), model)
    state.installed = model.__dict__["forward"]


def serve(
    models: list[nn.Module],
    *,
    kind: str,
    device_type: str,
    uniform_grad: bool,
    mixed_precision: Callable[[], Any],
) -> str | None:
    """Serve the TRL fused heads installed on ``models`` (a trainer's policy, and its reference model) from
    fasttrain's kernel. Returns None when it does, else why not (TRL's own head then stays on every model): all or
    nothing, so a status is true of each model. ``kind`` (a key of ``TRAINERS``) picks the kernel;
    ``uniform_grad``: the loss is ``-sum(log_probs) / n`` (SFT's nll), so the forward computes the gradients;
    ``mixed_precision()`` gives the autocast context manager of a forward Accelerate wrapped. Logs nothing;
    idempotent."""
    problem = trl_problem()
    if problem is not None:
        return problem
    if TRAINERS[kind].kernel.get(device_type, "fasttrain") == "trl":
        return f"TRL's own fused LM head measured faster for {kind} on {device_type} (trl_support.TRAINERS)"
    plans = []
    for model in models:
        if _STATE_ATTR in model.__dict__:
            model.__dict__[_STATE_ATTR].active = True
            continue
        found = _read_trl_head(model)
        if isinstance(found, str):
            return found
        plans.append((model, found))
    for model, (trl_forward, wrapped, settings) in plans:
        _install(model, mixed_precision, wrapped, _HeadState(trl_forward, settings, uniform_grad))
    return None


@contextlib.contextmanager
def upstream_count(models: list[nn.Module], num_items_in_batch: Any) -> Iterator[None]:
    """For the length of one compute_loss: SFT's nll divides by ``num_items_in_batch``, a value the trainer's
    compute_loss gets and the model's forward does not; handed to the fused heads, their forward computes the
    gradients for exactly that upstream (``uniform_grad``). Without it the head guesses the count and, where the
    guess is off, the backward recomputes."""
    states = [state for m in models if (state := _state(m)) is not None]
    for state in states:
        state.num_items = num_items_in_batch
    try:
        yield
    finally:
        for state in states:
            state.num_items = None


def _state(model: nn.Module) -> _HeadState | None:
    return model.__dict__.get(_STATE_ATTR)


def stop_serving(models: list[nn.Module]) -> int:
    """Put TRL's own fused heads back (exactly, where nothing has wrapped the forward since). Returns how many
    forwards fasttrain's kernel served since ``serve`` (their counters start again from zero)."""
    served = 0
    for model in models:
        state = _state(model)
        if state is None:
            continue
        served += state.fused_calls
        state.fused_calls = 0
        if model.__dict__.get("forward") is state.installed:
            for name in ("forward", "_original_forward"):
                model.__dict__.pop(name, None)
            model.__dict__.update(state.replaced)
            del model.__dict__[_STATE_ATTR]
        else:
            state.active = False
    return served


def fused_calls(models: list[nn.Module]) -> int:
    """How many forwards of ``models`` took fasttrain's kernel (the evidence behind a status)."""
    return sum(state.fused_calls for m in models if (state := _state(m)) is not None)


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
    if shift_labels is None:  # TRL scores every position but the last
        hidden, labels = hidden[:, :-1], shift_labels_of(labels)[:, :-1]
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
    mask = labels != IGNORE_INDEX
    autocast = contextlib.nullcontext()
    if settings[
        "cast_lm_head_to_fp32"
    ]:  # as TRL: the projection in fp32 outside autocast, the head cast to it
        hidden = hidden.float()
        autocast = torch.autocast(hidden.device.type, enabled=False)
    count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    # the upstream of each scored log-prob under SFT's nll: TRL divides by the compute_loss's num_items_in_batch
    expected = state.num_items if state.num_items is not None else count
    expected = -1.0 / torch.as_tensor(expected, dtype=torch.float32, device=hidden.device).clamp(min=1)
    state.fused_calls += 1
    # only the scored positions go through the head (a host sync on a GPU, as in TRL's compact path)
    with autocast:
        stats = _token_stats(
            hidden[mask], weight, labels[mask], bias, settings, expected if state.uniform_grad else False
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


def _token_stats(hidden, weight, labels, bias, settings, uniform_grad):
    """The head's statistics with the settings read from TRL's head."""
    return fused_token_log_probs(
        hidden,
        weight,
        labels,
        bias,
        temperature=settings["temperature"],
        logit_scale=settings["logit_scale"],
        softcap=settings["final_logit_softcapping"],
        outputs=tuple(settings["outputs"]),
        uniform_grad=uniform_grad,
    )
