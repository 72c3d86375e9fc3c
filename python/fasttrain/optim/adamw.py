"""``FusedAdamW``: torch's AdamW math and state layout, one Triton launch per parameter group, clipping fused in.

Contract (docs/DESIGN.md "Public API"): same math and ``state_dict`` layout as ``torch.optim.AdamW``
(``step``, ``exp_avg``, ``exp_avg_sq``; ``max_exp_avg_sq`` with amsgrad), so either optimizer loads the
other's checkpoint. States are fp32 whatever the parameter dtype (torch keeps them in the parameter's
dtype: loading casts in both directions).

Backends: ``"triton"`` runs the multi-tensor kernel of ``fasttrain.kernels.adamw`` (on CPU only
through ``TRITON_INTERPRET=1``); ``"torch"`` runs ``torch._fused_adamw_`` (torch's own fused AdamW);
``"auto"`` picks Triton for CUDA tensors and torch elsewhere (logged once).

Nothing about the parameters is cached at construction: state is created lazily in ``step()`` and
the launch tables are keyed on the tensors' addresses, because FSDP2 swaps parameters for DTensor
shards after the optimizer exists and Accelerate round-trips ``state_dict`` when it prepares it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from itertools import chain
from typing import Any

import torch

from .._logging import log_once
from . import clip as _clip
from ._tensors import group_by, local

BACKENDS = ("auto", "triton", "torch")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def _kernels():
    # imported on first use: `import fasttrain` must not import triton
    from fasttrain.kernels import adamw as kernels

    return kernels


def _state_dtype(param: torch.Tensor) -> torch.dtype:
    return torch.float32 if param.dtype in (torch.float32, *_LOW_PRECISION) else param.dtype


def _check_hyperparameters(lr: Any, betas: Any, eps: Any, weight_decay: Any, where: str) -> None:
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


class FusedAdamW(torch.optim.Optimizer):
    """AdamW (``torch.optim.AdamW`` semantics) with a multi-tensor Triton step and fused gradient clipping.

    Args:
        params: parameters or parameter groups (groups may set their own lr, betas, eps, weight_decay).
        lr: learning rate, a float or a one-element tensor (a scheduler changing it never recompiles).
        betas, eps, weight_decay, amsgrad, maximize: as in ``torch.optim.AdamW``.
        backend: ``"auto"`` (Triton on CUDA, torch's fused AdamW elsewhere), ``"triton"`` or ``"torch"``.
        foreach, fused, capturable, differentiable: accepted for drop-in compatibility with
            ``torch.optim.AdamW``; ``foreach``/``fused`` are ignored (this optimizer is fused),
            ``capturable=True`` and ``differentiable=True`` are refused.

    ``defer_clip_grad_norm_(max_norm)`` computes the global gradient norm and arms the clip coefficient for
    the next ``step()``, which applies it inside the kernel: gradients are not rewritten.

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
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"FusedAdamW: backend must be one of {BACKENDS}, got {backend!r}")
        if capturable:
            raise ValueError("FusedAdamW: capturable=True (CUDA graphs) is not supported")
        if differentiable:
            raise ValueError("FusedAdamW: differentiable=True is not supported")
        del foreach, fused  # always fused; accepted so that torch.optim.AdamW kwargs pass through
        _check_hyperparameters(lr, betas, eps, weight_decay, "FusedAdamW")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "amsgrad": bool(amsgrad),
            "maximize": bool(maximize),
            "backend": backend,
        }
        super().__init__(params, defaults)
        self._clip_coef: torch.Tensor | None = None  # armed by defer_clip_grad_norm_, consumed by step
        self.deferred_clips_applied = 0  # steps that applied a clip armed with a finite max_norm
        self._clip_finite = False  # whether the armed coefficient came from a finite max_norm
        self._tables: dict[Any, Any] = {}  # launch tables keyed on the tensors' addresses

    # -- groups and state ------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        where = f"FusedAdamW param group {len(self.param_groups) - 1}"
        _check_hyperparameters(group["lr"], group["betas"], group["eps"], group["weight_decay"], where)
        if group["backend"] not in BACKENDS:
            raise ValueError(f"{where}: backend must be one of {BACKENDS}, got {group['backend']!r}")

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # groups loaded from a torch.optim.AdamW checkpoint lack our keys
        for group in self.param_groups:
            for key in ("amsgrad", "maximize", "backend"):
                group.setdefault(key, self.defaults[key])
        self.__dict__.setdefault("_clip_coef", None)
        self.__dict__.setdefault("_clip_finite", False)
        self.__dict__.setdefault("deferred_clips_applied", 0)
        self.__dict__.setdefault("_tables", {})

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a FusedAdamW or ``torch.optim.AdamW`` state dict.

        torch's loader casts every state to the parameter's dtype, which would round our fp32 moments
        of bf16 parameters; they are restored from the given state dict in fp32 afterwards, and
        ``step`` is moved next to its parameter as torch's fused AdamW keeps it.
        """
        saved_groups = state_dict["param_groups"]
        saved_state = state_dict["state"]
        super().load_state_dict(state_dict)
        id_map = dict(
            zip(
                chain.from_iterable(g["params"] for g in saved_groups),
                chain.from_iterable(g["params"] for g in self.param_groups),
                strict=True,
            )
        )
        for param_id, param in id_map.items():
            saved = saved_state.get(param_id)
            if not saved:
                continue
            state = self.state[param]
            for key in _STATE_KEYS:
                value = saved.get(key)
                if isinstance(value, torch.Tensor):
                    state[key] = value.to(dtype=_state_dtype(param), device=param.device, copy=True)
            if "step" in saved:
                state["step"] = self._step_tensor(param, float(saved["step"]))
        self._tables.clear()

    @staticmethod
    def _step_tensor(param: torch.Tensor, value: float = 0.0) -> torch.Tensor:
        # fp32 on the parameter's device, as torch's fused AdamW keeps it: the kernel reads it
        return torch.tensor(value, dtype=torch.float32, device=local(param).device)

    def _init_state(self, param: torch.Tensor, amsgrad: bool) -> dict[str, Any]:
        state = self.state[param]
        if len(state) == 0:
            dtype = _state_dtype(param)
            state["step"] = self._step_tensor(param)
            state["exp_avg"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=dtype, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(
                param, dtype=_state_dtype(param), memory_format=torch.preserve_format
            )
        step = state["step"]
        if (
            not isinstance(step, torch.Tensor)
            or step.device != local(param).device
            or step.dtype != torch.float32
        ):
            # a state set by hand or loaded without our load_state_dict
            state["step"] = self._step_tensor(param, float(step))
        return state

    # -- backend choice -----------------------------------------------------------------------------

    def _backend_for(self, group: dict[str, Any], device: torch.device) -> str:
        backend = group["backend"]
        if backend == "auto":
            backend = "triton" if device.type == "cuda" else "torch"
            if backend == "torch":
                log_once(
                    f"fused_adamw.auto.{device.type}",
                    f"FusedAdamW: parameters on {device.type}: using torch's fused AdamW (the Triton kernel "
                    "needs CUDA); gradient clipping is applied with torch ops",
                    logging.INFO,
                )
        if backend == "triton" and device.type != "cuda" and not _kernels().interpreting():
            raise RuntimeError(
                f"FusedAdamW(backend='triton') got parameters on {device.type}: the Triton kernel runs on "
                "CUDA, or on CPU only under TRITON_INTERPRET=1 (set before triton is imported); "
                "use backend='auto' or 'torch'"
            )
        return backend

    def _triton_ok(self, tensors: Iterable[torch.Tensor]) -> bool:
        kernels = _kernels()
        for t in tensors:
            if not (t.is_contiguous() and kernels.supported_dtype(t.dtype)):
                log_once(
                    f"fused_adamw.triton_unsupported.{t.dtype}.{t.is_contiguous()}",
                    f"FusedAdamW: a tensor of dtype {t.dtype} (contiguous={t.is_contiguous()}) is not supported "
                    "by the Triton kernel; its parameter is updated by torch's fused AdamW",
                )
                return False
        return True

    def _table(self, kind: str, rows: list[list[torch.Tensor | None]], device: torch.device):
        key = (kind, device, tuple(0 if t is None else t.data_ptr() for row in rows for t in row))
        key += (tuple(t.numel() for t in rows[0]),)
        table = self._tables.get(key)
        if table is None:
            if len(self._tables) > 64:  # addresses changed (new grads, a reload): drop stale tables
                self._tables.clear()
            table = _kernels().TensorTable(rows, device)
            self._tables[key] = table
        return table

    # -- clipping ----------------------------------------------------------------------------------

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise ValueError("FusedAdamW does not support sparse gradients")
                    grads.append(p.grad)
        return grads

    def _per_tensor_norms(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        device = grads[0].device
        backend = self._backend_for(self.param_groups[0], device)
        if backend == "triton" and norm_type in (2.0, math.inf) and self._triton_ok(grads):
            table = self._table("norm", [grads], device)
            return _kernels().per_tensor_norms(table, grads[0].dtype, norm_type).to(grads[0].dtype)
        return _clip.torch_per_tensor_norms(grads, norm_type)

    @torch.no_grad()
    def defer_clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm of all gradients (as ``torch.nn.utils.clip_grad_norm_`` returns it); the clip itself is
        deferred to the next ``step()``: until then the gradients stay unclipped.

        Computes the norm in one multi-tensor pass (reduced over FSDP2/DTensor shards), and arms the
        coefficient ``min(1, max_norm / (norm + 1e-6))`` as a device scalar that the next ``step()``
        applies inside the kernel: gradients are not rewritten and nothing waits for the device.
        The torch backend applies it the same way, through the ``grad_scale`` argument of torch's fused
        kernel (``grad / (1 / coef)``: equal to torch's ``grad * coef`` to one fp32 rounding), skipping
        it on CPU when the coefficient is exactly 1 (reading a CPU scalar costs nothing).
        A non-finite norm gives what torch's clip + AdamW gives (NaN parameters), unless a GradScaler
        skips the step. Returns a 0-d tensor on the gradients' device, in their dtype (as torch does).
        """
        norm_type = float(norm_type)
        grads = self._grads()
        total = _clip.total_norm(grads, norm_type, self._per_tensor_norms)
        if not grads:
            self._clip_coef = None
            return total
        self._clip_coef = _clip.clip_coefficient(total, max_norm).to(torch.float32)
        self._clip_finite = math.isfinite(float(max_norm))
        return total

    def _uses_triton(self, group: dict[str, Any], p: torch.Tensor) -> bool:
        g = local(p.grad)
        if self._backend_for(group, g.device) != "triton":
            return False
        return self._triton_ok([local(p), g])

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
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise ValueError("FusedAdamW does not support sparse gradients")
                self._init_state(p, group["amsgrad"])
            triton_params = [p for p in params if self._uses_triton(group, p)]
            torch_params = [p for p in params if not self._uses_triton(group, p)] if triton_params else params
            buckets = group_by(
                triton_params, lambda p: (local(p).device, local(p).dtype, local(p.grad).dtype)
            )
            for (device, p_dtype, g_dtype), bucket in buckets.items():
                self._triton_step(group, bucket, device, p_dtype, g_dtype, clip_coef, grad_scale, found_inf)
            for (device, _dtype), bucket in group_by(
                torch_params, lambda p: (local(p).device, local(p).dtype)
            ).items():
                self._torch_step(group, bucket, device, clip_coef, grad_scale, found_inf)
        return loss

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

    def _triton_step(self, group, params, device, p_dtype, g_dtype, clip_coef, grad_scale, found_inf) -> None:
        amsgrad = group["amsgrad"]
        states = [self.state[p] for p in params]
        steps = [s["step"] for s in states]
        rows = [
            [local(p) for p in params],
            [local(p.grad) for p in params],
            [local(s["exp_avg"]) for s in states],
            [local(s["exp_avg_sq"]) for s in states],
            [local(s["max_exp_avg_sq"]) if amsgrad else None for s in states],
            steps,
        ]
        table = self._table("adamw", rows, device)
        found_inf = self._device_scalar(found_inf, device)
        # as torch's fused AdamW: count the step first, take it back if the scaler found an inf
        torch._foreach_add_(steps, 1.0)
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = self._device_scalar(lr, device)
        _kernels().adamw_step(
            table,
            p_dtype,
            g_dtype,
            lr=lr,
            betas=self._betas_tensor(group["betas"], device),
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            clip_coef=self._device_scalar(clip_coef, device),
            grad_scale=self._device_scalar(grad_scale, device),
            found_inf=found_inf,
            amsgrad=amsgrad,
            maximize=group["maximize"],
        )
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

    def _torch_step(self, group, params, device, clip_coef, grad_scale, found_inf) -> None:
        amsgrad = group["amsgrad"]
        states = [self.state[p] for p in params]
        ps = [local(p) for p in params]
        gs = [local(p.grad) for p in params]
        steps = [s["step"] for s in states]
        low_precision = ps[0].dtype in _LOW_PRECISION
        if low_precision:
            # torch's fused kernel wants one dtype for all lists: run it on fp32 copies, write back rounded
            ps_math = [p.float() for p in ps]
            gs = [g.float() for g in gs]
        else:
            ps_math = ps
            gs = [g if g.dtype == ps[0].dtype else g.to(ps[0].dtype) for g in gs]
        lr = group["lr"]
        if isinstance(lr, torch.Tensor):
            lr = lr.to(device=device, dtype=torch.float32).reshape(())
        found_inf = self._device_scalar(found_inf, device)
        torch._foreach_add_(steps, 1.0)
        beta1, beta2 = group["betas"]
        torch._fused_adamw_(
            ps_math,
            gs,
            [local(s["exp_avg"]) for s in states],
            [local(s["exp_avg_sq"]) for s in states],
            [local(s["max_exp_avg_sq"]) for s in states] if amsgrad else [],
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            amsgrad=amsgrad,
            maximize=group["maximize"],
            grad_scale=self._torch_grad_scale(clip_coef, grad_scale, device),
            found_inf=found_inf,
        )
        if low_precision:
            torch._foreach_copy_(ps, ps_math)
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))


__all__ = ["FusedAdamW"]
