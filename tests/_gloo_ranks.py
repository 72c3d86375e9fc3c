"""Launching a test worker as gloo ranks on CPU, and the jobs loop the job workers share.

The parent side (``launch``) starts one process per rank of ``worker`` with ``rank world init_file *args``; the
worker side (``run_jobs``) joins the group through the rendezvous file and runs its jobs in order, every rank
together. One failed rank fails the launch, with every failed rank's output (the first error may be on any rank:
the others then lose their peers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def launch(worker: Path, tmp_path: Path, name: str, world: int, args: list[str], timeout: int = 300) -> None:
    init_file = tmp_path / f"rendezvous-{name}"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    env["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU: FSDP2 would otherwise put shards on a GPU
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(world), str(init_file), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=timeout)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    failed = [
        (rank, out) for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)) if proc.returncode
    ]
    assert not failed, "\n".join(f"{name}, rank {rank} failed:\n{out[-3000:]}" for rank, out in failed)


def launch_jobs(worker: Path, tmp_path: Path, name: str, world: int, jobs: list[dict]) -> None:
    """``launch`` for a job worker: ``jobs`` (JSON) says what every rank does, in order."""
    launch(worker, tmp_path, name, world, [json.dumps(jobs)])


def run_jobs(jobs_by_name: dict[str, Callable[[dict, int], None]]) -> None:
    """A job worker's main: ``rank world init_file jobs`` from the command line; each job run by every rank, a
    barrier after each. Exits without interpreter teardown (gloo's threads can hang it)."""
    import torch.distributed as dist

    rank, world, init_file, jobs = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for job in jobs:
            jobs_by_name[job["do"]](job, world)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full``, placed like ``param`` (``full`` itself for a plain tensor): every rank takes
    its part of the same full tensor, with no communication (``src_data_rank=None``)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(param, DTensor):
        return full
    return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
