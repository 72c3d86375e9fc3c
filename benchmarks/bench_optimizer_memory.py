"""Optimizer-state memory per rank, per engine and state_dtype (CPU processes, gloo).

For each engine (DDP; FSDP2 full shard, hybrid shard on a 2 x 2 mesh, CPU offload; DeepSpeed ZeRO-1/2/3) and
world size (2 and 4 processes), one optimizer step of a small Qwen3 (random init, bf16 parameters) with each of
torch's ``torch.optim.AdamW`` and fasttrain's ``FusedAdamW`` with ``state_dtype`` None (moments in the
parameter's dtype: bf16 here), ``"float32"`` and ``"8bit"``. After the step each rank counts the bytes of every
tensor in its ``optimizer.state`` (step counters included): a DTensor's local shard (FSDP2), the states of the
flat fp32 partitions the engine hands the optimizer (DeepSpeed: the client optimizer ZeRO steps). Two per-rank
figures per cell:

- bytes per *stepped* parameter: the state bytes over the elements of the tensors this rank's optimizer holds
  state for (its local shards, its ZeRO partitions, every parameter under DDP): what the layout costs;
- bytes per *1/world of the model*: the state bytes over the model's parameter count divided by the number of
  processes: what the engine's sharding saves (DDP keeps world x, hybrid shard 2 x).

The engines run directly (no Trainer): DDP wraps the model in ``DistributedDataParallel``; FSDP2 calls
``fully_shard`` on each decoder layer and on the model; DeepSpeed gets the optimizer as its client optimizer with
``bf16`` on (``DS_ACCELERATOR=cpu``, as tests/test_deepspeed.py runs it). One launch per world size and engine
family (torch's engines, DeepSpeed's); a cell that fails records its error and the others go on.

    python benchmarks/bench_optimizer_memory.py                       # everything; results in benchmarks/results/
    python benchmarks/bench_optimizer_memory.py --worlds 2 --engines ddp,fsdp2 --out /tmp   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import _common

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("ddp", "fsdp2", "fsdp2-hybrid", "fsdp2-offload", "zero1", "zero2", "zero3")
ENGINE_NAMES = {
    "ddp": "DDP",
    "fsdp2": "FSDP2 full shard",
    "fsdp2-hybrid": "FSDP2 hybrid shard (2 x world/2)",
    "fsdp2-offload": "FSDP2 + CPU offload",
    "zero1": "DeepSpeed ZeRO-1",
    "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
}
# torch.optim.AdamW, then FusedAdamW by state_dtype ("param": None, the parameter's dtype)
OPTIMIZERS = ("torch", "param", "float32", "8bit")
OPTIMIZER_NAMES = {
    "torch": "torch AdamW",
    "param": "FusedAdamW None (param dtype: bf16)",
    "float32": "FusedAdamW float32",
    "8bit": "FusedAdamW 8bit",
}
REQUIRED_8BIT_OVER_BF16 = 0.55  # FSDP2: 8-bit states at most this fraction of bf16 states, per rank


# ------------------------------------------------------------------------------------------------ counting


def optimizer_state_bytes(optimizer: Any) -> dict[str, Any]:
    """What one rank's ``optimizer.state`` holds: ``bytes`` (every tensor of every parameter's state, step
    counters included; a DTensor counts its local shard), ``stepped`` (the elements of the tensors holding state,
    local shards for DTensors: the parameters this rank's optimizer is responsible for), ``bytes_per_param``
    (bytes / stepped), ``tensors`` and ``dtypes`` (the state tensors' count and dtypes, step counters included)."""
    import torch

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    total = stepped = tensors = 0
    dtypes: set[str] = set()
    for param, state in optimizer.state.items():
        stepped += local(param).numel()
        for value in state.values():
            t = local(value)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
                tensors += 1
                dtypes.add(str(t.dtype).removeprefix("torch."))
    return {
        "bytes": total,
        "stepped": stepped,
        "bytes_per_param": total / stepped if stepped else float("nan"),
        "tensors": tensors,
        "dtypes": sorted(dtypes),
    }


# ------------------------------------------------------------------------------------------------ worker side


def _model(a):
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=3 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.hidden // 4,
        max_position_embeddings=a.seq_len,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)


def _optimizer(kind: str, params):
    import torch

    from fasttrain import FusedAdamW

    if kind == "torch":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01)
    state_dtype = None if kind == "param" else kind
    return FusedAdamW(params, lr=1e-4, weight_decay=0.01, state_dtype=state_dtype)


