"""Worker of tests/test_optim_fsdp_8bit.py: FusedAdamW's states on FSDP2 (fully_shard, gloo, CPU) shards.

One process of a launch of ``world`` processes; ``jobs`` (JSON) says what it does, in order:

- ``update``: 8-bit moments on the shards of a ``mesh`` ("full": 1-D mesh; "hybrid": 2 x world/2, replicated
  over the first dimension; "offload": full with FSDP2's CPU offload policy) against the unsharded FusedAdamW
  on plain tensors given the same gradients (each rank's shard of one full gradient, so that both optimizers
  see the same numbers: no reduce-scatter in between) and the float64 truth (torch's AdamW). Parameters
  (SHAPES): rows of 512 (a multiple of 256: the sharded step must equal the unsharded 8-bit step bit for bit,
  codes and absmax too), rows of 300 and a 3-D one (row blocks end in a partial block: within the single-process
  tests' 8-bit bound around the truth, tests/test_optim.py), row counts that do not divide among the ranks (7
  and 5 rows; 6 rows on 4 ranks leave one rank without rows), a 1-D parameter above min_8bit_size (fp32 moments
  on shards) and a small one (fp32 moments everywhere): those two within the fp32 bound of tests/test_optim.py
  (torch's CPU kernel rounds a shard's scalar tail apart from its vector body: other shard sizes, other last
  bits). A Shard(1) parameter is refused.
- ``save``: ``STEPS_BEFORE`` steps on a ``mesh``, for each state_dtype (None, float32, 8bit); model and optimizer
  saved with torch.distributed.checkpoint as FSDP2 sharded checkpoints are (``get_optimizer_state_dict``), and
  the gathered state (every tensor's ``full_tensor()``) saved beside it by rank 0.
- ``cross_modes``: each checkpoint of ``dir`` loaded with another state_dtype: full precision into full precision
  (cast), 8-bit to or from full precision refused by torch.distributed.checkpoint (it reads the keys the loading
  optimizer holds).
- ``one_process``: rank 0 loads each gathered state of ``dir`` (what ``get_optimizer_state_dict`` gathers: 8-bit
  row blocks, fp32 moments of the 1-D parameter) into an unsharded FusedAdamW of every state_dtype: the same
  layout as it is, another one converted; the steps after it track the uninterrupted unsharded run.
- ``load``: each checkpoint of ``dir`` loaded on this launch's ``mesh`` (another world size or mesh:
  ``set_optimizer_state_dict``). The loaded state, gathered, must be the saved one value for value, each state
  tensor sharded like its parameter (a state saved per rank, not resharded, fails here); then ``STEPS_AFTER``
  steps, compared with the uninterrupted unsharded run of that state_dtype and the truth as ``update`` compares
  (fp32 moments: ``assert_truth`` with tests/test_optim.py's k=2, one ulp).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from _gloo_ranks import run_jobs, shard_like
from _truth_ops import assert_truth, distance, magnitude

SHAPES = {"even": (6, 512), "odd": (7, 300), "cube": (5, 3, 100), "flat": (1500,), "small": (3, 4)}
MIN_8BIT = 1024  # every shape but "small" is at least this large
ROW_BLOCKS_EXACT = ("even",)  # rows a multiple of 256: the unsharded flat blocks
FP32_ON_SHARDS = ("flat", "small")  # 1-D (rows of one element) and below MIN_8BIT
LR, WEIGHT_DECAY = 1e-2, 0.1
STEPS = 8  # update
STEPS_BEFORE, STEPS_AFTER = 3, 3  # save / load
STATE_DTYPES = (None, "float32", "8bit")


class Params(torch.nn.Module):
    def __init__(self, dtype=torch.float32):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=g).to(dtype)))


def gradients(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    scale = 1.0 + 0.5 * (step % 3)
    out = {}
    for name, shape in SHAPES.items():
        x = torch.randn(shape, generator=g) * scale
        # a few large entries: blocks whose absmax dwarfs the rest (what quantization is tested on)
        x.view(-1)[::97] *= 50.0
        out[name] = x
    return out


def mesh_of(kind: str, world: int):
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "hybrid":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh("cpu", (world,))


def sharded_model(kind: str, world: int) -> Params:
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    model = Params()
    offload = CPUOffloadPolicy(pin_memory=False) if kind == "offload" else OffloadPolicy()
    fully_shard(model, mesh=mesh_of(kind, world), offload_policy=offload)
    assert all(type(p).__name__ == "DTensor" for p in model.parameters())
    return model


def optimizer(model: torch.nn.Module, state_dtype, backend: str = "torch"):
    from fasttrain import FusedAdamW

    return FusedAdamW(
        model.parameters(),
        lr=LR,
        weight_decay=WEIGHT_DECAY,
        state_dtype=state_dtype,
        min_8bit_size=MIN_8BIT,
        backend=backend,
    )


def run_steps(model, opt, first: int, last: int) -> None:
    for step in range(first, last):
        grads = gradients(step)
        for name, p in model.named_parameters():
            p.grad = shard_like(grads[name].to(p.dtype), p)  # each rank's shard of the same full gradient
        opt.step()
        opt.zero_grad()


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def unsharded(state_dtype, steps: int, backend: str = "torch"):
    """(parameters, optimizer) of the unsharded run: plain tensors, the same start and gradients."""
    model = Params()
    opt = optimizer(model, state_dtype, backend)
    run_steps(model, opt, 0, steps)
    return model, opt


def truth(steps: int) -> dict[str, torch.Tensor]:
    model = Params(torch.float64)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    run_steps(model, opt, 0, steps)
    return dict(model.named_parameters())


def _half_gap(dynamic_map) -> float:
    """Half the largest relative gap between neighbouring entries of a dynamic map in its top decade."""
    entries = dynamic_map.double().abs().unique()
    top = entries[entries >= 0.1]
    return float(((top[1:] - top[:-1]) / top[1:]).max()) / 2


def check_8bit(
    what: str, params: dict[str, torch.Tensor], steps: int, refs: dict, exact: bool = True
) -> None:
    """The 8-bit run's parameters against the unsharded runs (``refs``: state_dtype -> (model, opt)): rows of 256
    and the fp32 moments of shards as they step (``exact``), every parameter within the 8-bit bound of the truth."""
    from fasttrain.optim import blockwise8

    ref8 = dict(refs["8bit"][0].named_parameters())
    ref32 = dict(refs["float32"][0].named_parameters())
    start = dict(Params().named_parameters())
    t = truth(steps)
    tables = blockwise8.tables(torch.device("cpu"))
    # tests/test_optim.py's bound: 8-bit moments cost at most this share of the update over fp32 moments
    share = _half_gap(tables[blockwise8.SIGNED]) + _half_gap(tables[blockwise8.UNSIGNED])
    for name, p in params.items():
        if exact and name in ROW_BLOCKS_EXACT:
            assert torch.equal(p, ref8[name]), f"{what}: {name} differs from the unsharded 8-bit step"
        elif exact and name in FP32_ON_SHARDS:
            # the fp32-moment step on other shard sizes (vector body / tail rounding)
            assert_truth(p, ref32[name], t[name], k=2.0, ulps=1.0, what=f"{what}: {name}")
        else:
            update = distance(t[name], start[name])
            allowed = 2.0 * distance(ref32[name], t[name]) + share * update + 2**-23 * magnitude(t[name])
            for label, x in (("sharded", p), ("unsharded", ref8[name])):
                d = distance(x, t[name])
                assert d <= allowed, f"{what}: {label} 8-bit {name}: {d} from the truth > {allowed}"
            if exact:
                assert not torch.equal(p, ref32[name]), f"{what}: {name} was not quantized"


def check_8bit_states(what: str, model, opt, ref_opt) -> None:
    from torch.distributed.tensor import DTensor

    from fasttrain.optim import blockwise8

    ref_params = dict(
        zip([n for n, _ in model.named_parameters()], ref_opt.param_groups[0]["params"], strict=True)
    )
    for name, p in model.named_parameters():
        state, ref = opt.state[p], ref_opt.state[ref_params[name]]
        if name in FP32_ON_SHARDS:
            assert isinstance(state["exp_avg"], DTensor) and state["exp_avg"].dtype == torch.float32, name
            continue
        rows, cols = blockwise8.row_shape(p.shape)
        for key in ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax"):
            x = state[key]
            assert isinstance(x, DTensor) and x.placements == p.placements, (what, name, key)
            shape = tuple(p.shape) if key.endswith("codes") else (rows, -(-cols // 256))
            assert tuple(x.shape) == shape and x.to_local().shape[0] == p.to_local().shape[0], (
                what,
                name,
                key,
            )
            if name in ROW_BLOCKS_EXACT:  # the unsharded flat blocks, value for value
                assert torch.equal(x.full_tensor().reshape(-1), ref[key].reshape(-1)), (what, name, key)


def job_update(job: dict, world: int) -> None:
    from torch.distributed.tensor import Shard, distribute_tensor

    for backend in job["backends"]:
        what = f"update {job['mesh']} {backend}"
        model = sharded_model(job["mesh"], world)
        opt = optimizer(model, "8bit", backend)
        run_steps(model, opt, 0, STEPS)
        ref = {sd: unsharded(sd, STEPS, backend) for sd in ("8bit", "float32")}
        check_8bit(what, {n: p.full_tensor() for n, p in model.named_parameters()}, STEPS, ref)
        check_8bit_states(what, model, opt, ref["8bit"][1])
    # blocks follow rows of dim 0: another sharding is refused, naming the parameter
    mesh = mesh_of("full", world)
    p = torch.nn.Parameter(distribute_tensor(torch.randn(4, 256 * world), mesh, [Shard(1)]))
    p.grad = torch.zeros_like(p)
    try:
        optimizer(torch.nn.ParameterList([p]), "8bit").step()
    except ValueError as err:
        assert "param group 0, parameter 0" in str(err) and "Shard(dim=1)" in str(err), err
    else:
        raise AssertionError("a Shard(1) parameter with 8-bit states was not refused")


def _state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def full_state(model, opt) -> dict[str, dict[str, torch.Tensor]]:
    """Every state tensor of every parameter, gathered (a collective: every rank calls it)."""
    return {name: {key: full(v) for key, v in opt.state[p].items()} for name, p in model.named_parameters()}


def job_save(job: dict, world: int) -> None:
    import torch.distributed.checkpoint as dcp

    for sd in STATE_DTYPES:
        model = sharded_model(job["mesh"], world)
        opt = optimizer(model, sd)
        run_steps(model, opt, 0, STEPS_BEFORE)
        dcp.save(_state(model, opt), checkpoint_id=Path(job["dir"], str(sd)))
        gathered = full_state(model, opt)  # what the load job must find again, whatever its shards
        params = {name: p.full_tensor() for name, p in model.named_parameters()}
        if dist.get_rank() == 0:
            torch.save(gathered, Path(job["dir"], f"{sd}-gathered.pt"))
            torch.save(params, Path(job["dir"], f"{sd}-params.pt"))


def job_load(job: dict, world: int) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    total = STEPS_BEFORE + STEPS_AFTER
    refs = {sd: unsharded(sd, total) for sd in STATE_DTYPES}
    t = truth(total)
    for sd in STATE_DTYPES:
        what = f"{job['dir']} ({sd}) loaded on {world} processes, {job['mesh']}"
        model = sharded_model(job["mesh"], world)
        opt = optimizer(model, sd)
        state = _state(model, opt)
        dcp.load(state, checkpoint_id=Path(job["dir"], str(sd)))
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, opt, state["optim"])
        # the state as saved, value for value, on this launch's shards (each rank's rows of every state tensor)
        saved = torch.load(Path(job["dir"], f"{sd}-gathered.pt"))
        loaded = full_state(model, opt)
        for name, p in model.named_parameters():
            assert sorted(loaded[name]) == sorted(saved[name]), (what, name, sorted(loaded[name]))
            for key, value in loaded[name].items():
                assert value.dtype == saved[name][key].dtype and torch.equal(value, saved[name][key]), (
                    f"{what}: {name} {key} is not the saved state"
                )
                x = opt.state[p][key]
                if key != "step":  # sharded like the parameter: the rows this rank owns now
                    assert x.placements == p.placements and x.to_local().shape[0] == p.to_local().shape[0], (
                        what,
                        name,
                        key,
                    )
        run_steps(model, opt, STEPS_BEFORE, total)
        # the next steps: as the uninterrupted unsharded run, within the bound of the state type
        params = {n: p.full_tensor() for n, p in model.named_parameters()}
        if sd == "8bit":
            check_8bit(what, params, total, refs)
        else:
            for name, p in refs[sd][0].named_parameters():
                assert_truth(params[name], p, t[name], k=2.0, ulps=1.0, what=f"{what}: {name}")


def job_cross_modes(job: dict, world: int) -> None:
    """Each checkpoint of ``dir`` loaded with every other state_dtype: full-precision moments (None, float32) load
    into one another, cast to the loading optimizer's dtype; 8-bit moments and full-precision ones do not convert,
    and torch.distributed.checkpoint refuses the load, naming the key the checkpoint lacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for saved_sd in STATE_DTYPES:
        saved = torch.load(Path(job["dir"], f"{saved_sd}-gathered.pt"))
        for sd in STATE_DTYPES:
            if sd == saved_sd:
                continue
            what = f"{job['dir']} ({saved_sd}) loaded with state_dtype={sd} on {world} processes"
            model = sharded_model(job["mesh"], world)
            opt = optimizer(model, sd)
            state = _state(model, opt)
            if "8bit" in (sd, saved_sd):
                # this optimizer's state dict asks for what the checkpoint does not hold: loading into 8 bits, the
                # recorded state_dtype or the codes and absmax; loading from 8 bits, the full-precision moments
                missing = r"(state_dtype|_codes|_absmax)" if sd == "8bit" else r"\.(exp_avg|exp_avg_sq)"
                try:
                    dcp.load(state, checkpoint_id=Path(job["dir"], str(saved_sd)))
                except CheckpointException as err:  # a BaseException: every rank raises it
                    assert re.search(rf"Missing key in checkpoint state_dict: \S*{missing}\.", str(err)), (
                        what,
                        err,
                    )
                else:
                    raise AssertionError(f"{what}: loaded")
                continue
            dcp.load(state, checkpoint_id=Path(job["dir"], str(saved_sd)))
            set_optimizer_state_dict(model, opt, state["optim"])
            loaded = full_state(model, opt)
            for name in loaded:
                assert sorted(loaded[name]) == sorted(saved[name]), (what, name)
                for key, value in loaded[name].items():
                    assert torch.equal(value, saved[name][key].to(value.dtype)), f"{what}: {name} {key}"


