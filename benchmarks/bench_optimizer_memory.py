"""Optimizer-state memory per rank, per engine and state_dtype (CPU processes, gloo).

How it measures: docs/method.md, "Optimizer-state memory".

    python benchmarks/bench_optimizer_memory.py                       # everything; results in benchmarks/results/
    python benchmarks/bench_optimizer_memory.py --worlds 2 --engines ddp,fsdp2 --out /tmp   # smoke run
"""

from __future__ import annotations

import argparse
import gc
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

import _common
from fasttrain import FusedAdamW

ENGINE_NAMES = {
    "ddp": "DDP", "fsdp2": "FSDP2 full shard", "fsdp2-hybrid": "FSDP2 hybrid shard (2 x world/2)",
    "fsdp2-offload": "FSDP2 + CPU offload", "zero1": "DeepSpeed ZeRO-1", "zero2": "DeepSpeed ZeRO-2",
    "zero3": "DeepSpeed ZeRO-3",
}  # fmt: skip
ENGINES = tuple(ENGINE_NAMES)
# torch.optim.AdamW, then FusedAdamW by state_dtype ("param": None, the parameter's dtype)
OPTIMIZERS = {"torch": "torch AdamW", "param": "FusedAdamW None (param dtype: bf16)",
              "float32": "FusedAdamW float32", "8bit": "FusedAdamW 8bit"}  # fmt: skip
LAUNCH_TIMEOUT_S = 600  # a launch still running then is stopped; its cells record the timeout


def optimizer_state_bytes(optimizer: Any) -> dict[str, Any]:
    """What one rank's ``optimizer.state`` holds, step counters included, a DTensor counting its local shard:
    ``bytes``, ``stepped`` (the elements of the parameters this rank's optimizer steps), ``bytes_per_param``,
    and the state tensors' count and dtypes."""

    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    held = [local(v) for state in optimizer.state.values() for v in state.values()]
    held = [t for t in held if isinstance(t, torch.Tensor)]
    total = sum(t.numel() * t.element_size() for t in held)
    stepped = sum(local(p).numel() for p in optimizer.state)
    return {"bytes": total, "stepped": stepped, "bytes_per_param": total / stepped if stepped else float("nan"),
            "tensors": len(held), "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in held})}  # fmt: skip


# ------------------------------------------------------------------------------------------------ worker side
def _wrap(model, engine: str, world: int):
    """``model`` under DDP or FSDP2 (a unit per decoder layer; full shard, hybrid on a 2 x world/2 mesh, or
    CPU offload)."""
    if engine == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    hybrid = engine == "fsdp2-hybrid"
    mesh = init_device_mesh("cpu", (2, world // 2) if hybrid else (world,),
                            mesh_dim_names=("replicate", "shard") if hybrid else None)  # fmt: skip
    offload = CPUOffloadPolicy(pin_memory=False) if engine == "fsdp2-offload" else OffloadPolicy()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, offload_policy=offload)
    return fully_shard(model, mesh=mesh, offload_policy=offload)


def _cell(engine: str, kind: str, a, rank: int, world: int) -> dict:
    """One optimizer under one engine: ``a.steps`` steps, then this rank's state bytes."""
    model = _common.tiny_qwen3(
        a.vocab, a.hidden, a.layers, max_position_embeddings=a.seq_len, tie_word_embeddings=False
    ).to(torch.bfloat16)
    total_params = sum(p.numel() for p in model.parameters())
    started = time.perf_counter()
    ds = engine.startswith("zero")
    model = model if ds else _wrap(model, engine, world)  # FSDP2 shards the parameters: wrapped first
    hyper = {"lr": 1e-4, "weight_decay": 0.01}
    state_dtype = None if kind == "param" else kind
    opt = (torch.optim.AdamW(model.parameters(), **hyper) if kind == "torch"
           else FusedAdamW(model.parameters(), state_dtype=state_dtype, **hyper))  # fmt: skip
    stepped_by = type(model).__name__
    if ds:
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": a.batch, "gradient_accumulation_steps": 1,
            "train_batch_size": a.batch * world, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "steps_per_print": 10**9,
            # 0: every weight partitioned under ZeRO-3 (as tests/_deepspeed_worker.py)
            "zero_optimization": {"stage": int(engine[-1]), "stage3_param_persistence_threshold": 0},
            # FusedAdamW is not on DeepSpeed's list of tested optimizers
            "zero_allow_untested_optimizer": True,
        }  # fmt: skip
        model, wrapper, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        stepped_by = type(wrapper).__name__
    losses = []
    for step in range(a.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        ids = torch.randint(2, a.vocab, (a.batch, a.seq_len), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        if ds:  # DeepSpeed's engine runs the backward and the optimizer itself
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach().float()))
    counted = optimizer_state_bytes(opt)
    # stepped: the model's own parameters (DDP, FSDP2) or ZeRO's fp32 partitions, which DeepSpeed's bf16 mode
    # keeps beside the bf16 model (master weights, outside optimizer.state)
    result = {**counted, "total_params": total_params, "bytes_per_world_share": counted["bytes"] / (total_params / world),
              "stepped_param_dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in opt.state}),
              "optimizer": type(opt).__name__, "wrapped_by": stepped_by, "losses": losses,
              "seconds": time.perf_counter() - started}  # fmt: skip
    if ds and hasattr(model, "destroy"):
        model.destroy()
    return result


