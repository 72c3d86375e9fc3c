"""The global gradient norm in one pass, with the value ``torch.nn.utils.clip_grad_norm_`` returns.

torch computes one norm per gradient (``_foreach_norm``, in the gradient's dtype), stacks them and
takes the norm of that vector; the clip coefficient is ``clamp(max_norm / (total + 1e-6), max=1)``.
We compute the per-tensor norms in one multi-tensor Triton pass (or ``_foreach_norm`` on the torch
backend), round them to the gradient dtype exactly as torch does, and combine them with the same torch
ops, so the returned norm and the coefficient match torch's to fp32 rounding.

DTensor gradients (FSDP2) are reduced on their mesh: the local shards' sums of squares (or max) are
all-reduced over the mesh dimensions that shard them, as ``clip_grad_norm_`` on DTensors does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ._tensors import group_by, is_dtensor, local

# (local gradients of one device and dtype, norm_type) -> 1-D tensor of their norms, in that dtype
PerTensorNorms = Callable[[list[torch.Tensor], float], torch.Tensor]


def torch_per_tensor_norms(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The per-tensor norms as torch's ``clip_grad_norm_`` computes them."""
    if norm_type == float("inf") and any(g.numel() == 0 for g in grads):
        # _foreach_norm refuses the inf-norm of an empty tensor; its norm is 0 for our purpose
        return torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in grads])
    return torch.stack(torch._foreach_norm(grads, norm_type))


def _mesh_reduce(value: torch.Tensor, grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """All-reduce a local partial (sum of |x|^p, or max) over the mesh dims that shard ``grad``."""
    mesh = grad.device_mesh
    op = dist.ReduceOp.MAX if norm_type == float("inf") else dist.ReduceOp.SUM
    for dim, placement in enumerate(grad.placements):
        if placement.is_shard() or placement.is_partial():
            dist.all_reduce(value, op=op, group=mesh.get_group(dim))
    return value


def _dtensor_group_norm(
    grads: list[torch.Tensor], norm_type: float, per_tensor_norms: PerTensorNorms
) -> torch.Tensor:
    """The norm of DTensor gradients sharing one mesh and placements, reduced across their shards (fp32)."""
    partials = []
    for (_device, _dtype), bucket in group_by(grads, lambda g: (local(g).device, local(g).dtype)).items():
        norms = per_tensor_norms([local(g) for g in bucket], norm_type).float()
        partials.append(norms.to(local(grads[0]).device))
    norms = torch.cat(partials)
    if norm_type == float("inf"):
        value = norms.max() if norms.numel() else norms.new_zeros(())
    else:
        value = norms.pow(norm_type).sum()
    value = _mesh_reduce(value.reshape(1).contiguous(), grads[0], norm_type).reshape(())
    return value if norm_type == float("inf") else value.pow(1.0 / norm_type)


def total_norm(grads: list[torch.Tensor], norm_type: float, per_tensor_norms: PerTensorNorms) -> torch.Tensor:
    """The norm of all ``grads`` viewed as one vector, as ``torch.nn.utils.get_total_norm`` returns it.

    ``per_tensor_norms`` computes the norms of one (device, dtype) bucket of local gradients.
    """
    if not grads:
        return torch.tensor(0.0)
    first_device = local(grads[0]).device
    norms: list[torch.Tensor] = []
    plain = [g for g in grads if not is_dtensor(g)]
    for (_device, _dtype), bucket in group_by(plain, lambda g: (g.device, g.dtype)).items():
        norms.append(per_tensor_norms(bucket, norm_type).to(first_device))
    sharded = [g for g in grads if is_dtensor(g)]
    for _key, bucket in group_by(sharded, lambda g: (g.device_mesh, tuple(g.placements))).items():
        group_norm = _dtensor_group_norm(bucket, norm_type, per_tensor_norms)
        # torch's norm of DTensors keeps their dtype: round like it
        norms.append(group_norm.to(local(bucket[0]).dtype).reshape(1).to(first_device))
    return combine(norms, norm_type)


def combine(norms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total norm from the buckets' per-tensor norms (on one device), as torch combines them."""
    return torch.linalg.vector_norm(torch.cat(norms), norm_type)


def clip_coefficient(total: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (total + 1e-6))`` with torch's ops and dtype, on the device (no host sync).

    A non-finite total gives 0 (inf) or NaN: multiplying gradients by it does what torch's clipping does.
    """
    return torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
