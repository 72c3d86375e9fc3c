"""Worker of tests/test_optim_fsdp_sr.py: bf16 stochastic rounding on FSDP2 (fully_shard, gloo, CPU) shards.

Parameters are stored in bf16 (no fp32 master weights): FusedAdamW(bf16_stochastic_rounding=True) rounds every
update stochastically, with random bits drawn at each element's index in the whole parameter. One process of a
launch of ``world`` processes; ``jobs`` (JSON) says what it does, in order, on a ``mesh``: "full" (1-D, every
rank), "hybrid" (2 x world/2, replicated over the first dimension) or "pair" (ranks 0 and 1 only: a 2-way shard
inside a launch of 4, so that one launch saves and loads at both world sizes; the other ranks wait). The
unsharded references are computed and compared on rank 0 (in every mesh).

- ``update``: ``STEPS`` steps on the shards of the ``mesh``, for each backend and state_dtype of the job, against the unsharded FusedAdamW on plain
  bf16 tensors given the same gradients (each rank's shard of one full gradient: no reduce-scatter in between).
  After every step the gathered parameters must equal the unsharded ones bit for bit. Row counts (SHAPES) do not
  divide among the ranks (7 rows on 2 or 4 ranks; 5 on 4 leave one rank without rows), so all but the first
  rank start at an offset that is not a multiple of anything: bits drawn at the local index differ from the
  unsharded optimizer's there. With ``state_dtype="8bit"`` only rows of 256 ("even": the unsharded flat blocks,
  the Triton 8-bit kernel's path) are compared; the other parameters' row blocks quantize otherwise.
  Each rank also checks that ``global_offset`` points at its local elements in the gathered parameter.
- ``stochastic``: one step with zero gradients and weight decay on the shards, so that the exact update is known
  (p * (1 - lr * wd), one fp32 product in both backends): each rounded value must be one of the two bf16
  neighbours of the exact value, differ from nearest rounding on a sizeable share of the elements, and its mean
  error (in units of the bf16 spacing, signed towards the value's magnitude) must be within 5 standard errors
  of zero (each error lies in (-1, 1), so its variance is at most 1/4: the bound is 5 * 0.5 / sqrt(n)); nearest
  rounding would sit near +0.2 here. Equal to the unsharded run bit for bit too.
- ``save``: ``STEPS_BEFORE`` steps on the ``mesh`` with a ``backend``; model and optimizer saved with
  torch.distributed.checkpoint (the mesh's process group).
- ``load``: such a checkpoint loaded on the ``mesh`` (another world size or mesh), then ``STEPS_AFTER`` steps with
  the same backend, each equal bit for bit to the uninterrupted unsharded run.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.distributed as dist

from _gloo_ranks import run_jobs, shard_like

SHAPES = {"odd": (7, 300), "cube": (5, 3, 100), "flat": (1501,), "even": (6, 256)}
EXACT_8BIT = ("even",)  # rows of 256: the sharded row blocks are the unsharded flat blocks
LR, WEIGHT_DECAY, SEED = 1e-2, 0.1, 1234
STEPS = 3  # update
STEPS_BEFORE, STEPS_AFTER = 2, 2  # save / load
CKPT_STATE_DTYPE = torch.float32
STATE_DTYPES = {"none": None, "float32": torch.float32, "8bit": "8bit"}


class Params(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            p = torch.randn(shape, generator=g).to(torch.bfloat16)
            self.register_parameter(name, torch.nn.Parameter(p))


def gradients(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16) for name, shape in SHAPES.items()}


def zero_gradients(step: int) -> dict[str, torch.Tensor]:
    return {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in SHAPES.items()}


def mesh_of(kind: str, world: int):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if kind == "hybrid":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    if kind == "pair":  # every rank builds it (its process group is created collectively)
        return DeviceMesh("cpu", torch.arange(2))
    return init_device_mesh("cpu", (world,))


def sharded_model(kind: str, world: int) -> Params | None:
    """Params sharded on the ``kind`` mesh; None on a rank outside it."""
    from torch.distributed.fsdp import fully_shard

    mesh = mesh_of(kind, world)
    if mesh.get_coordinate() is None:
        return None
    model = Params()
    fully_shard(model, mesh=mesh)
    assert all(type(p).__name__ == "DTensor" and p.dtype == torch.bfloat16 for p in model.parameters())
    return model


def optimizer(model: torch.nn.Module, state_dtype, backend: str):
    from fasttrain import FusedAdamW

    return FusedAdamW(
        model.parameters(),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        state_dtype=state_dtype,
        min_8bit_size=1024,
        backend=backend,
        bf16_stochastic_rounding=True,
        sr_seed=SEED,
    )


def step(model, opt, step: int, grads=gradients) -> None:
    for name, p in model.named_parameters():
        p.grad = shard_like(grads(step)[name], p)  # each rank's shard of the same full gradient
    opt.step()
    opt.zero_grad()


def gathered(model) -> dict[str, torch.Tensor]:
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p.clone()).detach()
        for n, p in model.named_parameters()
    }


_REFS: dict = {}


def unsharded(backend: str, state_dtype, steps: int, grads=gradients) -> list[dict[str, torch.Tensor]]:
    """The unsharded run's parameters after each of ``steps`` steps (plain bf16 tensors, same start and grads)."""
    key = (backend, str(state_dtype), steps, grads.__name__)
    if key not in _REFS:
        model = Params()
        opt = optimizer(model, state_dtype, backend)
        out = []
        for i in range(steps):
            step(model, opt, i, grads)
            out.append(gathered(model))
        _REFS[key] = out
    return _REFS[key]