def _batch(a, rank: int, step: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(2, a.vocab, (a.batch, a.seq_len), generator=g)


def _ds_config(stage: int, world: int, batch: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "train_batch_size": batch * world,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        # 0: every weight partitioned under ZeRO-3 (as tests/_deepspeed_worker.py)
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,  # FusedAdamW is not on DeepSpeed's list of tested optimizers
        "steps_per_print": 10**9,
    }


def _cell(engine: str, kind: str, a, rank: int, world: int) -> dict:
    """One optimizer under one engine: ``a.steps`` steps, then this rank's state bytes."""
    import torch

    model = _model(a)
    total_params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    ds_engine = None
    if engine.startswith("zero"):
        import deepspeed

        opt = _optimizer(kind, model.parameters())
        ds_engine, wrapper, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=_ds_config(int(engine[-1]), world, a.batch)
        )
        stepped_by = type(wrapper).__name__
    else:
        if engine == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

            if engine == "fsdp2-hybrid":
                mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
            else:
                mesh = init_device_mesh("cpu", (world,))
            offload = CPUOffloadPolicy(pin_memory=False) if engine == "fsdp2-offload" else OffloadPolicy()
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh, offload_policy=offload)
            fully_shard(model, mesh=mesh, offload_policy=offload)
        opt = _optimizer(kind, model.parameters())
        stepped_by = type(model).__name__
    losses = []
    for step in range(a.steps):
        ids = _batch(a, rank, step)
        if ds_engine is not None:
            loss = ds_engine(input_ids=ids, labels=ids).loss
            ds_engine.backward(loss)
            ds_engine.step()
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float()))
    counted = optimizer_state_bytes(opt)
    stepped_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in opt.state})
    result = {
        **counted,
        "total_params": total_params,
        "bytes_per_world_share": counted["bytes"] / (total_params / world),
        "stepped_param_dtypes": stepped_dtypes,
        # what the optimizer steps, in bytes: the model's own parameters (DDP, FSDP2) or ZeRO's fp32 partitions,
        # which DeepSpeed's bf16 mode keeps beside the bf16 model (master weights, outside optimizer.state)
        "stepped_bytes": sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size() for p in opt.state
        ),
        "optimizer": type(opt).__name__,
        "wrapped_by": stepped_by,
        "losses": losses,
        "seconds": time.perf_counter() - started,
    }
    if ds_engine is not None and hasattr(ds_engine, "destroy"):
        ds_engine.destroy()
    return result


def worker(a) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    if any(e.startswith("zero") for e in a.engines.split(",")):
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a minutes-long C++ build
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for engine in a.engines.split(","):
        for kind in a.optimizers.split(","):
            try:
                cell = _cell(engine, kind, a, rank, world)
            except Exception as err:  # a cell that fails is reported as such; the others go on
                cell = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-3000:]}
            gc.collect()
            cells: list = [None] * world
            dist.all_gather_object(cells, cell)
            if rank == 0:
                results.append({"engine": engine, "optimizer": kind, "world": world, "ranks": cells})
                status = cells[0].get("error") or f"{cells[0]['bytes_per_param']:.3f} B/param"
                print(f"[world {world}] {engine} {kind}: {status}", flush=True)
    if rank == 0:
        Path(a.out_file).write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver side


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def launch(engines: list[str], world: int, a, scratch: Path) -> list[dict]:
    """One torchrun launch of ``world`` processes running ``engines`` x every optimizer; its cells."""
    out_file = scratch / f"{'-'.join(engines)}-{world}.json"
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), DS_ACCELERATOR="cpu")
    env.pop("TRITON_INTERPRET", None)  # the CPU paths, not the Triton interpreter
    model_args = ["--steps", a.steps, "--batch", a.batch, "--seq-len", a.seq_len, "--hidden", a.hidden,
                  "--layers", a.layers, "--vocab", a.vocab, "--threads", a.threads]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port",
           _free_port(), __file__, "--worker", "--engines", ",".join(engines), "--optimizers", a.optimizers,
           "--out-file", str(out_file), *map(str, model_args)]  # fmt: skip
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=a.timeout)
        failure = None if done.returncode == 0 else f"exit {done.returncode}: {done.stderr[-1500:]}"
    except subprocess.TimeoutExpired:
        failure = f"launch timed out after {a.timeout} s"
    seconds = time.perf_counter() - started
    cells = json.loads(out_file.read_text()) if out_file.exists() else []
    got = {(c["engine"], c["optimizer"]) for c in cells}
    for engine in engines:
        for kind in a.optimizers.split(","):
            if (engine, kind) not in got:
                err = {"error": failure or "no result"}
                cells.append({"engine": engine, "optimizer": kind, "world": world, "ranks": [err]})
    for c in cells:
        c["launch_s"] = seconds
    print(f"world {world}, {','.join(engines)}: {seconds:.0f} s" + (f" ({failure})" if failure else ""),
          flush=True)  # fmt: skip
    return cells


