"""``step_in_backward_ddp``: ``step_in_backward`` under DDP, as a DDP communication hook.

A post-accumulate-grad hook (``step_in_backward``) would fire before DDP's all-reduce and step on the local
gradient. Here the step moves to where the averaged gradient first exists: the communication hook averages each
bucket exactly as DDP's default hook does (``allreduce_hook``: divide by the world size, all-reduce), and once that
all-reduce completes (the future's ``then``) steps the bucket's parameters on their averaged gradients, one at a
time through ``StepInBackward._step`` (the optimizer's own per-parameter machinery, stochastic-rounding salt = the
parameter's index over all groups, same lock and gradient norm). So each update is the one ``optimizer.step()``
would make after an ordinary DDP backward, bit for bit, while later buckets are still being reduced.

::

    handle = step_in_backward_ddp(ddp_model, optimizer)
    for batch in data:
        ddp_model(batch).loss.backward()   # every bucket stepped as its all-reduce completes, gradients freed
        optimizer.step()                   # harmless: no stepped parameter has a gradient left
        optimizer.zero_grad()

``optimizer.step()`` stays harmless the same way as with ``step_in_backward``: after DDP has copied the buckets back
into ``p.grad`` (its last act of the backward), a callback queued on the autograd engine sets the stepped
parameters' gradients to ``None``, and ``step()`` skips parameters without one. (No change to ``FusedAdamW``.)

Memory: DDP's buckets hold a copy of every gradient anyway, so unlike ``step_in_backward`` on one process this saves
no gradient memory beyond ``p.grad`` being freed at the end of the backward; what it buys is the update overlapping
the remaining communication and backward.

Gradient accumulation: under ``ddp.no_sync()`` DDP runs no communication hook, so nothing is stepped and gradients
accumulate in ``p.grad`` as usual; the synced backward's buckets carry the accumulated sum, which is stepped.
``find_unused_parameters=True``: a parameter no rank used gets no gradient from ordinary DDP and no update from
``step()``; the hook all-reduces a used flag per parameter with the bucket and steps only those some rank used.

Refused (ValueError): ``gradient_as_bucket_view=True`` (``p.grad`` is then the bucket itself, so an unused
parameter cannot be told from a used one, and freeing it gives DDP's views back), a DDP model that already has a
communication hook, an optimizer already stepping in backward, and whatever ``step_in_backward`` refuses for its
parameters (a pending deferred clip, DTensor parameters).

``handle.remove()``: DDP cannot unregister a communication hook, so the hook stays but stops stepping: later
backwards only average (as DDP's default hook) and leave the gradients for ``optimizer.step()``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from ._tensors import is_dtensor
from .adamw import FusedAdamW
from .in_backward import _ACTIVE, StepInBackward, _refuse_clip


class StepInBackwardDDP(StepInBackward):
    """The communication hook's state: ``StepInBackward``'s per-parameter step, norm and lock, without its
    post-accumulate-grad hooks (registers none)."""

    def __init__(
        self, ddp: torch.nn.parallel.DistributedDataParallel, optimizer: FusedAdamW, track: bool
    ) -> None:
        super().__init__(optimizer, [], track, None)
        self._ddp = ddp
        self._process_group = ddp.process_group
        self._find_unused = bool(ddp.find_unused_parameters)
        self._stepped_params: list[torch.Tensor] = []  # this backward's, freed by the post-backward callback

    def remove(self) -> None:
        """Stop stepping: the communication hook stays registered (DDP cannot remove one) and only averages."""
        self.removed = True
        if _ACTIVE.get(self._optimizer) is self:
            del _ACTIVE[self._optimizer]

    def rearm(self) -> None:
        """Step again after ``remove()`` (the hook never left DDP): a later ``train()`` on the same DDP model."""
        if _ACTIVE.get(self._optimizer, self) is not self:
            raise ValueError("step_in_backward_ddp: this optimizer steps in backward through another handle")
        self.removed = False
        _ACTIVE[self._optimizer] = self

    # -- the communication hook -----------------------------------------------------------------------------------

    # no annotations on the hook: DDP compares them to dist.GradBucket / Future[Tensor] as objects, and this
    # module's postponed annotations would be strings
    def comm_hook(self, state, bucket):
        if self.removed:
            return allreduce_hook(self._process_group, bucket)
        params = bucket.parameters()
        # before the all-reduce: p.grad is still this rank's own gradient, None for a parameter it did not use
        local_grads = [p.grad for p in params]
        futures = [allreduce_hook(self._process_group, bucket)]  # divide by the world size, then all-reduce
        if self._find_unused:
            used = torch.tensor([g is not None for g in local_grads], dtype=torch.int32)
            futures.append(dist.all_reduce(used, group=self._process_group, async_op=True).get_future())
        if bucket.index() == 0:  # DDP reduces the buckets in index order: once per synced backward
            self._queue_free()

        def step(done: torch.futures.Future) -> torch.Tensor:
            results = [f.value() for f in done.value()]
            averaged = results[0]
            if averaged.data_ptr() != bucket.buffer().data_ptr():
                bucket.buffer().copy_(averaged)
            used = results[1][0].tolist() if self._find_unused else [1] * len(params)
            for p, g, own, n in zip(params, bucket.gradients(), local_grads, used, strict=True):
                if not n:  # no rank used it: ordinary DDP leaves it without a gradient, step() skips it
                    continue
                p.grad = g  # the averaged gradient, a view of the bucket
                try:
                    stepped = self._step(p)
                finally:
                    p.grad = own  # DDP copies the bucket into it after this future (no new allocation)
                if stepped:
                    self._stepped_params.append(p)
            return bucket.buffer()

        return torch.futures.collect_all(futures).then(step)

    def _queue_free(self) -> None:
        """Free the stepped parameters' gradients after DDP's ``finalize_backward``, which copies the buckets
        into ``p.grad``. DDP queues that on the autograd engine after the last bucket's hook, i.e. after
        anything queued here; a callback queued while the engine runs its callbacks runs after them, so the first
        callback queues the one that frees."""
        engine = torch.autograd.Variable._execution_engine

        def free() -> None:
            for p in self._stepped_params:
                p.grad = None
            self._stepped_params = []

        engine.queue_callback(lambda: engine.queue_callback(free))


def step_in_backward_ddp(
    ddp_model: torch.nn.parallel.DistributedDataParallel,
    optimizer: FusedAdamW,
    *,
    track_grad_norm: bool = True,
) -> StepInBackwardDDP:
    """Step each parameter of ``optimizer`` inside ``backward()`` under DDP, on its averaged gradient, as soon as
    its bucket's all-reduce completes (module doc). Registers ``ddp_model``'s communication hook. Returns the
    handle: ``remove()``, ``grad_norm()``, ``reset_grad_norm()``."""
    if not isinstance(optimizer, FusedAdamW):
        raise TypeError(f"step_in_backward_ddp: needs a fasttrain.FusedAdamW, got {type(optimizer).__name__}")
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"step_in_backward_ddp: needs a DistributedDataParallel, got {type(ddp_model).__name__}"
        )
    if optimizer in _ACTIVE:
        raise ValueError(
            "step_in_backward_ddp: this optimizer already steps in backward (remove() the first handle first)"
        )
    if ddp_model.gradient_as_bucket_view:
        raise ValueError(
            "step_in_backward_ddp: gradient_as_bucket_view=True is not supported (p.grad is then the bucket "
            "itself: an unused parameter cannot be told from a used one); use the default False"
        )
    if getattr(ddp_model, "_comm_hooks", None):
        raise ValueError(
            "step_in_backward_ddp: this DDP model already has a communication hook (DDP allows one)"
        )
    _refuse_clip(optimizer)
    for gi, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            if is_dtensor(p):
                raise ValueError(f"step_in_backward_ddp: param group {gi}, parameter {j} is a DTensor")
            if p.grad is not None:
                optimizer._check_dense(p, gi, j)
    handle = StepInBackwardDDP(ddp_model, optimizer, track_grad_norm)
    ddp_model.register_comm_hook(None, handle.comm_hook)
    _ACTIVE[optimizer] = handle
    return handle


__all__ = ["StepInBackwardDDP", "step_in_backward_ddp"]
