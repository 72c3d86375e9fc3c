"""The fused loss under FSDP2 (fully_shard, gloo, 2 CPU processes): the same loss and gradients as the
unsharded, unpatched model; and a lm_head sharded on its own takes the model's own path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.distributed

WORKER = textwrap.dedent(
    """
    import copy
    import torch, torch.distributed as dist
    import transformers
    from torch.distributed.fsdp import fully_shard
    from fasttrain.loss.model_patch import enable_fused_loss

    dist.init_process_group("gloo")
    rank = dist.get_rank()


    def check(shard_head):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2)
        ref = transformers.LlamaForCausalLM(cfg).train()
        model = copy.deepcopy(ref)
        assert enable_fused_loss(model) is None
        for layer in model.model.layers:
            fully_shard(layer)
        if shard_head:
            fully_shard(model.lm_head)
        fully_shard(model)

        g = torch.Generator().manual_seed(rank)
        ids = torch.randint(0, 97, (2, 11), generator=g)
        labels = ids.clone(); labels[0, :3] = -100
        out = model(input_ids=ids, labels=labels)
        assert (out.logits is None) != shard_head, "fused path iff lm_head is not sharded on its own"
        out.loss.backward()

        # reference: each rank's loss on the unsharded model; FSDP averages gradients over ranks
        loss_ref = ref(input_ids=ids, labels=labels).loss
        assert torch.allclose(out.loss, loss_ref, rtol=1e-5, atol=1e-6), (out.loss, loss_ref)
        (loss_ref / dist.get_world_size()).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
        named = dict(model.named_parameters())
        for name, p in ref.named_parameters():
            grad = named[name].grad.full_tensor()
            err = float((grad - p.grad).abs().max() / p.grad.abs().max())
            assert err < 1e-4, (name, err)


    for layout in ("root", "head"):
        check(layout == "head")
        print("OK", layout, rank)
    dist.destroy_process_group()
    """
)


def test_fsdp2_two_processes(tmp_path):
    # one launch checks both layouts: the root unit holds lm_head (fused path), and lm_head sharded on
    # its own (the model's own path, since the weight is a DTensor shard at call time)
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("OK") == 4