def _bf16_state_dtype() -> str:
    """What FusedAdamW says to ``state_dtype=torch.bfloat16`` (bf16 moments come from state_dtype=None on bf16
    parameters)."""
    import torch

    from fasttrain import FusedAdamW

    try:
        FusedAdamW([torch.nn.Parameter(torch.zeros(2))], state_dtype=torch.bfloat16)
    except ValueError as err:
        return f"refused: {err}"
    return "accepted"


def _summary(cells: list[dict]) -> list[dict]:
    """One row per (engine, world): per optimizer, the largest per-rank figures over the ranks."""
    rows: dict[tuple[str, int], dict] = {}
    for c in cells:
        row = rows.setdefault(
            (c["engine"], c["world"]), {"engine": c["engine"], "world": c["world"], "cells": {}}
        )
        ranks = c["ranks"]
        errors = [r["error"] for r in ranks if "error" in r]
        if errors:
            row["cells"][c["optimizer"]] = {"error": errors[0]}
            continue
        row["cells"][c["optimizer"]] = {
            "bytes_per_param": max(r["bytes_per_param"] for r in ranks),
            "bytes_per_param_min": min(r["bytes_per_param"] for r in ranks),
            "bytes_per_world_share": max(r["bytes_per_world_share"] for r in ranks),
            "bytes_max_rank": max(r["bytes"] for r in ranks),
            "stepped_max_rank": max(r["stepped"] for r in ranks),
            "total_params": ranks[0]["total_params"],
            "state_dtypes": ranks[0]["dtypes"],
            "stepped_param_dtypes": ranks[0]["stepped_param_dtypes"],
            "optimizer_class": ranks[0]["optimizer"],
            "wrapped_by": ranks[0]["wrapped_by"],
            "seconds": max(r["seconds"] for r in ranks),
        }
    out = []
    for key in sorted(rows, key=lambda k: (ENGINES.index(k[0]), k[1])):
        row = rows[key]
        got = row["cells"]
        ref = got.get("torch", {}).get("bytes_per_param")
        for cell in got.values():
            if "error" not in cell and ref:
                cell["vs_torch"] = cell["bytes_per_param"] / ref
        low, eight = got.get("param", {}), got.get("8bit", {})
        if "bytes_max_rank" in low and "bytes_max_rank" in eight:
            row["8bit_over_param"] = _per_rank_ratio(cells, row["engine"], row["world"])
            row["param_state_dtype"] = [d for d in low["state_dtypes"] if d != "float32"] or ["float32"]
        out.append(row)
    return out


def _per_rank_ratio(cells: list[dict], engine: str, world: int) -> float | None:
    """The largest over the ranks of (8-bit state bytes / param-dtype state bytes) of one rank."""
    by = {(c["engine"], c["world"], c["optimizer"]): c["ranks"] for c in cells}
    low, eight = by.get((engine, world, "param")), by.get((engine, world, "8bit"))
    if not low or not eight or any("error" in r for r in low + eight):
        return None
    return max(e["bytes"] / p["bytes"] for p, e in zip(low, eight, strict=True))


