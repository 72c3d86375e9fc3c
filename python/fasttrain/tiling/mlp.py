"""The decoder MLP run over the tokens in chunks, forward and backward: its ``[tokens, intermediate]`` tensors exist
one chunk at a time.

A decoder layer's MLP (``Qwen3MLP``, ``LlamaMLP``: gate/up/down projections around an activation) is token-wise:
each output row depends on its input row alone. Autograd saves its ``[tokens, intermediate]`` activations (the
projections' outputs, the activation's, their product) from the forward to the backward: at long context the
largest activation memory of a layer after the logits (which the chunked LM head already removes).

``TiledMLP`` is an autograd Function whose inputs are the MLP's input and, explicitly, every parameter under the
MLP that requires a gradient. Its forward runs the module's own forward on one chunk of rows at a time under
``no_grad`` and saves only the input; its backward runs each chunk's forward again under ``enable_grad`` (and the
autocast the forward ran under; ``down_proj``'s product, which the backward does not need, is not computed again) and takes ``torch.autograd.grad`` of it for the chunk's input and the parameters,
summing the parameters' gradients over the chunks (in float32 for half-precision parameters). It returns the sum:
autograd accumulates each parameter's gradient once per backward, after the Function's backward returns, so a
post-accumulate-grad hook (fasttrain's optimizer step inside backward, DDP's reducer, ZeRO-1/2's buckets) fires
once per parameter, as for the plain module. DeepSpeed's ``TiledMLP`` and Liger's ``LigerTiledMLPFunction`` run
``torch.autograd.backward`` per chunk instead: every chunk accumulates into ``.grad`` (each hook fires once per
chunk), and their recomputation runs under the autocast of wherever ``backward()`` is called (fp32 for a Trainer's
bf16 run) instead of the forward's; tests/test_tiled_mlp.py holds ours to both.

A dropout under the MLP (LoRA's ``lora_dropout`` while training) draws its masks chunk by chunk; the backward replays
the random generators' states of the forward (CPU and the input's device, as ``torch.utils.checkpoint`` does), so
it differentiates the masks the forward used.

Each chunk's forward is the module's own, so the output rows equal the plain module's up to how the matmul
library blocks the rows; the parameters' gradients are summed in another order (chunk by chunk). Below the
threshold (``min_tokens``) the wrapper calls the module's own forward: bit for bit the plain module.

``enable_tiled_mlp(model, ...)`` wraps ``forward`` on each MLP *instance* it can tile (the class is not touched);
``disable_tiled_mlp(model)`` puts the forwards back. A call runs plain (the module's own forward) when:

- gradients are off (``torch.no_grad()``, inference mode) or nothing under the MLP, nor its input, needs one;
- the call's tokens (every dimension but the last) are at most ``min_tokens``;
- a parameter is a DTensor (FSDP2), a DeepSpeed ZeRO-3 partition (``ds_id``), or a projection reads a tensor that
  is not a registered parameter (FSDP1's flat-parameter views): the recomputation in backward calls the forward
  without the module hooks that gather them, or would not differentiate them (logged once). Under FSDP2 the
  parameters the forward sees are plain unsharded ones, which this check cannot tell apart: the Trainer's
  integration leaves the MLPs unwrapped under FSDP and ZeRO-3 (``fasttrain.integration.tiling``);

An MLP is tiled only when its children are projections (``*_proj``: ``nn.Linear``, or PEFT LoRA layers over an
``nn.Linear``) and parameter-free modules (the activation): the shape of a token-wise MLP. A projection of another
kind (a quantized linear, a custom layer) leaves that MLP plain, logged once at ``enable_tiled_mlp``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.utils import stateless as _stateless

from .._logging import log_once

__all__ = [
    "DEFAULT_CHUNK_TOKENS",
    "TiledMLP",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "tiled_mlp",
    "tiled_mlp_calls",
    "tiling_problem",
]

DEFAULT_CHUNK_TOKENS = 4096
# torch's own parameter swap (torch.func.functional_call's), without the module call and its hooks; where a torch
# lacks it, the recomputation differentiates the parameters themselves (their Tensor hooks then fire per chunk)
_reparametrize = getattr(_stateless, "_reparametrize_module", None)
_STATE_ATTR = "_fasttrain_tiled_mlp"
_MISSING = object()


class TiledMLP(torch.autograd.Function):
    """``run(x)`` over chunks of ``chunk`` rows of ``x`` (every dimension but the last flattened); ``params``: the
    tensors ``run`` reads that need gradients (passed as inputs so that autograd accumulates each one once)."""

    @staticmethod
    def forward(ctx: Any, run: Callable[[torch.Tensor], torch.Tensor], chunk: int, x: torch.Tensor, *params):
        ctx.run, ctx.chunk, ctx.params = run, chunk, params
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        # a dropout under the module draws its masks chunk by chunk: the recomputation replays the same draws
        ctx.rng = _rng_states(x.device) if getattr(run, "draws_random", False) else None
        ctx.save_for_backward(x)
        rows = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for start in range(0, rows.shape[0], chunk):
                part = run(rows[start : start + chunk])
                if out is None:
                    out = part.new_empty((rows.shape[0], part.shape[-1]))
                out[start : start + part.shape[0]] = part
                del part
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        run, chunk, params = ctx.run, ctx.chunk, ctx.params
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        rows = x.detach().reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(rows) if want_x else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        device, autocast_on, autocast_dtype = ctx.autocast
        targets = [params[i] for i in wanted]
        aliasing = getattr(run, "aliasing", None) if _reparametrize is not None else None
        if aliasing is not None:  # gradients taken for detached aliases: the parameters' own hooks fire once
            targets = [p.detach().requires_grad_() for p in targets]
            swapped = aliasing(wanted, targets)
        else:
            swapped = contextlib.nullcontext()
        with (
            torch.enable_grad(),
            torch.autocast(device, dtype=autocast_dtype, enabled=autocast_on),
            swapped,
            _replayed(x.device, ctx.rng),
        ):
            for start in range(0, rows.shape[0], chunk):
                part = rows[start : start + chunk].detach().requires_grad_(want_x)
                out = run.recompute(part) if hasattr(run, "recompute") else run(part)
                inputs = ([part] if want_x else []) + targets
                grads = torch.autograd.grad(
                    out, inputs, grad_rows[start : start + part.shape[0]], allow_unused=True
                )
                del out
                if want_x:
                    grad_x[start : start + part.shape[0]] = grads[0]
                    grads = grads[1:]
                for i, grad in zip(wanted, grads, strict=True):
                    if grad is None:
                        continue
                    if sums[i] is None:
                        sums[i] = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
                    else:
                        sums[i] += grad
        param_grads = [
            s if s is None or s.dtype == p.dtype else s.to(p.dtype) for s, p in zip(sums, params, strict=True)
        ]
        return (None, None, None if grad_x is None else grad_x.view(x.shape), *param_grads)


class _DeferredLinear(torch.autograd.Function):
    """``F.linear(h, weight, bias)`` in the backward only: its forward returns an uninitialised tensor of the output's
    shape and dtype (read by nothing: it is the output whose gradient the recomputation is given), its backward the
    linear's gradients, in the dtype autocast runs the linear in, each cast back to its input's dtype as autocast's
    casts do."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        device = h.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            h_in, w_in = h.to(dtype), weight.to(dtype)
        else:
            h_in, w_in = h, weight
        ctx.save_for_backward(h_in, w_in)
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        return h_in.new_empty((*h.shape[:-1], weight.shape[0]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        h_in, w_in = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes
        grad = grad.to(w_in.dtype)
        with torch.autocast(grad.device.type, enabled=False):
            rows = grad.reshape(-1, grad.shape[-1])
            grad_h = (grad @ w_in).to(h_dtype) if ctx.needs_input_grad[0] else None
            grad_w = (
                (rows.t() @ h_in.reshape(-1, h_in.shape[-1])).to(w_dtype) if ctx.needs_input_grad[1] else None
            )
            grad_b = rows.sum(0).to(b_dtype) if b_dtype is not None and ctx.needs_input_grad[2] else None
        return grad_h, grad_w, grad_b


def _rng_states(device: torch.device) -> list[torch.Tensor]:
    """The CPU generator's state, and the device's where the input lives on one (as torch.utils.checkpoint keeps)."""
    states = [torch.get_rng_state()]
    if device.type != "cpu":
        states.append(getattr(torch, device.type).get_rng_state(device))
    return states


@contextlib.contextmanager
def _replayed(device: torch.device, states: list[torch.Tensor] | None):
    """The generators set to ``states`` inside, and back to where they were after (nothing when None)."""
    if states is None:
        yield
        return
    devices = [device] if len(states) > 1 else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.set_rng_state(states[0])
        if devices:
            getattr(torch, device.type).set_rng_state(states[1], device)
        yield


def tiled_mlp(
    run: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    params: Sequence[torch.Tensor],
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``run(x)`` computed ``chunk_tokens`` rows at a time, forward and backward (``TiledMLP``); ``params``: the
    tensors ``run`` reads, of which those requiring a gradient get one."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    return TiledMLP.apply(run, int(chunk_tokens), x, *[p for p in params if p.requires_grad])


# ---- the per-instance wrapper ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _State:
    original_forward: Callable[..., Any]
    instance_forward: Any  # the instance attribute `forward` had before, or _MISSING
    chunk_tokens: int
    min_tokens: int
    calls: int = 0  # forwards that ran tiled: the evidence that the path ran


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def _projection_problem(name: str, module: nn.Module) -> str | None:
    if _is_linear(module):
        return None
    base = getattr(module, "base_layer", None)  # PEFT's LoRA layers keep the wrapped Linear as base_layer
    lora = type(module).__module__.startswith("peft.tuners.lora")
    if lora and base is not None and _is_linear(base):
        return None
    return f"its projection {name} is a {type(module).__name__}, not an nn.Linear (or a LoRA layer over one)"


def tiling_problem(mlp: nn.Module) -> str | None:
    """Why ``mlp`` is not tiled (None: it is a token-wise MLP of linear projections and an activation)."""
    projections = 0
    for name, child in mlp.named_children():
        if name.endswith("_proj"):
            problem = _projection_problem(name, child)
            if problem is not None:
                return problem
            projections += 1
        elif any(True for _ in child.parameters()):
            return f"its child {name} ({type(child).__name__}) has parameters and is no projection"
    if projections < 2:
        return "it has fewer than two *_proj projections"
    if any(True for _ in mlp._parameters):
        return "it holds parameters of its own besides its projections"
    return None


def _call_problem(mlp: nn.Module, params: Sequence[torch.Tensor]) -> str | None:
    """Why this call cannot be tiled although the module can (what may change between calls)."""
    for module in mlp.modules():
        if isinstance(module, nn.Linear) and not all(
            t is None or isinstance(t, nn.Parameter) for t in (module.weight, module.bias)
        ):
            # FSDP1 puts views of its flat parameter in place of the parameters during the forward: autograd.grad
            # would differentiate neither them nor the flat parameter
            return "its projections read tensors that are not registered parameters (FSDP1's views)"
    for p in params:
        if hasattr(p, "ds_id"):
            return "its parameters are DeepSpeed ZeRO-3 partitions (gathered by module hooks the recomputation skips)"
        if type(p).__name__ == "DTensor" or getattr(p, "_is_sharded", False) or hasattr(p, "_fsdp_flattened"):
            return "its parameters are FSDP-managed (unsharded by module hooks the recomputation skips)"
    return None


def _draws_random(mlp: nn.Module) -> bool:
    """Whether a dropout under ``mlp`` draws a mask in this call (LoRA's ``lora_dropout`` while training)."""
    return any(
        module.training and module.p > 0
        for module in mlp.modules()
        if isinstance(module, nn.modules.dropout._DropoutNd)
    )


def _tiled_forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    state: _State = self.__dict__[_STATE_ATTR]
    original = state.original_forward
    if args or kwargs or not torch.is_grad_enabled() or x.dim() < 2:
        return original(x, *args, **kwargs)
    if x.numel() // x.shape[-1] <= state.min_tokens:
        return original(x)
    names, params = [], []
    for name, p in self.named_parameters():
        if p.requires_grad:
            names.append(name)
            params.append(p)
    if not params and not x.requires_grad:
        return original(x)
    problem = _call_problem(self, params)
    if problem is not None:
        log_once(
            f"tiled-mlp:{type(self).__name__}:{problem}",
            f"fasttrain: {type(self).__name__} runs untiled: {problem}",
        )
        return original(x)
    state.calls += 1
    run = _ModuleRun(self, original, names, _draws_random(self))
    return TiledMLP.apply(run, state.chunk_tokens, x, *params)


class _ModuleRun:
    """A module's own forward on one chunk; ``aliasing`` puts tensors in place of some of its parameters (by name)
    for the recomputation, so that autograd.grad is taken for those tensors, not for the parameters: a hook on a
    parameter (``Tensor.register_hook``) then sees its gradient once, when autograd accumulates the sum."""

    __slots__ = ("draws_random", "forward", "last", "module", "names")

    def __init__(
        self, module: nn.Module, forward: Callable[..., Any], names: list[str], draws_random: bool
    ) -> None:
        self.module, self.forward, self.names, self.draws_random = module, forward, names, draws_random
        last = getattr(module, "down_proj", None)
        deferrable = type(last) is nn.Linear and "forward" not in last.__dict__ and not draws_random
        self.last = last if deferrable else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x)

    def recompute(self, x: torch.Tensor) -> torch.Tensor:
        """The chunk's forward again, for its backward. When the module returns its ``down_proj``'s output as it is
        (a token-wise MLP's last step), that projection's product is not computed again: the backward needs only its
        input, so ``_DeferredLinear`` stands in for it (a third of the recomputation saved). Where the module does
        more with that output, the chunk is run again whole, and so are the next ones."""
        last = self.last
        if last is None:
            return self.forward(x)
        made: list[torch.Tensor] = []

        def deferred(linear: nn.Module, h: torch.Tensor) -> torch.Tensor:
            made.append(_DeferredLinear.apply(h, linear.weight, linear.bias))
            return made[-1]

        last.forward = types.MethodType(deferred, last)
        try:
            out = self.forward(x)
        finally:
            del last.forward
        if len(made) == 1 and out is made[0]:
            return out
        self.last = None
        return self.forward(x)

    def aliasing(self, indices: Sequence[int], tensors: Sequence[torch.Tensor]) -> Any:
        swap = {self.names[i]: t for i, t in zip(indices, tensors, strict=True)}
        return _reparametrize(self.module, swap)


def _wrapper() -> Callable[..., Any]:
    def forward(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return _tiled_forward(self, x, *args, **kwargs)

    forward._fasttrain_tiled_mlp = True  # type: ignore[attr-defined]
    return forward


def decoder_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules held as ``mlp`` by a module of ``model`` (the decoder layers' MLPs), with their names."""
    return [(name, module) for name, module in model.named_modules() if name.rsplit(".", 1)[-1] == "mlp"]


def enable_tiled_mlp(
    model: nn.Module, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, min_tokens: int | None = None
) -> int:
    """Wrap ``forward`` on every decoder MLP of ``model`` that can be tiled (this instance only): a call with more
    than ``min_tokens`` tokens (default ``chunk_tokens``) runs in chunks of ``chunk_tokens``. Returns how many MLPs
    are wrapped (again with new settings, when they already were)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")
    min_tokens = chunk_tokens if min_tokens is None else int(min_tokens)
    wrapped = 0
    for name, mlp in decoder_mlps(model):
        state = mlp.__dict__.get(_STATE_ATTR)
        if state is not None:
            state.chunk_tokens, state.min_tokens = int(chunk_tokens), min_tokens
            wrapped += 1
            continue
        problem = tiling_problem(mlp)
        if problem is not None:
            log_once(
                f"tiled-mlp-untiled:{type(mlp).__name__}:{problem}",
                f"fasttrain: {type(mlp).__name__} ({name}) is not tiled: {problem}",
            )
            continue
        mlp.__dict__[_STATE_ATTR] = _State(
            original_forward=mlp.forward,
            instance_forward=mlp.__dict__.get("forward", _MISSING),
            chunk_tokens=int(chunk_tokens),
            min_tokens=min_tokens,
        )
        mlp.forward = types.MethodType(_wrapper(), mlp)
        wrapped += 1
    return wrapped


def disable_tiled_mlp(model: nn.Module) -> None:
    """Put every wrapped MLP's forward back as it was (a wrapper put on top of ours since stays, and passes its
    calls to the original forward through ours, which then runs plain)."""
    for _, mlp in decoder_mlps(model):
        state = mlp.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            continue
        current = mlp.__dict__.get("forward")
        if getattr(current, "_fasttrain_tiled_mlp", False):
            if state.instance_forward is _MISSING:
                del mlp.forward
            else:
                mlp.forward = state.instance_forward
        else:
            mlp.__dict__[_STATE_ATTR] = dataclasses.replace(state, min_tokens=2**62)  # someone wrapped ours


def tiled_mlp_calls(model: nn.Module) -> int:
    """How many forwards of ``model``'s wrapped MLPs ran tiled."""
    return sum(
        state.calls for _, mlp in decoder_mlps(model) if (state := mlp.__dict__.get(_STATE_ATTR)) is not None
    )
