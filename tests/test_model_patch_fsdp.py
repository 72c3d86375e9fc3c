"""The fused loss under FSDP2 (fully_shard, gloo, 2 CPU processes): the loss and gradients of the unsharded,
unpatched model, as close to the truth (that model in float64) as the unsharded float32 model is; and a lm_head
sharded on its own takes the model's own path, while a lm_head in one unit with the final norm (Accelerate's
FSDP2 layout) takes the fused path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = textwrap.dedent(
    """
    import copy
    import sys
    sys.path.insert(0, TESTS_DIR)
    import torch, torch.distributed as dist
    import _truth
    import transformers
    from torch.distributed.fsdp import fully_shard
    from fasttrain.loss.lazy_logits import PendingLogits
    from fasttrain.loss.model_patch import enable_fused_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()


    def check(layout):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        ref = transformers.LlamaForCausalLM(cfg).train()
        truth = _truth.float64_twin(ref)
        model = copy.deepcopy(ref)
        assert enable_fused_loss(model) is None
        for layer in model.model.layers:
            fully_shard(layer)
        if layout == "head":
            fully_shard(model.lm_head)
        elif layout == "tail":  # Accelerate's FSDP2 layout: final norm and lm_head one unit, kept unsharded
            fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
        fully_shard(model)

        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 97, (2, 11), generator=g)
        labels = ids.clone(); labels[0, :3] = -100
        out = model(input_ids=ids, labels=labels)
        # fused path unless lm_head is sharded on its own (in the tail unit the backbone's norm unshards it)
        pending = isinstance(dict.get(out, "logits"), PendingLogits)
        assert pending == (layout != "head"), layout
        if pending:  # logits on demand: the unsharded model's, read after the sharded forward returned
            with torch.no_grad():
                expected = ref(input_ids=ids).logits
            torch.testing.assert_close(out.logits.detach(), expected, rtol=1e-5, atol=1e-6)
        out.loss.backward()

        # reference and truth: each rank's loss on the unsharded model; FSDP averages gradients over ranks
        losses = []
        for unsharded in (ref, truth):
            loss = unsharded(input_ids=ids, labels=labels).loss
            losses.append(float(loss.detach()))
            (loss / dist.get_world_size()).backward()
            for p in unsharded.parameters():
                dist.all_reduce(p.grad)
        _truth.assert_scalar_near_truth("loss", float(out.loss.detach()), *losses, _truth.FP32_STEP)
        grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
        _truth.assert_tensors_near_truth(grads, {n: p.grad for n, p in ref.named_parameters()},
                                         {n: p.grad for n, p in truth.named_parameters()}, what="gradient")


    for layout in ("root", "head", "tail"):
        check(layout)
        print("OK", layout, rank)
    dist.destroy_process_group()
    """
)


def test_fsdp2_two_processes(tmp_path):
    # one launch checks three layouts: the root unit holds lm_head (fused path); lm_head sharded on its own
    # (the model's own path, since the weight is a DTensor shard at call time); lm_head in one unit with the
    # final norm, as Accelerate's FSDP2 preparation shards it (fused path: the backbone's norm unshards it)
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("TESTS_DIR", repr(str(Path(__file__).resolve().parent))))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("OK") == 6
