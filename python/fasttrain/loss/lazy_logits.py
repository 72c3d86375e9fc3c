"""Logits on demand: the fused forward's output computes the logits the moment someone reads them.

The fused loss never makes the ``[tokens, vocab]`` logits. Code that reads them anyway -- a Trainer subclass's
``compute_loss``, a callback, user code holding the output -- gets exactly what the unpatched forward returns: the
output layer applied to the backbone's last hidden state (then the family's final softcap), as a module call under
the autocast and grad mode the forward ran in, so the value, dtype and autograd graph are the unpatched forward's
(the module call is also what lets DeepSpeed ZeRO-3 and FSDP2 gather the weight, as they do in the forward).

``LazyLogitsOutput`` is a ``CausalLMOutputWithPast`` whose ``logits`` entry holds a ``PendingLogits`` until read.
Reading it as ``out.logits``, ``out["logits"]``, ``out.get("logits")``, ``out[i]`` or ``out.to_tuple()`` computes the
logits once and stores them in place. Iterating ``values()`` / ``items()`` does not compute them: that is how generic
code rebuilds an output (Accelerate's fp32 conversion under mixed precision, DDP's and FSDP2's pytree passes), and
the pending entry must travel through it unevaluated. For Accelerate's conversion the pending entry reports the
logits' ``dtype`` and answers ``float()`` with a pending fp32 copy, as a bf16 tensor would. DeepSpeed ZeRO-3's
module hooks walk every output by ``keys()`` and ``output[key] = f(output[key])``: its walker gets the pending entry
as it is (it is no tensor yet, so it passes through untouched; when read later, the output layer's own ZeRO-3 hooks
gather its weight for the computation).
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["LazyLogitsOutput", "PendingLogits", "logits_thunk"]


class PendingLogits:
    """The logits of one forward, computed on first ``resolve()`` and kept from then on."""

    __slots__ = ("_compute", "_on_read", "_value", "device", "dtype", "shape")

    def __init__(
        self,
        compute: Callable[[], torch.Tensor],
        *,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        device: torch.device,
        on_read: Callable[[], None] | None = None,
    ) -> None:
        self._compute = compute
        self._on_read = on_read
        self._value: torch.Tensor | None = None
        self.dtype, self.shape, self.device = dtype, torch.Size(shape), device

    def resolve(self) -> torch.Tensor:
        if self._value is None:
            if self._on_read is not None:
                self._on_read()
            self._value = self._compute()
            self._compute = self._on_read = None  # drop the hidden states as soon as the logits exist
        return self._value

    def float(self) -> PendingLogits:
        """What ``tensor.float()`` gives, still pending (Accelerate's fp32 conversion of the outputs calls it)."""
        if self.dtype == torch.float32:
            return self
        return PendingLogits(
            lambda: self.resolve().float(), dtype=torch.float32, shape=self.shape, device=self.device
        )

    def __repr__(self) -> str:
        return f"PendingLogits(shape={tuple(self.shape)}, dtype={self.dtype}: computed when read as output.logits)"


class LazyLogitsOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` whose ``logits`` are computed when read (see the module docstring)."""

    # Generic code walks a dataclass's fields with getattr (FSDP2 collecting the tensors that need gradients,
    # torch's _apply_to_tensors): that would compute the logits at every forward. So ``logits`` is not among this
    # class's dataclass fields; it is a property, and its mapping entry is kept by the property's setter. (What
    # rebuilds an output from its fields alone, ``dataclasses.replace``, drops the pending logits: such an output
    # has ``logits`` None, as the fused forward had before logits on demand.)
    __dataclass_fields__ = {  # noqa: RUF012 - dataclasses reads this class attribute
        name: field for name, field in CausalLMOutputWithPast.__dataclass_fields__.items() if name != "logits"
    }

    @property
    def logits(self) -> torch.Tensor | None:  # type: ignore[override]
        value = self.__dict__.get("logits")
        if isinstance(value, PendingLogits):
            value = value.resolve()
            self.__dict__["logits"] = value
            OrderedDict.__setitem__(self, "logits", value)  # an existing key keeps its place
        return value

    @logits.setter
    def logits(self, value: Any) -> None:
        self.__dict__["logits"] = value
        if value is not None:
            OrderedDict.__setitem__(self, "logits", value)

    def __post_init__(self) -> None:
        super().__post_init__()
        # The entries in the plain output's order (loss, logits, cache, ...), whatever order the dataclass __init__
        # and this transformers' ModelOutput put them in: positions (out[0], to_tuple()) must mean the same.
        for name in CausalLMOutputWithPast.__dataclass_fields__:
            if OrderedDict.__contains__(self, name):
                OrderedDict.move_to_end(self, name)

    def __getitem__(self, key: Any) -> Any:
        if key == "logits" and _called_by_zero3_walker():
            return OrderedDict.__getitem__(self, key)  # pending or computed, as it stands
        if isinstance(key, int):  # a position, as in to_tuple(): only the logits' own computes them
            key = list(self.keys())[key]
        if not isinstance(key, str) or key == "logits":
            self.logits  # noqa: B018 - computes and stores the logits before a read by name or slice
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        if key == "logits":
            self.logits  # noqa: B018
        return super().get(key, default)

    def to_tuple(self) -> tuple:
        self.logits  # noqa: B018
        return super().to_tuple()

    def __reduce__(self) -> Any:
        """Pickled (and copied) as the plain output it stands for, logits computed."""
        self.logits  # noqa: B018
        names = CausalLMOutputWithPast.__dataclass_fields__
        return CausalLMOutputWithPast, tuple(self.__dict__.get(name) for name in names)


def _called_by_zero3_walker() -> bool:
    """Whether ``__getitem__``'s caller is DeepSpeed ZeRO-3's output walker (``apply_to_tensors_only``), which
    rebuilds every module output entry by entry in its forward hooks: a read by it is no read of the logits."""
    caller = sys._getframe(2)  # 0: this function, 1: __getitem__, 2: whoever indexed the output
    return caller.f_code.co_name == "apply_to_tensors_only" and caller.f_globals.get(
        "__name__", ""
    ).startswith("deepspeed.")


def _autocast_state(device_type: str) -> tuple[bool, torch.dtype]:
    return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)


def logits_thunk(
    head: nn.Module, hidden: torch.Tensor, softcap: float | None, on_read: Callable[[], None] | None
) -> PendingLogits:
    """The pending logits ``head(hidden)`` (then ``softcap * tanh(logits / softcap)``), to be computed later under
    the autocast and grad mode in force now."""
    device_type = hidden.device.type
    autocast_on, autocast_dtype = _autocast_state(device_type)
    grad = torch.is_grad_enabled()

    def compute() -> torch.Tensor:
        autocast = (
            torch.autocast(device_type, dtype=autocast_dtype)
            if autocast_on
            else torch.autocast(device_type, enabled=False)
        )
        with autocast, torch.set_grad_enabled(grad):
            logits = head(hidden)
            if softcap is not None:
                logits = logits / softcap
                logits = torch.tanh(logits)
                logits = logits * softcap
        return logits

    weight = head.weight
    dtype = autocast_dtype if autocast_on and autocast_dtype is not None else hidden.dtype
    shape = (*hidden.shape[:-1], int(getattr(weight, "ds_shape", weight.shape)[0]))
    return PendingLogits(compute, dtype=dtype, shape=shape, device=hidden.device, on_read=on_read)
