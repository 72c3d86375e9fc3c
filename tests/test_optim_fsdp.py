"""FusedAdamW under FSDP2 (fully_shard) with 2 processes on gloo/CPU, against clip_grad_norm_ + torch AdamW."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_fsdp2_two_processes_match_torch_adamw(tmp_path):
    worker = Path(__file__).with_name("_fsdp_adamw_worker.py")
    init_file = tmp_path / "rendezvous"
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    env.setdefault("OMP_NUM_THREADS", "1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), "2", str(init_file)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=240)
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, f"rank {rank} failed:\n{out[-4000:]}"