def _markdown(env: dict, rows: list[dict], cells: list[dict], a) -> str:
    kinds = a.optimizers.split(",")
    any_cell = next((c for r in rows for c in r["cells"].values() if "total_params" in c), {})
    total = any_cell.get("total_params", 0)

    def cell_text(row: dict, kind: str, field: str, ratio: bool) -> str:
        c = row["cells"].get(kind)
        if c is None:
            return "not run"
        if "error" in c:
            return "failed: " + c["error"].splitlines()[0][:80].replace("|", "/")
        text = f"{c[field]:.3f}"
        if field == "bytes_per_param" and c["bytes_per_param"] - c["bytes_per_param_min"] > 5e-4:
            text = f"{c['bytes_per_param_min']:.3f}..{c[field]:.3f}"
        if ratio and "vs_torch" in c:
            text += f" ({c['vs_torch']:.2f}x)"
        return text

    def ratio_text(row: dict) -> str:
        r = _per_rank_ratio(cells, row["engine"], row["world"])
        if r is None:
            return "n/a"
        dtypes = row.get("param_state_dtype", [])
        return f"{r:.3f}x" + ("" if dtypes == ["bfloat16"] else f" (over {'/'.join(dtypes)} moments)")

    header = "| engine | processes | " + " | ".join(OPTIMIZER_NAMES[k] for k in kinds)
    lines = [
        "# Optimizer-state memory per rank: engines x state_dtype (CPU processes, gloo)",
        "",
        f"- date: {env['date']}; machine: {env['cpu']}, {env['cores']} cores ({a.threads} torch thread a process),"
        f" load average at start {env['load_average_at_start']:.1f} (a machine shared with other work)",
        "- versions: "
        + ", ".join(f"{k} {env[k]}" for k in ("python", "torch", "transformers", "deepspeed", "fasttrain")),
        f"- command: `{env['command']}`",
        f"- model: Qwen3, hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab} (untied lm_head), {total:,}"
        f" parameters, random init, bf16 parameters; {a.steps} optimizer step(s) on {a.batch} x {a.seq_len}"
        " random tokens a rank; wall time "
        f"{env['wall_s'] / 60:.1f} min",
        "- counted: after the step(s), on each rank, the bytes of every tensor in `optimizer.state` (step counters"
        " included: 4 B per parameter tensor), a DTensor's local shard only; under DeepSpeed the states of the fp32"
        " partitions ZeRO hands the optimizer. Each cell is the largest value over the ranks"
        " (a range where ranks differ).",
        f"- `FusedAdamW(state_dtype=torch.bfloat16)`: {env['bf16_state_dtype']}. bf16 moments are"
        " `state_dtype=None` on bf16 parameters (the 'param dtype' column).",
        "",
        "## Bytes per stepped parameter, per rank",
        "",
        "State bytes on a rank / the elements of the tensors that rank's optimizer steps (its shards, its ZeRO"
        " partition, all parameters under DDP). In parentheses: the ratio to torch's AdamW under the same engine.",
        "",
        header + " | 8-bit / param-dtype states, per rank |",
        "| --- | ---: | " + " | ".join("---:" for _ in kinds) + " | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {ENGINE_NAMES[row['engine']]} | {row['world']} | "
            + " | ".join(cell_text(row, k, "bytes_per_param", True) for k in kinds)
            + f" | {ratio_text(row)} |"
        )
    lines += [
        "",
        "## Bytes per 1/world of the model, per rank",
        "",
        f"State bytes on a rank / ({total:,} parameters / processes): the per-rank memory the engine's sharding"
        " leaves (DDP holds every state on every rank: world x; hybrid shard: 2 x, its replicas).",
        "",
        header + " |",
        "| --- | ---: | " + " | ".join("---:" for _ in kinds) + " |",
    ]
    for row in rows:
        lines.append(
            f"| {ENGINE_NAMES[row['engine']]} | {row['world']} | "
            + " | ".join(cell_text(row, k, "bytes_per_world_share", False) for k in kinds)
            + " |"
        )
    checks = []
    for row in rows:
        if row["engine"].startswith("fsdp2"):
            r = _per_rank_ratio(cells, row["engine"], row["world"])
            verdict = "not measured" if r is None else ("pass" if r <= REQUIRED_8BIT_OVER_BF16 else "FAIL")
            shown = "n/a" if r is None else f"{r:.3f}x"
            checks.append(f"- {ENGINE_NAMES[row['engine']]}, {row['world']} processes: {shown} ({verdict})")
    lines += [
        "",
        f"## Requirement: 8-bit states <= {REQUIRED_8BIT_OVER_BF16}x of bf16 states per rank on FSDP2",
        "",
        "Each rank's 8-bit state bytes over its bf16 (`state_dtype=None`) state bytes, the largest over the ranks:",
        "",
        *checks,
        "",
        "## Notes",
        "",
        "- DeepSpeed: ZeRO steps the client optimizer on its own flat fp32 partitions (bf16 mode keeps them as"
        " master weights beside the bf16 model, 4 B per partitioned parameter outside `optimizer.state`), so"
        " torch's AdamW and `state_dtype=None` keep fp32 moments there, and the 8-bit ratio is over fp32 moments;"
        " `8bit` quantizes whole partitions.",
        "- FSDP2 with 8-bit: 1-D parameters (the RMSNorm weights) keep fp32 moments on shards; tensors below"
        " `min_8bit_size` (4,096 elements) keep fp32 moments everywhere.",
        "- What each engine's optimizer stepped (rank 0, FusedAdamW 8bit cell; the wrapper is the model's under"
        " DDP/FSDP2, the ZeRO optimizer's under DeepSpeed), and the seconds of the slowest cell of the row"
        " (model build, engine set-up, step):",
        "",
        *[_stepped_line(row) for row in rows],
    ]
    return "\n".join(lines) + "\n"


