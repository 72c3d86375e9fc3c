"""FSDP2 training through ``transformers.Trainer`` on CPU (gloo), for tests/test_fsdp_trainer.py.

usage: torchrun --nproc_per_node 2 tests/_fsdp_trainer_worker.py OUT --runs truth,reference,fasttrain
       [--epochs N] [--rows N]

Why a harness: FSDP through the Trainer does not start on a machine without an accelerator. Without
``use_cpu`` Accelerate's ``PartialState._prepare_backend`` (accelerate/state.py, the ``LOCAL_RANK != -1 and not
cpu`` branch) finds no device backend and records ``DistributedType.NO``, so ``TrainingArguments.parallel_mode`` is
not DISTRIBUTED and ``Trainer.__init__`` raises "Using fsdp only works in distributed training."
(transformers/trainer.py, the ``if args.fsdp:`` check). With ``use_cpu=True`` the state is ``MULTI_CPU`` on gloo,
but ``AcceleratorState.__init__`` only turns a distributed type into ``FSDP`` (and keeps the ``fsdp_plugin``) for
the device types (MULTI_GPU, MULTI_XPU, ...; accelerate/state.py, the ``elif self.distributed_type in [...]``
branch): the FSDP plugin is dropped and the Trainer silently runs DDP.

The harness therefore starts Accelerate's process state on gloo/CPU itself (``PartialState(cpu=True)``, a true
MULTI_CPU state with the right ranks) and then relabels it ``MULTI_GPU`` before the Trainer builds its
Accelerator (``accelerator_config={"use_configured_state": True}``): Accelerate's own FSDP branch then keeps the
plugin, and the Trainer's real path runs — ``Trainer`` -> ``Accelerator.prepare`` -> ``fsdp2_prepare_model`` ->
``fully_shard`` on a CPU device mesh, DTensor parameters, the Trainer's FSDP2 clip, optimizer and checkpointing.
The device stays the CPU (the state's device was fixed when it started).

Runs, one after the other in the same processes (one launch):

- ``truth``: plain transformers in float64; ``reference``: plain transformers in float32;
- ``fasttrain``: the same float32 script under ``fasttrain.patch()``;
- ``fasttrain-8bit-save`` / ``fasttrain-8bit-resume``: ``fasttrain-save`` / ``-resume`` with
  ``optim_args="state_dtype=8bit"`` (8-bit moments on the DTensor shards, in the sharded checkpoint);
- ``fasttrain-offload`` / ``reference-offload``: FSDP2's CPU offload policy (``fsdp_config={"cpu_offload": True}``);
- ``truth-tied``, ``reference-tied``, ``fasttrain-tied``: the first three with lm_head tied to the embedding;
- ``fasttrain-save`` / ``fasttrain-resume``: sharded checkpoints (SHARDED_STATE_DICT) at step SAVE_STEP, then
  resumed from it.
- ``reshard-<layout>-<state>`` and ``reshard-<layout>-<state>-from-<source>``: a sharded checkpoint resumed at
  another world size, mesh or offload policy. The layouts are ``full2`` (full shard, 2 processes), ``full4`` (4),
  ``hybrid4`` (a 2 x 2 mesh, 4 processes) and ``offload2`` (full shard with CPU offload, 2 processes); the states
  FusedAdamW's ``state_dtype``s (``param``: None, ``float32``, ``8bit``). ``reshard-<layout>-<state>`` trains
  RESHARD_STEPS steps uninterrupted and saves at RESHARD_SAVE_STEP; ``...-from-<source>`` resumes at <layout> from
  ``reshard-<source>-<state>``'s checkpoint (in the same OUT, written by an earlier run: an earlier launch for
  another world size; <source> may be <layout> itself). All keep the global batch: 8 rows
  per micro-step over the ranks (2 x 4 or 4 x 2), 2 accumulation steps, random order (no length grouping), so
  every layout trains on the same examples at each optimizer step.
- ``reshard-<layout>-torch``: the reference (no fasttrain: torch's AdamW and the Trainer's clip) on the reshard
  schedule, saving at RESHARD_SAVE_STEP; ``reshard-full2-truth``: the same in float64 (not saving).
  ``reshard-<layout>-param-from-<source>-torch`` resumes a reference checkpoint under fasttrain (FusedAdamW with
  its default state, the type torch's AdamW keeps), ``reshard-<layout>-torch-from-<source>-param`` a fasttrain
  checkpoint in the reference: checkpoints crossing between implementations.

Each writes OUT/<run>-rank<R>.json: the logged loss and grad_norm per step, the rows each rank trained on per
epoch, the hot-path status, and detectors (FSDP2 unshards of the lm_head's group per forward, lm_head calls, the
optimizer's class, state and parameter types, the placements of its DTensor states, how many FSDP2 parameters
fully_shard offloads to the CPU). A run that raises writes its error instead.
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

import _engine_worker as engine  # beside this file
import _tiny as tiny  # beside this file: a script's own directory is on sys.path
import fasttrain

SAVE_STEP = 4  # the -save runs checkpoint here; the -resume runs resume from it
# the reshard- runs: RESHARD_STEPS optimizer steps, a checkpoint at RESHARD_SAVE_STEP; the loss of step
# RESHARD_SAVE_STEP + 2 is the first to depend on the loaded optimizer state (step + 1's is the loaded weights')
RESHARD_STEPS = 4
RESHARD_SAVE_STEP = 2
RESHARD_GLOBAL_BATCH = 8  # rows per micro-step over all ranks
RESHARD_ACCUMULATION = 2
RESHARD_ROWS = RESHARD_STEPS * RESHARD_GLOBAL_BATCH * RESHARD_ACCUMULATION  # one epoch
# layout -> (processes, hybrid, CPU offload)
LAYOUTS = {
    "full2": (2, False, False),
    "full4": (4, False, False),
    "hybrid4": (4, True, False),
    "offload2": (2, False, True),
}
STATE_DTYPES = ("param", "float32", "8bit")  # FusedAdamW's state_dtype: None, "float32", "8bit"
# the reference's optimizer (torch's AdamW, no fasttrain), in the reshard- runs' names where a state_dtype stands
TORCH = "torch"


def _run(
    patched=True,
    dtype=torch.float32,
    optim_args=None,
    save=False,
    resume=False,
    offload=False,
    hybrid=False,
    tied=False,
    world=None,
    source=None,
):
    return dict(
        patched=patched,
        dtype=dtype,
        optim_args=optim_args,
        save=save,
        resume=resume,
        offload=offload,
        hybrid=hybrid,
        tied=tied,
        world=world,  # the reshard- runs: the world size their layout needs
        source=source,  # the reshard- resumes: the run whose checkpoint they resume from
    )


def reshard_run(layout: str, state: str, source: str | None = None) -> str:
    return f"reshard-{layout}-{state}" + (f"-from-{source}" if source else "")


RUNS = {
    "truth": _run(patched=False, dtype=torch.float64),
    "reference": _run(patched=False),
    "fasttrain": _run(),
    "fasttrain-8bit-save": _run(optim_args="state_dtype=8bit", save=True),
    "fasttrain-8bit-resume": _run(optim_args="state_dtype=8bit", resume=True),  # after fasttrain-8bit-save
    "reference-offload": _run(patched=False, offload=True),
    "fasttrain-offload": _run(offload=True),
    "fasttrain-save": _run(save=True),
    "fasttrain-resume": _run(resume=True),  # after fasttrain-save, in the same launch
    # lm_head tied to the input embedding: Accelerate puts the embedding, final norm and lm_head in one unit
    "truth-tied": _run(patched=False, dtype=torch.float64, tied=True),
    "reference-tied": _run(patched=False, tied=True),
    "fasttrain-tied": _run(tied=True),
    # hybrid sharding (HSDP): a 2-D mesh, replicated over pairs of ranks, sharded within each (4 processes)
    "truth-hybrid": _run(patched=False, dtype=torch.float64, hybrid=True),
    "reference-hybrid": _run(patched=False, hybrid=True),
    "fasttrain-hybrid": _run(hybrid=True),
}
for _layout, (_world, _hybrid, _offload) in LAYOUTS.items():
    for _state in STATE_DTYPES:
        _common = dict(optim_args=f"state_dtype={_state}", hybrid=_hybrid, offload=_offload, world=_world)
        RUNS[reshard_run(_layout, _state)] = _run(save=True, **_common)
        for _source in LAYOUTS:
            RUNS[reshard_run(_layout, _state, _source)] = _run(
                resume=True, source=reshard_run(_source, _state), **_common
            )
    # the reference on the same schedule, and checkpoints crossing between it and fasttrain's default state (both
    # keep step, exp_avg and exp_avg_sq in the parameter's dtype)
    _common = dict(hybrid=_hybrid, offload=_offload, world=_world)
    RUNS[reshard_run(_layout, TORCH)] = _run(patched=False, save=True, **_common)
    for _source in LAYOUTS:
        for _state, _other in (("param", TORCH), (TORCH, "param")):
            RUNS[reshard_run(_layout, _state, f"{_source}-{_other}")] = _run(
                patched=_state != TORCH,  # fasttrain with no optim_args: its default state
                resume=True,
                source=reshard_run(_source, _other),
                **_common,
            )
RUNS["reshard-full2-truth"] = _run(patched=False, dtype=torch.float64, world=2)


def _cpu_offload_without_pinning() -> None:
    """FSDP2's ``CPUOffloadPolicy()`` (what ``fsdp_config={"cpu_offload": True}`` becomes in Accelerate's
    ``FullyShardedDataParallelPlugin.set_cpu_offload``) pins the offloaded shards, and pinning needs a GPU driver
    (``pin_memory()`` in torch's ``FSDPParam._init_sharded_param``). On CPU the same policy without pinning runs
    the offload code path: shards and gradients kept on the CPU, the optimizer stepping the offloaded shards."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    original = FullyShardedDataParallelPlugin.set_cpu_offload

    def set_cpu_offload(plugin):
        if plugin.fsdp_version == 2 and plugin.cpu_offload is True:
            plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
        return original(plugin)

    FullyShardedDataParallelPlugin.set_cpu_offload = set_cpu_offload


def fsdp_process_state() -> PartialState:
    """Accelerate's process state on gloo/CPU, labelled so that Accelerate keeps an FSDP plugin (see above)."""
    state = PartialState(cpu=True, backend="gloo")
    assert (
        state.distributed_type == DistributedType.MULTI_CPU and state.num_processes == dist.get_world_size()
    )
    # AcceleratorState copies PartialState's shared dict: its FSDP branch runs for device types only
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    return state


class UnshardCounter:
    """Counts FSDP2 unshards (all-gathers) of the parameter group that holds lm_head.weight, per forward."""

    def __init__(self) -> None:
        self.unshards = 0
        self.forwards = 0
        self.by_group: dict[str, int] = {}
        self._original = None

    def install(self, model: torch.nn.Module, weight_name: str) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        counter = self
        original = FSDPParamGroup.unshard
        self._original = original

        def unshard(group, *args, **kwargs):
            if group.is_sharded:
                key = ",".join(
                    n for n in _fqns(group) if n.endswith(("norm.weight", "head.weight", "tokens.weight"))
                )
                counter.by_group[key] = counter.by_group.get(key, 0) + 1
            if group.is_sharded and weight_name in _fqns(group):
                counter.unshards += 1
            return original(group, *args, **kwargs)

        FSDPParamGroup.unshard = unshard
        model.register_forward_pre_hook(lambda *_: setattr(counter, "forwards", counter.forwards + 1))

    def uninstall(self) -> None:
        if self._original is not None:
            from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

            FSDPParamGroup.unshard = self._original


def _fqns(group) -> list[str]:
    return [p._param_fqn or "" for p in group.fsdp_params]


def _fsdp_params(model: torch.nn.Module) -> list:
    """The FSDP2 parameters (``FSDPParam``) of every ``fully_shard`` unit of the model."""
    from torch.distributed.fsdp import FSDPModule

    params = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            params += group.fsdp_params if group is not None else []
    return params


def _mesh(params) -> dict:
    """The device mesh the parameters are sharded on: its dimension names and sizes, and their placements."""
    p = next((p for p in params if hasattr(p, "device_mesh")), None)
    if p is None:
        return {}
    mesh = p.device_mesh
    return {
        "names": list(mesh.mesh_dim_names or ()),
        "shape": list(mesh.shape),
        "placements": [str(pl) for pl in p.placements],
        "device_type": mesh.device_type,
    }


def train_once(run: str, a: argparse.Namespace) -> dict:
    spec = RUNS[run]
    patched, dtype = spec["patched"], spec["dtype"]
    world = dist.get_world_size()
    if spec["world"] is not None and spec["world"] != world:
        raise ValueError(f"{run} needs {spec['world']} processes, this launch has {world}")
    reshard = run.startswith("reshard-")
    fasttrain.unpatch()
    if patched:
        fasttrain.patch()
    AcceleratorState._reset_state(reset_partial_state=False)  # each run gets its own FSDP plugin
    # the previous run's AcceleratorState wrote FSDP into the process state it shares: label it again
    PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
    model = tiny.model("qwen3")
    if spec["tied"]:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    model = model.to(dtype)  # the same float32 init in every run; the truth is its float64 copy
    initial_checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    lm_head_calls = [0]
    model.lm_head.register_forward_hook(lambda *_: lm_head_calls.__setitem__(0, lm_head_calls[0] + 1))
    counter = UnshardCounter()
    # a tied weight is named once, by its first owner (the embedding)
    counter.install(model, "model.embed_tokens.weight" if spec["tied"] else "lm_head.weight")
    fsdp_config = {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"],
        "state_dict_type": "SHARDED_STATE_DICT",
        "cpu_offload": spec["offload"],
    }
    hybrid = {}
    if spec["hybrid"]:
        from accelerate.parallelism_config import ParallelismConfig

        hybrid["parallelism_config"] = ParallelismConfig(dp_replicate_size=2, dp_shard_size=world // 2)
    if reshard:  # the same global batch and order at every world size (see the module docstring)
        schedule = dict(
            max_steps=RESHARD_STEPS,
            per_device_train_batch_size=RESHARD_GLOBAL_BATCH // world,
            gradient_accumulation_steps=RESHARD_ACCUMULATION,
            train_sampling_strategy="random",
            save_steps=RESHARD_SAVE_STEP,
        )
        save_step = RESHARD_SAVE_STEP
    else:
        schedule = dict(
            max_steps=-1,
            num_train_epochs=a.epochs,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            train_sampling_strategy="group_by_length",
            save_steps=SAVE_STEP,
        )
        save_step = SAVE_STEP
    args = tiny.training_args(
        str(Path(a.out) / run),
        use_cpu=True,  # gloo; the harness's relabelled state keeps FSDP (see the module docstring)
        fsdp="full_shard",
        fsdp_config=fsdp_config,
        optim_args=spec["optim_args"],
        save_strategy="steps" if spec["save"] else "no",
        accelerator_config={"use_configured_state": True},
        **hybrid,
        **schedule,
    )
    trainer = engine.recorded_trainer(model, args, RESHARD_ROWS if reshard else a.rows)
    source = spec["source"] or (run.replace("-resume", "-save") if spec["resume"] else run)
    checkpoint = Path(a.out, source, f"checkpoint-{save_step}")
    try:
        trainer.train(resume_from_checkpoint=str(checkpoint) if spec["resume"] else None)
    finally:
        counter.uninstall()
    inner = engine.innermost_optimizer(trainer.optimizer)
    params = [p for group in inner.param_groups for p in group["params"]]
    return {
        **engine.shared_result(trainer, model, initial_checksum, lm_head_calls[0]),
        "is_fsdp2": bool(getattr(trainer.accelerator, "is_fsdp2", False)),
        "model_class": type(trainer.model).__name__,
        "forwards": counter.forwards,
        "head_unshards": counter.unshards,
        "unshards_by_group": counter.by_group,
        "param_types": sorted({type(p).__name__ for p in params}),
        "state_types": sorted({type(v).__name__ for s in inner.state.values() for v in s.values()}),
        "state_keys": sorted({f"{k}:{str(v.dtype)[6:]}" for s in inner.state.values() for k, v in s.items()}),
        # the optimizer's step counts (a resume that loaded the state counts on from the checkpoint's)
        "state_steps": sorted({float(s["step"]) for s in inner.state.values() if "step" in s}),
        # the placements of the DTensor states (moments, 8-bit codes and absmax), by key
        "state_placements": sorted(
            {
                f"{k}:{','.join(str(pl) for pl in v.placements)}"
                for s in inner.state.values()
                for k, v in s.items()
                if hasattr(v, "placements")
            }
        ),
        "weights_device": str(next(trainer.model.parameters()).device),
        "offload_policy": type(trainer.accelerator.state.fsdp_plugin.cpu_offload).__name__,
        # fully_shard's own record of the policy: each FSDPParam's shard kept on (and stepped on) the CPU
        "fsdp_params": len(_fsdp_params(trainer.model)),
        "offloaded_params": sum(p.offload_to_cpu for p in _fsdp_params(trainer.model)),
        "mesh": _mesh(params),
        "checkpoint_files": sorted(os.listdir(checkpoint)) if spec["save"] else None,
    }


def probe_supported_settings(use_cpu: bool) -> dict:
    """What the Trainer does with FSDP on this machine without the harness (the facts in the module docstring):
    TrainingArguments with their default process state, the Trainer built, nothing trained. Run last: it
    replaces the harness's process state."""
    args = tiny.training_args("/tmp/unused", use_cpu=use_cpu, fsdp=True, fsdp_config={"version": 2})
    try:
        trainer = transformers.Trainer(model=tiny.model("qwen3"), args=args, train_dataset=tiny.dataset(n=8))
    except ValueError as err:
        return {"refused": str(err), "parallel_mode": str(args.parallel_mode)}
    return {
        "distributed_type": str(trainer.accelerator.distributed_type),
        "is_fsdp_enabled": trainer.is_fsdp_enabled,
        "parallel_mode": str(args.parallel_mode),
    }


PROBES = {"probe-no-cpu": False, "probe-use-cpu": True}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--runs", default="truth,reference,fasttrain")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--rows", type=int, default=32)
    a = p.parse_args()
    rank = fsdp_process_state().process_index
    _cpu_offload_without_pinning()
    # the imports' objects (torch, transformers, DeepSpeed...) out of the collector's reach: the Trainer and the
    # harness collect after every run, and a full collection over them took ~1 s a run with 4 processes on 2 cores
    gc.freeze()
    engine.run_each(
        a.out,
        a.runs.split(","),
        rank,
        lambda run: probe_supported_settings(PROBES[run]) if run in PROBES else train_once(run, a),
    )


if __name__ == "__main__":
    main()
