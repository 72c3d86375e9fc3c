"""FusedAdamW under FSDP2 (fully_shard) with 2 processes on gloo/CPU, against clip_grad_norm_ + torch AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from _gloo_ranks import launch

pytestmark = pytest.mark.distributed


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch without distributed")
def test_fsdp2_two_processes_match_torch_adamw(tmp_path):
    launch(Path(__file__).with_name("_fsdp_adamw_worker.py"), tmp_path, "adamw", 2, [], timeout=240)