def _stepped_line(row: dict) -> str:
    c = row["cells"].get("8bit") or next(iter(row["cells"].values()))
    slowest = max((x["seconds"] for x in row["cells"].values() if "seconds" in x), default=float("nan"))
    if "error" in c:
        return f"  - {ENGINE_NAMES[row['engine']]}, {row['world']} processes: {c['error'].splitlines()[0]}"
    return (
        f"  - {ENGINE_NAMES[row['engine']]}, {row['world']} processes: {c['stepped_max_rank']:,} elements of"
        f" {'/'.join(c['stepped_param_dtypes'])} a rank (at most), wrapped by {c['wrapped_by']}; state dtypes"
        f" {'/'.join(c['state_dtypes'])}; slowest cell {slowest:.1f} s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=int, default=600, help="seconds a launch may take")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument(
        "--render", metavar="JSON", help="only rewrite the .md beside a results .json from its data"
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    if a.render:
        saved = json.loads(Path(a.render).read_text())
        md = Path(a.render).with_suffix(".md")
        md.write_text(
            _markdown(
                saved["environment"], saved["summary"], saved["cells"], argparse.Namespace(**saved["args"])
            )
        )
        print(f"wrote {md}")
        return
    engines = a.engines.split(",")
    unknown = set(engines) - set(ENGINES) or set(a.optimizers.split(",")) - set(OPTIMIZERS)
    if unknown:
        p.error(
            f"unknown {sorted(unknown)}; engines: {','.join(ENGINES)}; optimizers: {','.join(OPTIMIZERS)}"
        )
    started = time.perf_counter()
    env = {
        "date": _common.utc_now(),
        "cpu": _common.cpu_model(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        **_common.versions("torch", "transformers", "accelerate", "deepspeed", "fasttrain"),
        "command": _common.command(),
        "bf16_state_dtype": _bf16_state_dtype(),
    }
    scratch = Path(tempfile.mkdtemp(prefix="bench_optimizer_memory-"))
    cells: list[dict] = []
    for world in map(int, a.worlds.split(",")):
        here = [e for e in engines if e != "fsdp2-hybrid" or world == 4]  # hybrid: the 2 x 2 mesh only
        for family in (
            [e for e in here if not e.startswith("zero")],
            [e for e in here if e.startswith("zero")],
        ):
            if family:
                cells += launch(family, world, a, scratch)
    env["wall_s"] = time.perf_counter() - started
    rows = _summary(cells)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "optimizer_memory_cpu.json").write_text(
        json.dumps({"environment": env, "args": vars(a), "summary": rows, "cells": cells}, indent=1)
    )
    (out / "optimizer_memory_cpu.md").write_text(_markdown(env, rows, cells, a))
    print(f"wrote {out / 'optimizer_memory_cpu.md'}")


if __name__ == "__main__":
    main()