def job_one_process(job: dict, world: int) -> None:
    from fasttrain.optim import blockwise8

    if dist.get_rank() != 0:
        return
    total = STEPS_BEFORE + STEPS_AFTER
    refs = {sd: unsharded(sd, total) for sd in STATE_DTYPES}
    t = truth(total)
    for saved_sd in STATE_DTYPES:
        gathered = torch.load(Path(job["dir"], f"{saved_sd}-gathered.pt"))
        last = torch.load(Path(job["dir"], f"{saved_sd}-params.pt"))
        for sd in STATE_DTYPES:
            what = f"{job['dir']} ({saved_sd}, gathered) loaded with state_dtype={sd} in one process"
            model = Params()
            opt = optimizer(model, sd)
            names = [name for name, _ in model.named_parameters()]
            saved = {"state": {i: gathered[name] for i, name in enumerate(names)}}
            opt.load_state_dict({**saved, "param_groups": opt.state_dict()["param_groups"]})
            for name, p in model.named_parameters():
                state, old = opt.state[p], gathered[name]
                assert float(state["step"]) == STEPS_BEFORE, (what, name)
                eight = sd == "8bit" and p.numel() >= MIN_8BIT
                assert ("exp_avg_codes" in state) == eight, (what, name, sorted(state))
                if not eight:  # full precision: the saved moments cast, or dequantized
                    value = old.get("exp_avg")
                    if value is None:
                        value = blockwise8.dequantize(old["exp_avg_codes"], old["exp_avg_absmax"], True)
                    assert torch.equal(state["exp_avg"], value.to(state["exp_avg"].dtype)), (what, name)
                elif "exp_avg_codes" in old:  # 8-bit as saved: the shards' row blocks, gathered
                    assert torch.equal(state["exp_avg_absmax"], old["exp_avg_absmax"]), (what, name)
            with torch.no_grad():  # the parameters as the sharded run left them, then the steps after it
                for name, p in model.named_parameters():
                    p.copy_(last[name])
            run_steps(model, opt, STEPS_BEFORE, total)
            params = dict(model.named_parameters())
            if "8bit" in (sd, saved_sd):  # moments quantized somewhere along the way: the 8-bit bound
                check_8bit(what, params, total, refs, exact=False)
            else:
                for name, p in refs[sd][0].named_parameters():
                    assert_truth(params[name], p, t[name], k=2.0, ulps=1.0, what=f"{what}: {name}")


if __name__ == "__main__":
    jobs = {"update": job_update, "save": job_save, "load": job_load, "cross_modes": job_cross_modes}
    run_jobs({**jobs, "one_process": job_one_process})
