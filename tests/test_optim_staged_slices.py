"""FusedAdamW's torch backend cuts a tensor larger than one staged batch into flat slices (``_torch_step._pieces``),
so that its fp32 and int64 working copies cost a batch, not the tensor: the step must be the whole tensor's, bit
for bit, for every staged layout — 8-bit moments (blocks kept whole), moments of another dtype, stochastic
rounding (its bits follow the global element index) — and a tensor that cannot be sliced is staged whole."""

from __future__ import annotations

import pytest
import torch

from fasttrain.optim import FusedAdamW, _torch_step

pytestmark = pytest.mark.numeric  # quantizing and rounding: arithmetic another instruction set could move


def _run(monkeypatch, stage: int, dtype, steps: int = 3, transpose: bool = False, **options):
    monkeypatch.setattr(_torch_step, "STAGE_ELEMENTS", stage)
    torch.manual_seed(0)
    # odd sizes: slices end inside an 8-bit block, the last slice is short; a small tensor stays one piece
    big = torch.randn(37, 83, dtype=torch.float32).to(dtype)
    small = torch.randn(50, dtype=torch.float32).to(dtype)
    params = [torch.nn.Parameter(big.t() if transpose else big), torch.nn.Parameter(small)]
    opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1, backend="torch", min_8bit_size=1, **options)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = (torch.randn(p.shape, generator=g) * (step + 1)).to(dtype)
        opt.step()
    return [p.detach().clone() for p in params], {k: v for k, v in opt.state_dict()["state"].items()}


CASES = {
    "8bit fp32": (torch.float32, {"state_dtype": "8bit"}),
    "8bit bf16 SR": (torch.bfloat16, {"state_dtype": "8bit", "bf16_stochastic_rounding": True}),
    "8bit amsgrad": (torch.float32, {"state_dtype": "8bit", "amsgrad": True}),
    "fp32 moments bf16 SR": (torch.bfloat16, {"state_dtype": "float32", "bf16_stochastic_rounding": True}),
    "bf16 moments bf16": (torch.bfloat16, {}),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("stage", [512, 768, 1000])
def test_sliced_step_equals_the_whole_tensor_step(monkeypatch, case, stage):
    dtype, options = CASES[case]
    whole_params, whole_state = _run(monkeypatch, 1 << 24, dtype, **options)
    sliced_params, sliced_state = _run(monkeypatch, stage, dtype, **options)
    for a, b in zip(whole_params, sliced_params, strict=True):
        assert torch.equal(a, b)
    for index, state in whole_state.items():
        for key, value in state.items():
            assert torch.equal(value, sliced_state[index][key]), (case, index, key)


def test_a_tensor_that_cannot_be_sliced_is_staged_whole(monkeypatch):
    """A non-contiguous parameter (a transposed view) has no flat slices: it goes whole, with the same result."""
    dtype, options = CASES["8bit bf16 SR"]
    whole, _ = _run(monkeypatch, 1 << 24, dtype, transpose=True, **options)
    sliced, _ = _run(monkeypatch, 512, dtype, transpose=True, **options)
    assert all(torch.equal(a, b) for a, b in zip(whole, sliced, strict=True))


def test_slices_bound_the_working_copies(monkeypatch):
    """What slicing is for: with a 512-element stage no staged tensor is larger than 512 elements."""
    monkeypatch.setattr(_torch_step, "STAGE_ELEMENTS", 512)
    seen = []
    staged = _torch_step._staged

    def spy(params, *args, **kwargs):
        seen.append(sum(p.numel() for p in params))
        return staged(params, *args, **kwargs)

    monkeypatch.setattr(_torch_step, "_staged", spy)
    p = torch.nn.Parameter(torch.randn(3000))
    p.grad = torch.randn(3000)
    FusedAdamW([p], backend="torch", state_dtype="8bit", min_8bit_size=1).step()
    assert seen and max(seen) <= 512 and sum(seen) == 3000


def test_a_staged_cpu_step_hands_freed_heap_pages_back(monkeypatch):
    """After a staged CPU step of more than a quarter batch, glibc's free heap pages go back to the system
    (``_heap.release_free_heap``: the batches' freed working tensors stayed resident, ~0.6 GB of a 0.6B model's
    peak); a step of a few small tensors does not pay for it. The real ``malloc_trim`` runs here too."""
    from fasttrain.optim import _heap

    calls = []
    real = _heap.release_free_heap
    monkeypatch.setattr(_torch_step, "release_free_heap", lambda: calls.append(real()))
    monkeypatch.setattr(_torch_step, "STAGE_ELEMENTS", 1024)
    big = torch.nn.Parameter(torch.randn(600, dtype=torch.bfloat16))  # > 1024 // 4 elements
    small = torch.nn.Parameter(torch.randn(100, dtype=torch.bfloat16))
    for params, expected in (([big], 1), ([small], 0)):
        calls.clear()
        opt = FusedAdamW(params, backend="torch", state_dtype="8bit", min_8bit_size=1)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        assert len(calls) == expected
    assert _heap._malloc_trim() is not None  # glibc on the machines this runs on: the trim is real


def test_without_malloc_trim_the_release_does_nothing(monkeypatch):
    from fasttrain.optim import _heap

    monkeypatch.setattr(_heap, "_malloc_trim", lambda: None)
    _heap.release_free_heap()  # no C library call, no error