def worker(a) -> None:
    torch.set_num_threads(a.threads)
    if any(e.startswith("zero") for e in a.engines.split(",")):
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a minutes-long C++ build
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = []
    for engine in a.engines.split(","):
        for kind in OPTIMIZERS:
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
    _common.worker_done(rank, a.out_file, results)


# ------------------------------------------------------------------------------------------------ driver side
def launch(engines: list[str], world: int, a) -> list[dict]:
    """One torchrun launch of ``world`` processes running ``engines`` x every optimizer; its cells, a cell the
    launch left out carrying the launch's failure."""
    started = time.perf_counter()
    job = ["--engines", ",".join(engines), *_common.forwarded(a, a.sizes)]
    cells, failure = _common.torchrun(__file__, world, job, a.threads, LAUNCH_TIMEOUT_S)
    cells, seconds = cells or [], time.perf_counter() - started
    got = {(c["engine"], c["optimizer"]) for c in cells}
    cells += [{"engine": engine, "optimizer": kind, "world": world, "ranks": [{"error": failure or "no result"}]}
              for engine in engines for kind in OPTIMIZERS if (engine, kind) not in got]  # fmt: skip
    for c in cells:
        c["launch_s"] = seconds
    print(f"world {world}, {','.join(engines)}: {seconds:.0f} s {failure or ''}", flush=True)
    return cells


def _over_ranks(ranks: list[dict]) -> dict:
    """One optimizer's figures over the ranks: the largest (bytes per parameter: the smallest too), or an error."""
    if errors := [r["error"] for r in ranks if "error" in r]:
        return {"error": errors[0]}
    per_param = [r["bytes_per_param"] for r in ranks]
    return {"bytes_per_param": max(per_param), "bytes_per_param_min": min(per_param),
            "bytes_per_world_share": max(r["bytes_per_world_share"] for r in ranks),
            **{k: ranks[0][k] for k in ("total_params", "dtypes")}}  # fmt: skip


def _summary(cells: list[dict]) -> list[dict]:
    """One row per (engine, world): per optimizer its figures over the ranks and their ratio to torch's AdamW,
    and the largest per-rank ratio of 8-bit over param-dtype state bytes."""
    ranks: dict[tuple[str, int], dict] = {}
    for c in sorted(cells, key=lambda c: (ENGINES.index(c["engine"]), c["world"])):
        ranks.setdefault((c["engine"], c["world"]), {})[c["optimizer"]] = c["ranks"]
    rows = []
    for (engine, world), by_kind in ranks.items():
        got = {kind: _over_ranks(r) for kind, r in by_kind.items()}
        row = {"engine": engine, "world": world, "cells": got}
        if ref := got.get("torch", {}).get("bytes_per_param"):
            for cell in got.values():
                if "error" not in cell:
                    cell["vs_torch"] = cell["bytes_per_param"] / ref
        low, eight = by_kind.get("param", []), by_kind.get("8bit", [])
        if low and eight and not any("error" in r for r in low + eight):
            row["8bit_over_param"] = max(e["bytes"] / p["bytes"] for p, e in zip(low, eight, strict=True))
            row["param_state_dtype"] = [d for d in got["param"]["dtypes"] if d != "float32"] or ["float32"]
        rows.append(row)
    return rows