def assert_equal(what: str, params: dict, ref_of, names=SHAPES) -> None:
    """``params`` equal bit for bit to ``ref_of()`` (the unsharded reference: computed on rank 0 only)."""
    if dist.get_rank() != 0:
        return
    ref = ref_of()
    for name in names:
        p, r = params[name], ref[name]
        assert p.dtype == r.dtype == torch.bfloat16, (what, name, p.dtype, r.dtype)
        differ = int((p.view(torch.int16) != r.view(torch.int16)).sum())
        assert differ == 0, f"{what}: {name}: {differ} of {p.numel()} elements differ from the unsharded run"


def check_offsets(what: str, model) -> None:
    from fasttrain.optim._tensors import global_offset

    for name, p in model.named_parameters():
        local, offset = p.to_local(), global_offset(p)
        assert offset is not None, (what, name, p.placements)
        flat = p.full_tensor().reshape(-1)
        assert torch.equal(local.reshape(-1), flat[offset : offset + local.numel()]), (what, name, offset)


def job_update(job: dict, world: int) -> None:
    for backend in job["backends"]:
        for sd_name in job["state_dtypes"]:
            sd = STATE_DTYPES[sd_name]
            what = f"update {job['mesh']} {backend} state_dtype={sd_name}"
            model = sharded_model(job["mesh"], world)
            if model is None:
                continue
            opt = optimizer(model, sd, backend)
            for i in range(STEPS):
                step(model, opt, i)
                names = EXACT_8BIT if sd == "8bit" else SHAPES
                assert_equal(
                    f"{what}, step {i}",
                    gathered(model),
                    lambda b=backend, sd=sd, i=i: unsharded(b, sd, STEPS)[i],
                    names,
                )
            check_offsets(what, model)


def job_stochastic(job: dict, world: int) -> None:
    for backend in job["backends"]:
        what = f"stochastic {job['mesh']} {backend}"
        model = sharded_model(job["mesh"], world)
        if model is None:
            continue
        start = gathered(model)
        opt = optimizer(model, torch.float32, backend)
        step(model, opt, 0, zero_gradients)
        out = gathered(model)
        assert_equal(what, out, lambda b=backend: unsharded(b, torch.float32, 1, zero_gradients)[0])
        decay = torch.tensor(1.0 - LR * WEIGHT_DECAY, dtype=torch.float64).float()
        errors, moved = [], 0
        for name in SHAPES:
            x = start[name].float() * decay  # the exact fp32 update with zero gradients
            r, x64 = out[name].double(), x.double()
            nonzero = x64 != 0
            x64, r, x = x64[nonzero], r[nonzero], x[nonzero]
            spacing = torch.ldexp(torch.ones_like(x64), torch.frexp(x64)[1] - 8)  # bf16's spacing at |x|
            lo = torch.floor(x64 / spacing) * spacing
            assert ((r == lo) | (r == lo + spacing)).all(), f"{what}: {name} not rounded to a bf16 neighbour"
            moved += int((r != x.to(torch.bfloat16).double()).sum())
            errors.append((r - x64) / spacing * torch.sign(x64))
        e = torch.cat(errors)
        bound = 5 * 0.5 / math.sqrt(e.numel())
        assert abs(float(e.mean())) < bound, f"{what}: mean error {float(e.mean())} ulp, bound {bound}"
        # p * 0.999 is 0.13 to 0.26 bf16 spacings from p: stochastic rounding leaves p (nearest's choice) for the
        # other neighbour with that probability
        assert moved > 0.1 * e.numel(), f"{what}: {moved} of {e.numel()} differ from nearest rounding"


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def job_save(job: dict, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    model = sharded_model(job["mesh"], world)
    if model is None:
        return
    opt = optimizer(model, CKPT_STATE_DTYPE, job["backend"])
    for i in range(STEPS_BEFORE):
        step(model, opt, i)
    group = next(model.parameters()).device_mesh.get_group(0) if job["mesh"] == "pair" else None
    dcp.save(_state(model, opt), checkpoint_id=Path(job["dir"]), process_group=group)


def job_load(job: dict, world: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    what = f"{job['dir']} loaded on the {job['mesh']} mesh, {job['backend']}"
    model = sharded_model(job["mesh"], world)
    if model is None:
        return
    opt = optimizer(model, CKPT_STATE_DTYPE, job["backend"])
    state = _state(model, opt)
    group = next(model.parameters()).device_mesh.get_group(0) if job["mesh"] == "pair" else None
    dcp.load(state, checkpoint_id=Path(job["dir"]), process_group=group)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])

    def ref(i: int):
        return lambda: unsharded(job["backend"], CKPT_STATE_DTYPE, STEPS_BEFORE + STEPS_AFTER)[i]

    assert_equal(f"{what}, as loaded", gathered(model), ref(STEPS_BEFORE - 1))
    for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        step(model, opt, i)
        assert_equal(f"{what}, step {i}", gathered(model), ref(i))


JOBS = {"update": job_update, "stochastic": job_stochastic, "save": job_save, "load": job_load}


if __name__ == "__main__":
    run_jobs(JOBS)
