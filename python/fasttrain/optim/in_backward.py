"""``step_in_backward``: each parameter's ``FusedAdamW`` update runs inside ``backward()``, as soon as its gradient
is final, and the gradient is freed at once.

A model's gradients then never all exist at the same time: at most the ones autograd is still accumulating (the
gradients of one layer or so) instead of one per parameter, which is the gradient memory of training (torch's
"optimizer step in backward" recipe, ``Tensor.register_post_accumulate_grad_hook``).

::

    handle = step_in_backward(optimizer)
    for batch in data:
        loss = model(**batch).loss
        loss.backward()          # every parameter with a gradient is stepped here, its gradient freed
        optimizer.step()         # harmless: no parameter has a gradient left, nothing is stepped twice
        optimizer.zero_grad()    # harmless
        scheduler.step()         # changes group["lr"]: the next backward's updates read it
        print(handle.grad_norm()); handle.reset_grad_norm()
    handle.remove()

Each update is the one ``optimizer.step()`` would have made for that parameter, bit for bit: the hook calls the
optimizer's own per-parameter machinery (``_state.init``, ``_uses_triton``, ``_triton_step`` / ``_torch_step``) on a
one-parameter subset of its group, with the group's hyperparameters as they are when the hook runs (a scheduler
that changed ``group["lr"]`` since the last backward is honoured), the parameter's own step counter, and the
stochastic-rounding salt ``step()`` gives it (its index in the optimizer, counted over all groups). Every
per-element operation of both kernels (and the 8-bit blocks, which never span two parameters) depends only on
that parameter's tensors, so stepping one parameter at a time equals stepping them together.

``optimizer.step()`` after the backward is a no-op for the parameters already stepped because their gradient is
``None`` (``step()`` skips parameters without one); a parameter that got a gradient some other way (set by hand)
is stepped by ``step()`` as usual, once. So the usual loop needs no change.

Not supported, refused with a ValueError naming the reason: a clip armed by ``defer_clip_grad_norm_`` (a global
norm needs every gradient before the first update: clip per parameter, or step after backward), sparse gradients,
a parameter that is not a leaf, DTensor (FSDP2) parameters (their sharded gradients are set after FSDP2's
reduce-scatter, not by autograd's accumulation). Not detectable, so documented: under DDP the hook would fire before
the gradient's all-reduce (don't: ``in_backward_ddp.step_in_backward_ddp`` steps in DDP's communication hook); ``torch.amp.GradScaler`` (its ``step`` expects gradients to unscale: use bf16,
which needs no scaler). Frozen parameters
(``requires_grad=False``) get no hook, as they get no gradient. The optimizer's step hooks
(``register_step_pre_hook`` / ``register_step_post_hook``) are not run by the updates made in backward.

Gradient accumulation over several backwards: pass ``armed``, a predicate read as each gradient is final; while
it says False the hook leaves the gradient where it is (the next backward accumulates into it, as without hooks),
and the backward during which it says True steps on the accumulated gradient. The Trainer's switch
(``optim_args="step_in_backward=true"``) arms it with Accelerate's ``sync_gradients``. Without ``armed`` every
backward steps.

``handle.grad_norm()`` is the 2-norm of every gradient stepped since ``handle.reset_grad_norm()`` (or since the
handle was made): the squares are summed in float64 on the gradients' device, without a host sync.

A gradient that comes a block at a time (``step_blocks_in_backward``: the fused head's tied weight gradient) is
stepped block by block, never whole: the step counter moves once, and each block is stepped and squared as the
staged torch step and the norm cut the whole gradient into pieces of ``STAGE_ELEMENTS``, so update and norm are
the whole gradient's, bit for bit.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from . import _state, _torch_step
from ._tensors import is_dtensor, local
from .adamw import FusedAdamW

# the optimizers with hooks registered: a second registration would find every gradient already freed
_ACTIVE: weakref.WeakKeyDictionary[FusedAdamW, StepInBackward] = weakref.WeakKeyDictionary()


def _refuse_clip(optimizer: FusedAdamW) -> None:
    if getattr(optimizer, "_clip_coef", None) is not None:
        raise ValueError(
            "step_in_backward: a clip armed by defer_clip_grad_norm_ is pending; the clip coefficient needs the "
            "norm of every gradient before the first parameter is stepped, which a step inside backward cannot "
            "wait for: don't arm a deferred clip with step_in_backward (or step after backward instead)"
        )


class StepInBackward:
    """The hooks ``step_in_backward`` registered on the optimizer's parameters, and the running gradient norm."""

    def __init__(
        self,
        optimizer: FusedAdamW,
        params: list[torch.Tensor],
        track_grad_norm: bool,
        armed: Callable[[], bool] | None = None,
    ) -> None:
        self._optimizer = optimizer
        self._track = track_grad_norm
        self.armed = armed  # None: every backward steps; else only a backward during which armed() is True
        self._lock = threading.Lock()  # autograd may run the hooks of CUDA devices on their own threads
        self._index: dict[int, tuple[int, int, int]] = {}  # id(param) -> (group, index in group, salt)
        self._signature: tuple[int, ...] = ()
        self._squares: dict[torch.device, torch.Tensor] = {}
        self.stepped = 0  # parameter updates made in backward since reset_grad_norm()
        self.updates = 0  # parameter updates made in backward by this handle, never reset (evidence it ran)
        self.removed = False
        self._handles = [p.register_post_accumulate_grad_hook(self._hook) for p in params]

    # -- the public side ----------------------------------------------------------------------------------------

    def remove(self) -> None:
        """Remove every hook: later backwards leave the gradients for ``optimizer.step()``."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.removed = True
        if _ACTIVE.get(self._optimizer) is self:
            del _ACTIVE[self._optimizer]

    def __enter__(self) -> StepInBackward:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()

    def reset_grad_norm(self) -> None:
        """Start a new sum of squares (call once per optimizer step, after reading ``grad_norm()``)."""
        with self._lock:
            self._squares = {}
            self.stepped = 0

    def grad_norm(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The 2-norm of the gradients stepped since ``reset_grad_norm()``: a 0-d tensor in ``dtype`` on the first
        gradient's device (on CPU when none was stepped), as ``torch.nn.utils.get_total_norm`` of those gradients
        (summed in float64 here, so within one rounding of ``dtype``)."""
        with self._lock:
            squares = list(self._squares.values())
        if not squares:
            return torch.zeros((), dtype=dtype)
        device = squares[0].device
        total = torch.stack([s.to(device) for s in squares]).sum()
        return total.sqrt().to(dtype)

    @property
    def optimizer(self) -> FusedAdamW:
        return self._optimizer

    # -- the hook -------------------------------------------------------------------------------------------------

    def _where(self, p: torch.Tensor) -> tuple[int, int, int] | None:
        """(group index, index in the group, stochastic-rounding salt) of ``p`` as ``step()`` counts them now."""
        groups = self._optimizer.param_groups
        signature = tuple(len(g["params"]) for g in groups)
        found = self._index.get(id(p))
        if signature == self._signature and found is not None and groups[found[0]]["params"][found[1]] is p:
            return found
        self._index, self._signature, salt_base = {}, signature, 0
        for gi, group in enumerate(groups):
            for j, q in enumerate(group["params"]):
                self._index[id(q)] = (gi, j, salt_base + j)
            salt_base += len(group["params"])
        found = self._index.get(id(p))
        return found if found is not None and groups[found[0]]["params"][found[1]] is p else None

    @torch.no_grad()
    def _hook(self, p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if self.armed is not None and not self.armed():
            return  # an accumulating backward: the gradient stays for the next one to add to
        if self._step(p):
            p.grad = None

    def _add_squares(self, squares: torch.Tensor) -> None:
        """One gradient's float64 sum of squares into the running norm (under the lock)."""
        prev = self._squares.get(squares.device)
        self._squares[squares.device] = squares if prev is None else prev + squares

    @torch.no_grad()
    def _step(self, p: torch.Tensor) -> bool:
        """``step()``'s update of ``p`` alone, on the gradient in ``p.grad``; False (nothing done) when ``p`` is no
        longer in the optimizer. Shared with the DDP communication hook (``in_backward_ddp``)."""
        opt = self._optimizer
        with self._lock:
            _refuse_clip(opt)
            where = self._where(p)
            if where is None:  # no longer in the optimizer: leave its gradient alone
                return False
            gi, j, salt = where
            group = opt.param_groups[gi]
            opt._check_dense(p, gi, j)
            grad = local(p.grad)
            if self._track:
                self._add_squares(_squared_norm(grad))
            # step()'s loop body, for this one parameter (FusedAdamW.step)
            lay = _state.init(opt.state[p], group, p, f"FusedAdamW param group {gi}, parameter {j}")
            entry = (p, salt, lay, opt._uses_triton(group, p, lay))
            device, p_dtype = local(p).device, local(p).dtype
            if entry[3]:
                opt._triton_step(group, [entry], device, p_dtype, grad.dtype, lay, None, None, None)
            else:
                opt._torch_step(group, [entry], device, lay, None, None, None)
            self.stepped += 1
            self.updates += 1
        return True


def _in_blocks(
    handle: StepInBackward,
    p: torch.Tensor,
    block_elements: int,
    blocks: Iterable[tuple[int, int, torch.Tensor]],
) -> bool:
    """``step_blocks_in_backward`` (its doc) with the handle that steps ``p``, under its lock."""
    opt = handle._optimizer
    _refuse_clip(opt)
    if handle.armed is not None and not handle.armed():
        return False
    where = handle._where(p)
    stage = _torch_step.STAGE_ELEMENTS
    if where is None or not (block_elements % stage == 0 or block_elements >= p.numel()):
        return False
    if not p.is_contiguous() or getattr(p, "_backward_hooks", None) or len(_post_hooks(p)) != 1:
        return False  # a hook of someone else's would not see the gradient, which never exists whole
    gi, j, salt = where
    group = opt.param_groups[gi]
    if opt._backend_for(group, p.device) != "torch":
        return False
    lay = _state.init(opt.state[p], group, p, f"FusedAdamW param group {gi}, parameter {j}")
    native = lay.torch_native(p.dtype) and opt._sr_seed(group, p.dtype) is None
    if native or lay.state_slice(opt.state[p], 0, p.numel()) is None:
        return False  # torch's kernel on the whole list, or a state that cannot be cut: the whole gradient
    held = p.grad  # what earlier accumulating backwards left, to which autograd would add this one
    if held is not None:
        opt._check_dense(p, gi, j)
        held = held.reshape(-1)
    squares = torch.zeros((), dtype=torch.float64, device=p.device) if handle._track else None

    def feed():
        for start, stop, grad in blocks:
            flat = grad.reshape(-1)
            if held is not None:
                flat = held[start:stop] + flat
            if squares is not None:
                _squared_norm(flat, squares)
            yield start, stop, flat

    opt._torch_step_blocks(group, p, salt, lay, feed())
    if squares is not None:
        handle._add_squares(squares)
    handle.stepped += 1
    handle.updates += 1
    p.grad = None
    return True


def _post_hooks(p: torch.Tensor) -> dict:
    return getattr(p, "_post_accumulate_grad_hooks", None) or {}


def step_blocks_in_backward(
    p: torch.Tensor, block_elements: int, blocks: Iterable[tuple[int, int, torch.Tensor]]
) -> bool:
    """Step ``p`` now from a gradient that comes in consecutive flat blocks ``(start, stop, gradient of elements
    start:stop)`` of ``block_elements`` each (the last shorter), never whole: the update, state and logged norm
    that a whole gradient stepped by the one-process handle would give, bit for bit. True when done (``p.grad``
    is then None, as after the hook); False, with ``blocks`` untouched, where no armed one-process handle steps
    ``p`` or the step cannot be cut this way (the Triton backend, torch's unstaged kernel, blocks off the staged
    pieces, someone else's hook on ``p``): then hand autograd the whole gradient.

    What uses it: the fused head's tied weight gradient (``loss.tied_embedding``), made at the embedding's
    backward, is the one weight-sized gradient left there (0.78 GB at a 4B model's bf16 embedding)."""
    handle = _handle_for(p)
    if handle is None:
        return False
    with handle._lock:
        return _in_blocks(handle, p, block_elements, blocks)


def _squared_norm(grad: torch.Tensor, total: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient's float64 sum of squares, ``STAGE_ELEMENTS`` elements at a time, added to ``total`` (a running
    sum over consecutive blocks of one gradient: the same additions as over the whole): a whole gradient widened
    to float64 costs 8 bytes an element (1.2 GB at a 0.6B model's embedding, 3.1 GB at a 4B one's), more than
    the step itself."""
    flat = grad.reshape(-1)
    if total is None:
        total = torch.zeros((), dtype=torch.float64, device=grad.device)
    for lo in range(0, flat.numel(), _torch_step.STAGE_ELEMENTS):
        part = flat[lo : lo + _torch_step.STAGE_ELEMENTS].to(torch.float64)
        total += torch.dot(part, part)
    return total


def frees_gradient_in_backward(p: torch.Tensor) -> bool:
    """Whether a one-process ``step_in_backward`` handle steps ``p`` in the backward about to run, freeing its
    gradient there (registered, not removed, armed now). Then a gradient that only exists from some point of the
    backward on costs memory from that point alone: the fused head computes a tied weight's gradient at the
    embedding's backward instead of at its own (``loss.tied_embedding``). Under DDP the buckets hold every gradient
    anyway (``in_backward_ddp``), so its handles do not count."""
    handle = _handle_for(p)
    return handle is not None and (handle.armed is None or handle.armed())


def _handle_for(p: torch.Tensor) -> StepInBackward | None:
    """The registered one-process handle whose optimizer holds ``p`` (an optimizer has one handle at most; DDP's
    step buckets, not parameters, and is not one)."""
    for handle in list(_ACTIVE.values()):
        if type(handle) is StepInBackward and not handle.removed:
            with handle._lock:
                if handle._where(p) is not None:
                    return handle
    return None


def step_in_backward(
    optimizer: FusedAdamW, *, track_grad_norm: bool = True, armed: Callable[[], bool] | None = None
) -> StepInBackward:
    """Step each parameter of ``optimizer`` inside ``backward()`` as soon as its gradient is final, and free the
    gradient (module doc). Returns the handle: ``remove()``, ``grad_norm()``, ``reset_grad_norm()``.

    ``track_grad_norm=False`` skips the per-gradient norm (one extra read of each gradient). ``armed``: a
    predicate; a backward during which it says False only accumulates (gradient accumulation, module doc).
    """
    if not isinstance(optimizer, FusedAdamW):
        raise TypeError(f"step_in_backward: needs a fasttrain.FusedAdamW, got {type(optimizer).__name__}")
    if optimizer in _ACTIVE:
        raise ValueError(
            "step_in_backward: this optimizer already steps in backward (remove() the first handle before "
            "registering again)"
        )
    _refuse_clip(optimizer)
    params = []
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            where = f"step_in_backward: param group {gi}, parameter {j}"
            if is_dtensor(p):
                raise ValueError(
                    f"{where} is a DTensor (FSDP2): its sharded gradient is set after FSDP2's reduce-scatter, "
                    "not by autograd's accumulation, so it cannot be stepped in backward"
                )
            if not p.is_leaf:
                raise ValueError(
                    f"{where} is not a leaf tensor: autograd accumulates no gradient into it, so it has no "
                    "post-accumulate-grad hook"
                )
            if not hasattr(p, "register_post_accumulate_grad_hook"):
                raise ValueError(
                    f"{where}: this torch has no Tensor.register_post_accumulate_grad_hook (torch >= 2.1)"
                )
            if p.grad is not None:
                optimizer._check_dense(p, gi, j)  # a sparse gradient left from before: refused now
            if p.requires_grad:  # a frozen parameter gets no gradient, and no hook
                params.append(p)
    handle = StepInBackward(optimizer, params, track_grad_norm, armed)
    _ACTIVE[optimizer] = handle
    return handle


__all__ = ["StepInBackward", "frees_gradient_in_backward", "step_blocks_in_backward", "step_in_backward"]
