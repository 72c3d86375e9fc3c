"""``FusedAdamW``: torch's AdamW, one fused pass per parameter group, gradient clipping fused in, optional 8-bit state.

Contract (the public API): same math and ``state_dict`` layout as ``torch.optim.AdamW`` (``step``, ``exp_avg``,
``exp_avg_sq``; ``max_exp_avg_sq`` with amsgrad), so either optimizer loads the other's checkpoint. What the
moments are kept in is ``state_dtype``:

==================  =====================================================  ==============================
``state_dtype``     moments                                                state bytes / parameter
==================  =====================================================  ==============================
``None`` (default)  in the parameter's dtype, as torch.optim.AdamW         2 x the parameter's (torch's)
``torch.float32``   fp32 whatever the parameter's dtype                    8
``"8bit"``          blockwise 8-bit (``fasttrain.optim.blockwise8``:       2 + 8/256 (fp32 below
                    codes + fp32 absmax per 256 elements)                  ``min_8bit_size`` elements)
==================  =====================================================  ==============================

In every mode the arithmetic is fp32 (fp64 for fp64 parameters) and each stored value is rounded once, as in
torch's fused kernel. ``bf16_stochastic_rounding=True`` rounds bf16 parameters stochastically instead of to
nearest (``fasttrain.optim.rounding``: the random bits are a function of ``sr_seed``, the parameter's index and
its step, so a resumed run rounds as the uninterrupted one), so that pure-bf16 training follows fp32 master
weights in expectation. The 8-bit layout uses other state names than torch's (see ``_state``): such a
checkpoint loads only into a FusedAdamW with the same ``state_dtype``; loading a state dict of another mode
raises a ValueError naming the parameter group.

Backends (``fasttrain._backend``): ``"triton"`` runs the multi-tensor kernels of ``fasttrain.kernels.adamw`` and
``adamw8bit`` (on CPU only through ``TRITON_INTERPRET=1``); ``"torch"`` runs ``torch._fused_adamw_`` (torch's own
fused AdamW; staged through fp32 copies where the layout is not its own, see ``_torch_step``); ``"auto"`` picks
Triton for CUDA tensors and torch elsewhere (logged once).

Under DeepSpeed ZeRO (the Trainer's client optimizer when the DeepSpeed config has no ``optimizer`` section)
ZeRO steps this optimizer on its own flat fp32 partitions, one per parameter group (ZeRO-1/2 show it one group
at a time; under ZeRO-3 the groups are empty outside ``step()``), after the engine clipped the gradients. So
``state_dtype="8bit"`` quantizes whole partitions (``min_8bit_size`` applies to a partition, not to each
parameter), and ``bf16_stochastic_rounding`` would have nothing to round: the Trainer integration refuses it.

Under FSDP2 (DTensor parameters, full or hybrid shard, CPU offload) each rank steps its own shard. Stochastic
rounding draws each element's bits at its index in the whole parameter (the shard's offset added to the local
index), so a sharded run rounds as the unsharded optimizer does, bit for bit, and so does a checkpoint resharded
to another world size or mesh; DTensors sharded otherwise than along dim 0 draw them at the local index (logged).
With ``state_dtype="8bit"`` it quantizes the rows it owns in row blocks, kept as DTensors placed like the parameter,
so that torch.distributed.checkpoint reshards them to another world size or mesh (``layouts`` says how the blocks
relate to the shards; 1-D parameters keep fp32 moments there, ``_state``).

Nothing about the parameters is cached at construction: state is created lazily in ``step()`` and the launch
tables are keyed on the tensors' addresses, because FSDP2 swaps parameters for DTensor shards after the
optimizer exists and Accelerate round-trips ``state_dict`` when it prepares it. What ``step()`` decides per
parameter is kept from one step to the next in a plan per group (``_plan``), checked at every step against what
it was decided from: the same kernels run with the same arguments, without the Python work per parameter.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch

from .._backend import check_backend, resolve_backend
from .._logging import log_once
from . import _plan, _state, _torch_step, blockwise8
from . import clip as _clip
from ._tensors import global_offset, group_by, is_dtensor, local

# our group keys: the constructor's values win over a loaded state dict's (state_dtype and min_8bit_size must agree)
_OWN_KEYS = ("backend", "state_dtype", "min_8bit_size", "bf16_stochastic_rounding", "sr_seed")
# torch.optim.AdamW(fused=True)'s group keys, in our groups too: torch's AdamW loading our state dict runs its
# fused kernel (our math), not its foreach default
_TORCH_KEYS = {
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


def _kernels():
    # imported on first use: `import fasttrain` must not import triton
    from fasttrain.kernels import adamw as kernels

    return kernels


def _check_hyperparameters(group: dict[str, Any], where: str) -> None:
    lr, betas, eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: a tensor lr must have one element, got shape {tuple(lr.shape)}")
        lr_value = float(lr.detach().reshape(()).cpu())
    else:
        lr_value = lr
    if not isinstance(lr_value, (int, float)) or not lr_value >= 0.0:
        raise ValueError(f"{where}: invalid learning rate {lr!r} (must be a number >= 0)")
    if not isinstance(eps, (int, float)) or not eps >= 0.0:
        raise ValueError(f"{where}: invalid eps {eps!r} (must be a number >= 0)")
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        if isinstance(beta, torch.Tensor) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(
                f"{where}: invalid beta parameter at index {i}: {beta!r} (must be a float in [0, 1))"
            )
    if not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
        raise ValueError(f"{where}: invalid weight_decay {weight_decay!r} (must be a number >= 0)")
    check_backend(group["backend"], where)
    group["state_dtype"] = _state.normalize_state_dtype(group["state_dtype"], where)
    if not isinstance(group["min_8bit_size"], int) or group["min_8bit_size"] < 1:
        raise ValueError(f"{where}: min_8bit_size must be a positive int, got {group['min_8bit_size']!r}")
    if not isinstance(group["sr_seed"], int):
        raise ValueError(f"{where}: sr_seed must be an int, got {group['sr_seed']!r}")


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW`` semantics) in one fused pass, with fused gradient clipping and a choice of state.

    Args:
        params: parameters or parameter groups (groups may set their own lr, betas, eps, weight_decay, and
            state_dtype, bf16_stochastic_rounding).
        lr: learning rate, a float or a one-element tensor (a scheduler changing it never recompiles).
        betas, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.AdamW``.
        backend: ``"auto"`` (Triton on CUDA, torch's fused AdamW elsewhere), ``"triton"`` or ``"torch"``.
        state_dtype: ``None`` (moments in the parameter's dtype: torch's memory), ``torch.float32``, or
            ``"8bit"`` (blockwise-quantized moments: a quarter of fp32 states, half of bf16 states).
        bf16_stochastic_rounding: round bf16 parameters stochastically (no effect on other dtypes).
        min_8bit_size: with ``"8bit"``, parameters with fewer elements keep fp32 moments (bitsandbytes' default).
        sr_seed: seed of the stochastic rounding (the bits also depend on the parameter's index and step).
        foreach, fused, capturable, differentiable: accepted for drop-in compatibility with
            ``torch.optim.AdamW``; ``foreach``/``fused`` are ignored (this optimizer is fused),
            ``capturable=True`` and ``differentiable=True`` are refused.

    ``defer_clip_grad_norm_(max_norm)`` computes the global gradient norm and arms the clip coefficient for
    the next ``step()``, which applies it inside the kernel.

    With ``torch.amp.GradScaler`` the scaler hands its scale and inf flag to ``step()``
    (``_step_supports_amp_scaling``): gradients are unscaled in the kernel and a step with inf/NaN
    gradients changes nothing (parameters, states, step counts), decided on the device.
    """

    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Iterable[Any],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        backend: str = "auto",
        state_dtype: torch.dtype | str | None = None,
        bf16_stochastic_rounding: bool = False,
        min_8bit_size: int = blockwise8.MIN_8BIT_SIZE,
        sr_seed: int = 0,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if capturable:
            raise ValueError("FusedAdamW: capturable=True (CUDA graphs) is not supported")
        if differentiable:
            raise ValueError("FusedAdamW: differentiable=True is not supported")
        del foreach, fused  # always fused; accepted so that torch.optim.AdamW kwargs pass through
        defaults = {
            "lr": lr,
            "betas": tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": bool(amsgrad),
            "maximize": bool(maximize),
            "backend": backend,
            "state_dtype": state_dtype,
            "bf16_stochastic_rounding": bool(bf16_stochastic_rounding),
            "min_8bit_size": min_8bit_size,
            "sr_seed": sr_seed,
            **_TORCH_KEYS,
        }
        _check_hyperparameters(dict(defaults), "FusedAdamW")
        defaults["state_dtype"] = _state.normalize_state_dtype(state_dtype, "FusedAdamW")
        super().__init__(params, defaults)
        self._clip_coef: torch.Tensor | None = None  # armed by defer_clip_grad_norm_, consumed by step
        self.deferred_clips_applied = 0  # steps that applied a clip armed with a finite max_norm
        self._clip_finite = False  # whether the armed coefficient came from a finite max_norm
        self._tables: dict[Any, Any] = {}  # launch tables keyed on the tensors' addresses
        self._drop_plans()

    def _drop_plans(self) -> None:
        # what step() decided per parameter, per group (keyed on id(group), the plan holds the group) and for the
        # clip: dropped wherever groups or state are replaced wholesale; finer changes fail the plan's own check
        self.__dict__["_plans"] = {}
        self.__dict__["_clip_plan"] = None

    # -- groups and state ------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        _check_hyperparameters(self.param_groups[-1], f"FusedAdamW param group {len(self.param_groups) - 1}")
        self._drop_plans()

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups of a torch.optim.AdamW checkpoint lack our keys
            for key in ("amsgrad", "maximize", *_OWN_KEYS):
                group.setdefault(key, self.defaults[key])
        self.__dict__.setdefault("_clip_coef", None)
        self.__dict__.setdefault("_clip_finite", False)
        self.__dict__.setdefault("deferred_clips_applied", 0)
        self.__dict__.setdefault("_tables", {})
        self._drop_plans()

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, its groups keyed as ``torch.optim.AdamW``'s, plus ``state_dtype`` for 8-bit moments.

        A sharded (torch.distributed.checkpoint) load fills the loading optimizer's own state dict from the
        checkpoint and refuses a key the checkpoint lacks, so a group key torch's AdamW does not write would keep
        FSDP2 checkpoints from crossing between the two. Full-precision moments (``state_dtype`` None or
        ``torch.float32``) are torch's state, in one dtype or another; 8-bit moments are another state, and say so.
        The settings left out are the constructor's on load.
        """
        state = super().state_dict()
        for group in state["param_groups"]:
            for key in _OWN_KEYS:
                if key != "state_dtype" or group.get(key) != "8bit":
                    group.pop(key, None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a FusedAdamW or ``torch.optim.AdamW`` state dict with the same kind of moments.

        Full-precision moments (torch's AdamW's, FusedAdamW's with ``state_dtype`` None or ``torch.float32``) load
        into ``state_dtype=None`` or ``torch.float32``, cast as torch's loader casts them (a sharded load casts
        them the same way). Moments of the other kind are converted, logged once: full precision quantized into
        8-bit blocks, 8-bit moments dequantized (another ``state_dtype`` or ``min_8bit_size``, or a state gathered
        from FSDP2 shards, where 1-D parameters keep fp32 moments). A sharded load through
        torch.distributed.checkpoint reads the keys this optimizer's own state holds: there a checkpoint of the
        other kind is refused by torch, naming the key it lacks. This optimizer's own settings (backend,
        state_dtype, stochastic rounding) stay the constructor's; lr, betas, eps, weight_decay, amsgrad and
        maximize come from the state dict, as in torch.
        """
        saved_groups = [dict(g) for g in state_dict["param_groups"]]
        saved_state = dict(state_dict["state"])
        converted = 0
        for i, (saved, ours) in enumerate(zip(saved_groups, self.param_groups, strict=False)):
            where = f"FusedAdamW param group {i}"
            _state.normalize_state_dtype(saved.get("state_dtype"), where)  # a ValueError for an unknown one
            for key in _OWN_KEYS:
                saved[key] = ours[key]
            for param_id, param in zip(saved["params"], ours["params"], strict=False):
                before = saved_state.get(param_id, {})
                after = _state.conform(before, ours, param, f"{where}, parameter {param_id}")
                if after is not before:
                    saved_state[param_id] = after
                    converted += 1
        if converted:
            log_once(
                "fused_adamw.load_converted",
                f"FusedAdamW.load_state_dict: the moments of {converted} parameter(s) were saved in another layout "
                "(8-bit or full precision) than this optimizer keeps: converted on load (quantized or dequantized)",
            )
        super().load_state_dict({**state_dict, "param_groups": saved_groups, "state": saved_state})
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )
        groups = {id(p): g for g in self.param_groups for p in g["params"]}
        for param_id, param in id_map.items():
            saved = saved_state.get(param_id)
            if saved:
                _state.restore(self.state[param], saved, param, _state.layout(groups[id(param)], param))
        self._tables.clear()
        self._drop_plans()  # restore() replaced state tensors after torch's load (which called __setstate__)

    # -- backend choice -----------------------------------------------------------------------------

    def _backend_for(self, group: dict[str, Any], device: torch.device) -> str:
        backend = resolve_backend(group["backend"], device, "FusedAdamW")
        if group["backend"] == "auto" and backend == "torch":
            log_once(
                f"fused_adamw.auto.{device.type}",
                f"FusedAdamW: parameters on {device.type}: using torch's fused AdamW (the Triton kernel "
                "needs CUDA); gradient clipping is applied through its grad_scale",
                logging.INFO,
            )
        return backend

    def _triton_ok(self, tensors: Iterable[torch.Tensor]) -> bool:
        kernels = _kernels()
        for t in tensors:
            if not (t.is_contiguous() and (kernels.supported_dtype(t.dtype) or t.dtype == torch.uint8)):
                log_once(
                    f"fused_adamw.triton_unsupported.{t.dtype}.{t.is_contiguous()}",
                    f"FusedAdamW: a tensor of dtype {t.dtype} (contiguous={t.is_contiguous()}) is not supported "
                    "by the Triton kernel; its parameter is updated by torch's fused AdamW",
                )
                return False
        return True

    def _table(
        self, kind: str, rows: list[list[torch.Tensor | None]], device: torch.device, salts=None, offsets=None
    ):
        key = (kind, device, tuple(0 if t is None else t.data_ptr() for row in rows for t in row))
        key += (tuple(t.numel() for t in rows[0]), None if salts is None else tuple(salts))
        key += (None if offsets is None else tuple(offsets),)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) > 64:  # addresses changed (new grads, a reload): drop stale tables
                self._tables.clear()
            table = _kernels().TensorTable(rows, device, salts=salts, offsets=offsets)
            self._tables[key] = table
        return table

    # -- clipping ----------------------------------------------------------------------------------

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for i, group in enumerate(self.param_groups):
            for j, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._check_dense(p, i, j)
                    grads.append(p.grad)
        return grads

    def _per_tensor_norms(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        device = grads[0].device
        backend = self._backend_for(self.param_groups[0], device)
        if backend == "triton" and norm_type in (2.0, math.inf) and self._triton_ok(grads):
            table = self._table("norm", [grads], device)
            return _kernels().per_tensor_norms(table, grads[0].dtype, norm_type).to(grads[0].dtype)
        return _clip.torch_per_tensor_norms(grads, norm_type)

    def _clip_buckets(self, grads: list[torch.Tensor]) -> list[_plan.Bucket]:
        """``clip.total_norm``'s buckets of plain gradients, with ``_per_tensor_norms``' backend decision."""
        buckets = []
        index = {}
        for i, g in enumerate(grads):
            index.setdefault((g.device, g.dtype), []).append(i)
        for (device, dtype), idx in index.items():
            bucket = [grads[i] for i in idx]
            backend = self._backend_for(self.param_groups[0], device)
            triton = backend == "triton" and self._triton_ok(bucket)
            buckets.append(_plan.Bucket(triton, device, dtype, dtype, None, idx, [], [], None, grad_row=0))
        return buckets

    def _planned_norm(
        self, plan: _plan.ClipPlan, grads: list[torch.Tensor], norm_type: float
    ) -> torch.Tensor:
        """``clip.total_norm`` of plain ``grads`` through ``plan``'s buckets: the same ops in the same order."""
        first_device = grads[0].device
        norms = []
        for b in plan.buckets:
            bucket = [grads[i] for i in b.index]
            if b.triton and norm_type in (2.0, math.inf):
                if b.table is None:  # built at its first use: a norm_type the kernel lacks needs none
                    b.table = self._table("norm", [bucket], b.device)
                    b.grad_ptrs = tuple(g.data_ptr() for g in bucket)
                per_tensor = _kernels().per_tensor_norms(b.table, b.g_dtype, norm_type).to(b.g_dtype)
            else:
                per_tensor = _clip.torch_per_tensor_norms(bucket, norm_type)
            norms.append(per_tensor.to(first_device))
        return _clip.combine(norms, norm_type)

    @torch.no_grad()
    def defer_clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of all gradients (as ``torch.nn.utils.clip_grad_norm_`` returns it); the clip itself is
        deferred to the next ``step()``: until then the gradients stay unclipped.

        Computes the norm in one multi-tensor pass (reduced over FSDP2/DTensor shards), and arms the
        coefficient ``min(1, max_norm / (norm + 1e-6))`` as a device scalar that the next ``step()``
        applies inside the kernel (the Triton kernel does not rewrite the gradients) and nothing waits for
        the device. The torch backend applies it the same way, through the ``grad_scale`` argument of torch's
        fused kernel (``grad / (1 / coef)``: equal to torch's ``grad * coef`` to one fp32 rounding), skipping
        it on CPU when the coefficient is exactly 1 (reading a CPU scalar costs nothing).
        A non-finite norm gives what torch's clip + AdamW gives (NaN parameters), unless a GradScaler
        skips the step. Returns a 0-d tensor on the gradients' device, in their dtype (as torch does).
        """
        norm_type = float(norm_type)
        plan = self._clip_plan
        grads = None if plan is None else plan.live_grads(self.param_groups)
        if grads is None:
            grads = self._grads()
            plan = None
            if grads and not any(map(is_dtensor, grads)):
                plan = _plan.ClipPlan.make(self.param_groups, grads, self._clip_buckets(grads))
            self._clip_plan = plan
        if plan is None:
            total = _clip.total_norm(grads, norm_type, self._per_tensor_norms)
        else:
            total = self._planned_norm(plan, grads, norm_type)
        if not grads:
            self._clip_coef = None
            return total
        self._clip_coef = _clip.clip_coefficient(total, max_norm).to(torch.float32)
        self._clip_finite = math.isfinite(float(max_norm))
        return total

    @staticmethod
    def _check_dense(p: torch.Tensor, group_index: int, param_index: int) -> None:
        if p.grad.is_sparse:
            raise ValueError(
                f"FusedAdamW param group {group_index}: parameter {param_index} has a sparse gradient, which "
                "FusedAdamW (any state_dtype) does not support: use dense gradients (nn.Embedding(sparse=False)) "
                "or torch.optim.SparseAdam for that parameter"
            )

    # -- step --------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        """One AdamW step over every parameter with a gradient (parameters without one are skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_scale = getattr(self, "grad_scale", None)  # set by torch.amp.GradScaler.step
        found_inf = getattr(self, "found_inf", None)
        clip_coef, self._clip_coef = self._clip_coef, None
        if clip_coef is not None and self._clip_finite:
            self.deferred_clips_applied += 1
        scalars = (clip_coef, grad_scale, found_inf)
        salt_base = 0
        for gi, group in enumerate(self.param_groups):
            plan = self._plans.get(id(group))
            live = None if plan is None else plan.live_grads(group, salt_base, self.state)
            if live is None:
                plan, live = self._plan_group(gi, group, salt_base)
            salt_base += len(group["params"])
            for bucket in plan.buckets:
                if bucket.triton:
                    self._launch_triton(group, bucket, *scalars)
                else:
                    self._launch_torch(group, bucket, [live[i] for i in bucket.index], *scalars)
        return loss

    def _plan_group(
        self, gi: int, group: dict[str, Any], salt_base: int
    ) -> tuple[_plan.GroupPlan | _plan.Unplanned, list[torch.Tensor]]:
        """Decide a group's step (state created where missing, layouts, backends, buckets, tables); kept as its plan
        when the plan's check can see every change (module ``_plan``). Returns the plan and the stepped
        parameters' local gradients."""
        where = f"FusedAdamW param group {gi}"
        entries = []  # (param, salt, layout, uses triton)
        for j, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            self._check_dense(p, gi, j)
            lay = _state.init(self.state[p], group, p, f"{where}, parameter {j}")
            entries.append((p, salt_base + j, lay, self._uses_triton(group, p, lay)))
        position = {id(e[0]): i for i, e in enumerate(entries)}
        buckets = []
        for (device, p_dtype, g_dtype, lay), bucket in group_by(
            [e for e in entries if e[3]],
            lambda e: (local(e[0]).device, local(e[0]).dtype, local(e[0].grad).dtype, e[2]),
        ).items():
            buckets.append(self._bucket(group, bucket, position, True, device, p_dtype, g_dtype, lay))
        for (device, p_dtype, lay), bucket in group_by(
            [e for e in entries if not e[3]], lambda e: (local(e[0]).device, local(e[0]).dtype, e[2])
        ).items():
            buckets.append(self._bucket(group, bucket, position, False, device, p_dtype, None, lay))
        stepped = [e[0] for e in entries]
        live = [local(p.grad) for p in stepped]
        plan = None
        if not any(is_dtensor(p) or is_dtensor(p.grad) for p in stepped):
            states = [self.state[p] for p in stepped]
            plan = _plan.GroupPlan.make(group, salt_base, stepped, states, live, buckets)
        if plan is None:  # decided again at the next step
            self._plans.pop(id(group), None)
            return _plan.Unplanned(buckets), live
        # groups come and go (DeepSpeed shows ZeRO's one at a time, ZeRO-3 refills them): keep the plans bounded
        if len(self._plans) >= 64:
            self._plans.clear()
        self._plans[id(group)] = plan
        return plan, live

    def _bucket(self, group, entries, position, triton, device, p_dtype, g_dtype, lay) -> _plan.Bucket:
        """One launch's lists (and launch table), from ``entries`` (param, salt, layout, uses triton)."""
        params = [e[0] for e in entries]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        salts = [e[1] for e in entries]
        sr_seed = self._sr_seed(group, p_dtype)
        index = [position[id(p)] for p in params]
        bucket = _plan.Bucket(triton, device, p_dtype, g_dtype, lay, index, steps, salts, sr_seed)
        if triton:
            moments = lay.tensor_names(group["amsgrad"])
            rows = [[local(p) for p in params], [local(p.grad) for p in params]]
            rows += [[local(s[n]) if n in moments else None for s in states] for n in lay.kernel_slots]
            rows.append(steps)
            bucket.offsets = None if sr_seed is None else [self._sr_offset(p) for p in params]
            bucket.table = self._table(lay.table_kind, rows, device, salts=salts, offsets=bucket.offsets)
            bucket.grad_ptrs = tuple(g.data_ptr() for g in rows[1])
        else:
            bucket.params = [local(p) for p in params]
            # shallow copies holding local tensors: _torch_step reads and writes the tensors, never the dicts
            bucket.states = [
                {k: local(v) if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in states
            ]
            bucket.offsets = [0] * len(params) if sr_seed is None else [self._sr_offset(p) for p in params]
        return bucket

    def _uses_triton(self, group: dict[str, Any], p: torch.Tensor, lay: Any) -> bool:
        g = local(p.grad)
        if self._backend_for(group, g.device) != "triton":
            return False
        if self._sr_seed(group, p.dtype) is not None and _kernels().chunks_straddle(
            local(p).numel(), self._sr_offset(p)
        ):
            log_once(
                "fused_adamw.triton_sr_straddle",
                "FusedAdamW: a bf16 shard whose global element indices cross a multiple of 2**32 inside a kernel "
                "chunk (stochastic rounding keys fold in the index's high half per chunk): its parameter is "
                "updated by torch's fused AdamW",
            )
            return False
        state = self.state[p]
        if not lay.triton_can_step(state):
            return False
        return self._triton_ok([local(p), g, *(local(state[n]) for n in lay.tensor_names(group["amsgrad"]))])

    @staticmethod
    def _device_scalar(value: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        if value is None:
            return None
        return value.to(device=device, dtype=torch.float32, non_blocking=True).reshape(())

    def _betas_tensor(self, betas: tuple[float, float], device: torch.device) -> torch.Tensor:
        key = ("betas", device, float(betas[0]), float(betas[1]))
        t = self._tables.get(key)
        if t is None:
            b1, b2 = float(betas[0]), float(betas[1])
            t = torch.tensor([b1, b2, 1.0 - b1, 1.0 - b2], dtype=torch.float64).to(device)
            self._tables[key] = t
        return t

    @staticmethod
    def _sr_seed(group: dict[str, Any], p_dtype: torch.dtype) -> int | None:
        return group["sr_seed"] if group["bf16_stochastic_rounding"] and p_dtype == torch.bfloat16 else None

    @staticmethod
    def _sr_offset(p: torch.Tensor) -> int:
        """The global index of the first element of this rank's part of ``p`` (0 for a plain tensor), at which
        stochastic rounding draws its bits (``fasttrain.optim.rounding``)."""
        offset = global_offset(p)
        if offset is None:
            log_once(
                f"fused_adamw.sr_placements.{tuple(p.placements)}",
                f"FusedAdamW: bf16_stochastic_rounding on a DTensor placed {tuple(p.placements)} (not along dim 0 "
                "only): its random bits come from the local element index, so they depend on the sharding",
                logging.WARNING,
            )
            return 0
        return offset

    def _triton_step(
        self, group, entries, device, p_dtype, g_dtype, lay, clip_coef, grad_scale, found_inf
    ) -> None:
        """One Triton launch over ``entries`` (param, salt, layout, True), decided now (``step_in_backward``)."""
        position = {id(e[0]): i for i, e in enumerate(entries)}
        bucket = self._bucket(group, entries, position, True, device, p_dtype, g_dtype, lay)
        self._launch_triton(group, bucket, clip_coef, grad_scale, found_inf)

    def _launch_triton(self, group, bucket: _plan.Bucket, clip_coef, grad_scale, found_inf) -> None:
        device, steps = bucket.device, bucket.steps
        found_inf = self._device_scalar(found_inf, device)
        lr = group["lr"]
        args = _kernels().StepArgs(
            lr=self._device_scalar(lr, device) if isinstance(lr, torch.Tensor) else lr,
            betas=self._betas_tensor(group["betas"], device),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            clip_coef=self._device_scalar(clip_coef, device),
            grad_scale=self._device_scalar(grad_scale, device),
            found_inf=found_inf,
            amsgrad=group["amsgrad"],
            maximize=group["maximize"],
            sr_seed=bucket.sr_seed,
        )
        # as torch's fused AdamW: count the step first, take it back if the scaler found an inf
        torch._foreach_add_(steps, 1.0)
        bucket.lay.triton_step(bucket.table, bucket.p_dtype, bucket.g_dtype, device, args)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _torch_grad_scale(self, clip_coef, grad_scale, device) -> torch.Tensor | None:
        """The ``grad_scale`` for torch's fused kernel (it divides gradients by it): scale / clip_coef."""
        scale = self._device_scalar(grad_scale, device)
        coef = self._device_scalar(clip_coef, device)
        if coef is None or (device.type == "cpu" and coef.item() == 1.0):
            return scale  # nothing to clip; reading a CPU scalar costs nothing
        # 1 / 0 = inf and x / inf = 0, inf / inf = NaN: a non-finite norm gives what grad * 0 gives in torch
        inv = torch.reciprocal(coef)
        return inv if scale is None else scale * inv

    def _torch_step(self, group, entries, device, lay, clip_coef, grad_scale, found_inf) -> None:
        """One torch launch over ``entries`` (param, salt, layout, False), decided now (``step_in_backward``)."""
        position = {id(e[0]): i for i, e in enumerate(entries)}
        p_dtype = local(entries[0][0]).dtype
        bucket = self._bucket(group, entries, position, False, device, p_dtype, None, lay)
        grads = [local(e[0].grad) for e in entries]
        self._launch_torch(group, bucket, grads, clip_coef, grad_scale, found_inf)

    def _launch_torch(self, group, bucket: _plan.Bucket, grads, clip_coef, grad_scale, found_inf) -> None:
        device, steps = bucket.device, bucket.steps
        found_inf = self._device_scalar(found_inf, device)
        torch._foreach_add_(steps, 1.0)
        _torch_step.step(
            bucket.params,
            grads,
            bucket.states,
            bucket.lay,
            sr_seed=bucket.sr_seed,
            salts=bucket.salts,
            offsets=bucket.offsets,
            found_inf=found_inf,
            **self._torch_hyper(group, device, clip_coef, grad_scale),
        )
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))

    def _torch_hyper(self, group, device, clip_coef, grad_scale) -> dict[str, Any]:
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(device=device, dtype=torch.float32).reshape(())
        beta1, beta2 = group["betas"]
        return dict(
            amsgrad=group["amsgrad"],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            grad_scale=self._torch_grad_scale(clip_coef, grad_scale, device),
        )

    def _torch_step_blocks(self, group, p, salt, lay, blocks) -> None:
        """``_torch_step`` of ``p`` alone (no clip, no scaler), its gradient handed in consecutive flat blocks
        ``(start, stop, gradient of elements start:stop)`` that need not exist together (``step_in_backward``'s
        block-wise step). The step counter moves once; each block is stepped as ``_torch_step.step``'s staged
        pieces of the whole would be (the caller, ``in_backward._in_blocks``, keeps the blocks on the pieces
        and the layout staged), so the update is the whole gradient's, bit for bit."""
        device = local(p).device
        bucket = self._bucket(
            group, [(p, salt, lay, False)], {id(p): 0}, False, device, local(p).dtype, None, lay
        )
        hyper = self._torch_hyper(group, device, None, None)
        torch._foreach_add_(bucket.steps, 1.0)
        flat, state = bucket.params[0].view(-1), bucket.states[0]
        for start, stop, grad in blocks:
            part = lay.state_slice(state, start, stop)
            assert part is not None, "in_backward._in_blocks checked that the state slices"
            _torch_step.step(
                [flat[start:stop]], [grad], [part], lay, sr_seed=bucket.sr_seed, salts=bucket.salts,
                offsets=[bucket.offsets[0] + start], found_inf=None, **hyper,
            )  # fmt: skip


__all__ = ["FusedAdamW"]