def _markdown(result: dict) -> list[str]:
    a, rows = argparse.Namespace(**result["args"]), result["summary"]
    total = next((c["total_params"] for r in rows for c in r["cells"].values() if "total_params" in c), 0)

    def cell_text(row: dict, kind: str, field: str) -> str:
        c = row["cells"].get(kind)
        if c is None:
            return "not run"
        if "error" in c:
            return "failed: " + c["error"].splitlines()[0][:80].replace("|", "/")
        low = c["bytes_per_param_min"] if field == "bytes_per_param" else c[field]
        text = f"{low:.3f}..{c[field]:.3f}" if c[field] - low > 5e-4 else f"{c[field]:.3f}"
        return text + (f" ({c['vs_torch']:.2f}x)" if field == "bytes_per_param" and "vs_torch" in c else "")

    def ratio_text(row: dict) -> str:
        if "8bit_over_param" not in row:
            return "n/a"
        dtypes = "/".join(row["param_state_dtype"])
        over = "" if dtypes == "bfloat16" else f" (over {dtypes} moments)"
        return f"{row['8bit_over_param']:.3f}x{over}"

    def table(field: str, ratio: bool) -> list[str]:
        heads = ["engine", "processes", *OPTIMIZERS.values()]
        heads += ["8-bit / param-dtype states, per rank"] * ratio
        lines = ["| " + " | ".join(heads) + " |", "| --- |" + " ---: |" * (len(heads) - 1)]
        for row in rows:
            texts = [cell_text(row, k, field) for k in OPTIMIZERS] + [ratio_text(row)] * ratio
            lines.append(f"| {ENGINE_NAMES[row['engine']]} | {row['world']} | " + " | ".join(texts) + " |")
        return lines

    return [
        f"- model: Qwen3, hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab} (untied lm_head), {total:,}"
        f" parameters, random init, bf16 parameters; {a.steps} optimizer step(s) on {a.batch} x {a.seq_len}"
        f" random tokens a rank; {a.threads} torch thread(s) a process; wall time {result['wall_s'] / 60:.1f} min",
        "- counted: after the step(s), on each rank, the bytes of every tensor in `optimizer.state` (step counters"
        " included: 4 B per parameter tensor), a DTensor's local shard only; under DeepSpeed the states of the fp32"
        " partitions ZeRO hands the optimizer. Each cell is the largest value over the ranks"
        " (a range where ranks differ). bf16 moments are `state_dtype=None` on bf16 parameters.",
        "",
        "## Bytes per stepped parameter, per rank",
        "",
        "State bytes on a rank / the elements of the tensors that rank's optimizer steps (its shards, its ZeRO"
        " partition, all parameters under DDP). In parentheses: the ratio to torch's AdamW under the same engine.",
        "",
        *table("bytes_per_param", True),
        "",
        "## Bytes per 1/world of the model, per rank",
        "",
        f"State bytes on a rank / ({total:,} parameters / processes): the per-rank memory the engine's sharding"
        " leaves (DDP holds every state on every rank: world x; hybrid shard: 2 x, its replicas).",
        "",
        *table("bytes_per_world_share", False),
        "",
        "DeepSpeed's ZeRO steps the optimizer on its own fp32 partitions (master weights beside the bf16 model),"
        " so there torch's AdamW and `state_dtype=None` keep fp32 moments and the 8-bit ratio is over fp32 moments.",
    ]  # fmt: skip


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--worlds", default="2,4")
    sizes = dict(steps=1, batch=1, seq_len=64, hidden=256, layers=4, vocab=32000, threads=1)
    _common.launcher_options(p, ENGINES, **sizes)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    engines = a.engines.split(",")
    result = _common.new_result("optimizer_memory_cpu", "deepspeed")
    result.update(args={**vars(a), "out": str(a.out)})
    started = time.perf_counter()
    cells: list[dict] = []
    for world in map(int, a.worlds.split(",")):
        here = [e for e in engines if e != "fsdp2-hybrid" or world == 4]  # hybrid: the 2 x 2 mesh only
        for deepspeed in (False, True):  # one launch for torch's engines, one for DeepSpeed's
            if family := [e for e in here if e.startswith("zero") == deepspeed]:
                cells += launch(family, world, a)
    result.update(wall_s=time.perf_counter() - started, summary=_summary(cells), cells=cells)
    title = "Optimizer-state memory per rank: engines x state_dtype (CPU processes, gloo)"
    _common.write(a.out, "optimizer_memory_cpu", result, title, _markdown(result))


if __name__ == "__main__":
    main()
