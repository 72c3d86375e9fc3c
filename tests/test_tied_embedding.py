"""A tied embedding's gradient rows added into the head's gradient without a dense [V, H] copy
(``fasttrain.loss.tied_embedding``): the weight's gradient must be the reference's bit for bit (the same rows, summed
in the same order at the same precision, then one addition per element), dense, held in the head's gradient tensor
with no other weight-sized tensor made in the backward; without the head's gradient in the same backward, the
embedding's own dense one. Under a step inside backward the head's gradient is deferred to the embedding's backward:
the updates, optimizer states and logged norms must be those of the head's own gradient bit for bit (basis as is,
scaled, recomputed, chunked, ignored labels; fp32, fp16, bf16 with stochastic rounding and 8-bit moments), no
weight-sized tensor may be made before the embedding's backward, and a detached embedding must still get it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import _tiny
from fasttrain.loss import chunked_head, tied_embedding
from fasttrain.loss.function import fused_linear_cross_entropy
from fasttrain.loss.model_patch import disable_fused_loss, enable_fused_loss

pytestmark = pytest.mark.numeric  # half-precision sums: another instruction set rounds its own way

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class _TiedLM(nn.Module):
    """A tied embedding and a head: the loss reads the embedding's rows and the fused head's cross-entropy."""

    def __init__(self, vocab: int, hidden: int, dtype: torch.dtype, **embedding) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype, **embedding)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight

    def get_input_embeddings(self) -> nn.Module:
        return self.embed

    def get_output_embeddings(self) -> nn.Module:
        return self.head

    def loss(
        self,
        ids: torch.Tensor,
        head: bool = True,
        *,
        labels=None,
        chunk_rows=1 << 20,
        detach=False,
        mark=None,
    ) -> torch.Tensor:
        tied_embedding.forget(self)
        hidden = torch.tanh(self.embed(ids).float() * 3).to(self.embed.weight.dtype)
        if detach:  # the embedding's output reaches the loss through no gradient
            hidden = hidden.detach()
        if mark is not None:  # an identity whose backward runs after the head's, before the embedding's
            hidden = mark(hidden)
        if not head:
            return hidden.float().square().sum()
        weight = tied_embedding.expose(self, self.head.weight)
        labels = ids.roll(-1) if labels is None else labels
        return fused_linear_cross_entropy(hidden, weight, labels, chunk_rows=chunk_rows)


def _ids(vocab: int) -> torch.Tensor:
    # many repeats of a few tokens: the order and precision of each row's sum show in half precision
    g = torch.Generator().manual_seed(1)
    return torch.cat([torch.randint(0, 8, (200,), generator=g), torch.randint(0, vocab, (56,), generator=g)])


def _weight_grad(model: _TiedLM, ids: torch.Tensor, *, rows_path: bool, head: bool = True) -> torch.Tensor:
    model.embed.weight.grad = None
    if rows_path:
        tied_embedding.install(model)
    try:
        model.loss(ids, head).backward()
    finally:
        tied_embedding.uninstall(model)
    return model.embed.weight.grad


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "embedding", [{}, {"padding_idx": 3}, {"padding_idx": 500}, {"scale_grad_by_freq": True}], ids=str
)
def test_weight_gradient_is_the_references_bit_for_bit(dtype, embedding):
    model = _TiedLM(509, 24, dtype, **embedding)
    ids = _ids(509)
    reference = _weight_grad(model, ids, rows_path=False)
    ours = _weight_grad(model, ids, rows_path=True)
    assert ours.layout == torch.strided
    assert torch.equal(ours, reference)


def test_rows_are_summed_as_the_reference_sums_them():
    # a sum of each row's occurrences in fp32, rounded once, is closer to the truth but not the reference's:
    # the bf16 data must tell the two apart, or the bit-for-bit test above could not catch a changed order
    grad = torch.randn(256, 24, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    ids = _ids(509)
    reference = torch.ops.aten.embedding_dense_backward(grad, ids, 509, -1, False)
    widened = torch.zeros(509, 24).index_add_(0, ids, grad.float()).to(torch.bfloat16)
    assert not torch.equal(reference, widened)


def test_the_heads_gradient_tensor_becomes_the_weights_and_nothing_weight_sized_is_made(monkeypatch):
    vocab, hidden = 4099, 16
    model = _TiedLM(vocab, hidden, torch.bfloat16)
    ids = _ids(vocab)

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.made: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.shape == (vocab, hidden):
                inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
                if out.untyped_storage().data_ptr() not in inputs:  # not in place, not a view
                    self.made.append(func._schema.name)
            return out

    def backward_allocations(rows_path: bool) -> list[str]:
        model.embed.weight.grad = None
        if rows_path:
            tied_embedding.install(model)
        try:
            loss = model.loss(ids)
            with Allocations() as seen:
                loss.backward()
        finally:
            tied_embedding.uninstall(model)
        return seen.made

    assert "aten::embedding_dense_backward" in backward_allocations(rows_path=False)  # the reference's copy
    assert backward_allocations(rows_path=True) == []

    produced = []  # where the head's gradient is (computed in the forward, handed over by the backward)
    finish = chunked_head._Grads.finish

    def spy(self, *args):
        grads = finish(self, *args)
        produced.append(
            grads[1].data_ptr()
        )  # not the tensor: a reference held here would make autograd copy it
        return grads

    monkeypatch.setattr(chunked_head._Grads, "finish", spy)
    assert _weight_grad(model, ids, rows_path=True).data_ptr() == produced[-1]


def test_without_the_heads_gradient_the_embedding_gives_its_dense_one():
    model = _TiedLM(509, 24, torch.float32)
    ids = _ids(509)
    grad = _weight_grad(model, ids, rows_path=True, head=False)  # the head is not in this backward
    assert grad.layout == torch.strided
    assert torch.equal(grad, _weight_grad(model, ids, rows_path=False, head=False))


def test_empty_batch():
    model = _TiedLM(509, 24, torch.bfloat16)
    ids = torch.zeros(0, dtype=torch.long)
    reference = _weight_grad(model, ids, rows_path=False)
    assert torch.equal(_weight_grad(model, ids, rows_path=True), reference)


def test_untied_models_are_left_alone():
    model = _tiny.model("qwen3")  # untied
    assert tied_embedding.tied_embedding(model) is None
    assert not tied_embedding.install(model)
    assert "forward" not in model.get_input_embeddings().__dict__


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_model_gradients_equal_the_model_without_the_rows_path(dtype):
    # the causal LM through the fused loss, tied: every gradient equals the one with the embedding's dense path
    torch.manual_seed(0)
    model = _tiny.model("qwen3", dtype=dtype)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert tied_embedding.tied_embedding(model) is not None
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, _tiny.VOCAB, (2, 40), generator=g)
    ids[:, :20] = ids[:, :1]  # repeated tokens

    def grads(rows_path: bool) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        enable_fused_loss(model)
        if not rows_path:
            tied_embedding.uninstall(model)
        try:
            model.train()
            model(input_ids=ids, labels=ids).loss.backward()
        finally:
            disable_fused_loss(model)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference, ours = grads(False), grads(True)
    assert "forward" not in model.get_input_embeddings().__dict__  # disable took it off
    assert reference.keys() == ours.keys()
    for name in reference:
        assert ours[name].layout == torch.strided
        assert torch.equal(ours[name], reference[name]), name


def test_an_embedding_with_its_own_instance_forward_is_left_alone():
    model = _TiedLM(509, 24, torch.float32)
    theirs = model.embed.forward = lambda ids: nn.Embedding.forward(model.embed, ids) * 2
    assert not tied_embedding.install(model)
    tied_embedding.uninstall(model)
    assert model.embed.forward is theirs


# -- the head's gradient deferred to the embedding's backward (a step inside backward) ----------------------------

DEFERRED_CASES = {
    # (weight dtype, FusedAdamW options, vocabulary rows per block or None: the default blocks)
    "fp32": (torch.float32, {}, None),  # fp32 products: made whole (no block-wise step)
    "bf16-sr-8bit": (torch.bfloat16, {"bf16_stochastic_rounding": True, "state_dtype": "8bit"}, None),
    "fp16": (torch.float16, {"state_dtype": "float32"}, None),
    # blocks of 32 rows (768 elements, three 256-element staged pieces; 16 blocks, the last short)
    "bf16-sr-8bit-blocks": (torch.bfloat16, {"bf16_stochastic_rounding": True, "state_dtype": "8bit"}, 768),
    # a 256-element piece is not a multiple of the 768-element block: the whole gradient
    "bf16-sr-8bit-unaligned": (
        torch.bfloat16,
        {"bf16_stochastic_rounding": True, "state_dtype": "8bit"},
        -768,
    ),
}
# how the loss reaches backward: the mean (the forward's basis as is), twice it (the basis scaled by 2: exact),
# three times it (not a power of two: the backward recomputes), in chunks of 64 tokens, with ignored labels
LOSS_FORMS = ["mean", "twice", "thrice", "chunks", "ignored"]


def _small_blocks(monkeypatch, block: int | None) -> None:
    """Blocks of ``abs(block)`` elements; staged pieces of the same (block > 0) or of 256 elements (block < 0)."""
    from fasttrain.optim import _torch_step

    if block is not None:
        monkeypatch.setattr(chunked_head, "WEIGHT_BLOCK_ELEMENTS", abs(block))
        monkeypatch.setattr(_torch_step, "STAGE_ELEMENTS", block if block > 0 else 256 * 5)


def _deferred_run(dtype, options, form: str, *, defer: bool, steps: int = 3, detach: bool = False):
    """(weight, optimizer state of the weight, logged norms, {"whole": gradients made whole later, "blocks": blocks
    made}) after ``steps`` backwards stepped inside backward, with the head's gradient deferred or (as before)
    made at its own."""
    from fasttrain import FusedAdamW
    from fasttrain.optim.in_backward import step_in_backward

    model = _TiedLM(509, 24, dtype)
    opt = FusedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1, min_8bit_size=64, **options)
    made = {"whole": 0, "blocks": 0}
    original_weight_grad, original_steps = chunked_head._weight_grad, tied_embedding._steps_in_backward
    original_iter = chunked_head.RowBlocks.__iter__

    def counted(*args):
        made["whole"] += 1
        return original_weight_grad(*args)

    def counted_blocks(self):
        for block in original_iter(self):
            made["blocks"] += 1
            yield block

    chunked_head._weight_grad, chunked_head.RowBlocks.__iter__ = counted, counted_blocks
    if not defer:
        tied_embedding._steps_in_backward = lambda weight: False
    handle = step_in_backward(opt)
    tied_embedding.install(model)
    norms = []
    try:
        for step in range(steps):
            ids = _ids(509).roll(step)
            labels = ids.roll(-1)
            if form == "ignored":
                labels[::3] = -100
            loss = model.loss(
                ids, labels=labels, chunk_rows=64 if form == "chunks" else 1 << 20, detach=detach
            )
            loss = {"twice": 2 * loss, "thrice": 3 * loss}.get(form, loss)
            loss.backward()
            assert model.embed.weight.grad is None  # stepped in backward and freed
            norms.append(handle.grad_norm(torch.float64).item())
            handle.reset_grad_norm()
    finally:
        chunked_head._weight_grad, tied_embedding._steps_in_backward = original_weight_grad, original_steps
        chunked_head.RowBlocks.__iter__ = original_iter
        handle.remove()
        tied_embedding.uninstall(model)
    weight = model.embed.weight.detach()
    return weight, opt.state[model.embed.weight], norms, made


def _expected_made(case: str, form: str, steps: int = 3) -> dict[str, int]:
    """Where the deferred gradient is made: one chunk of half-precision products a block at a time, where the
    optimizer's step can be cut into those blocks; else whole."""
    dtype, options, block = DEFERRED_CASES[case]
    staged = (
        options.get("state_dtype") in ("8bit", "float32") and dtype != torch.float32
    )  # not torch's own kernel
    blockwise = staged and form != "chunks"
    if not blockwise or (block is not None and block < 0):
        return {"whole": steps, "blocks": 0}
    per_step = 1 if block is None else -(-509 // (block // 24))
    return {"whole": 0, "blocks": steps * per_step}


@pytest.mark.parametrize("form", LOSS_FORMS)
@pytest.mark.parametrize("case", list(DEFERRED_CASES))
def test_deferred_head_gradient_steps_as_the_heads_own(monkeypatch, case, form):
    dtype, options, block = DEFERRED_CASES[case]
    _small_blocks(monkeypatch, block)
    ours, our_state, our_norms, made = _deferred_run(dtype, options, form, defer=True)
    ref, ref_state, ref_norms, made_before = _deferred_run(dtype, options, form, defer=False)
    assert made == _expected_made(case, form)
    assert made_before == {"whole": 0, "blocks": 0}  # without the deferral: at the head's own backward
    assert torch.equal(ours, ref)
    assert our_state.keys() == ref_state.keys()
    for key in our_state:
        assert torch.equal(our_state[key], ref_state[key]), key
    assert our_norms == ref_norms  # the same gradients summed in the same order: the same norm, bit for bit


def test_weight_blocks_are_the_optimizers_staged_batches():
    from fasttrain.optim import _torch_step

    assert chunked_head.WEIGHT_BLOCK_ELEMENTS == _torch_step.STAGE_ELEMENTS
    for hidden in (24, 1024, 2560, 4096, 5120, 3 * 7 * 11):
        rows = chunked_head.weight_block_rows(hidden)
        assert rows * hidden % _torch_step.STAGE_ELEMENTS == 0


@pytest.mark.parametrize("form", LOSS_FORMS)
def test_a_detached_embedding_still_gets_the_heads_gradient(form):
    # the embedding's backward never runs: the end of the backward adds the deferred gradient and steps. The
    # forward then folds nothing (the hidden states need no gradient), and the deferred gradient must still be
    # made by the formula the reference uses: its basis' where the upstream was predicted, a recompute's where not
    # (once the basis' was replaced by the recompute's: 1-ulp differences in the logged norm, seen at the third step)
    dtype, options, _ = DEFERRED_CASES["bf16-sr-8bit"]
    ours, _, our_norms, made = _deferred_run(dtype, options, form, defer=True, detach=True)
    ref, _, ref_norms, _ = _deferred_run(dtype, options, form, defer=False, detach=True)
    assert made == {"whole": 3, "blocks": 0}
    assert torch.equal(ours, ref) and our_norms == ref_norms


class _Mark(torch.autograd.Function):
    """An identity whose backward notes when it ran in the dispatch log."""

    @staticmethod
    def forward(ctx, x, log):  # type: ignore[override]
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        ctx.log.append("mark")
        return grad, None


@pytest.mark.parametrize("block", [None, 256], ids=["one-block", "blocks-of-16-rows"])
def test_no_weight_sized_gradient_exists_before_the_embeddings_backward(monkeypatch, block):
    from fasttrain import FusedAdamW
    from fasttrain.optim.in_backward import step_in_backward

    vocab, hidden = 4099, 16
    _small_blocks(monkeypatch, block)

    class Log(TorchDispatchMode):
        def __init__(self, log: list[str]) -> None:
            super().__init__()
            self.log = log

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            # a gradient's shape and dtype (the 8-bit moments made at the first step are uint8)
            if isinstance(out, torch.Tensor) and out.shape == (vocab, hidden) and out.is_floating_point():
                inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
                if out.untyped_storage().data_ptr() not in inputs:  # made, not a view or in place
                    self.log.append(func._schema.name)
            return out

    def step_log(in_backward: bool) -> list[str]:
        model = _TiedLM(vocab, hidden, torch.bfloat16)
        opt = FusedAdamW(model.parameters(), lr=1e-2, state_dtype="8bit", bf16_stochastic_rounding=True)
        handle = step_in_backward(opt) if in_backward else None
        tied_embedding.install(model)
        log: list[str] = []
        try:
            with Log(log):
                model.loss(_ids(vocab), mark=lambda x: _Mark.apply(x, log)).backward()
        finally:
            tied_embedding.uninstall(model)
            if handle is not None:
                handle.remove()
        return log

    ours, before = step_log(True), step_log(False)
    # without the step inside backward the head's gradient is made in the forward's basis, before the mark
    assert before.index("mark") > 0
    if block is None:  # one block, the whole weight: made after the mark, at the embedding's backward
        assert ours[0] == "mark" and len(ours) > 1
    else:  # blocks of 16 rows: no weight-sized tensor at all
        assert ours == ["mark"]


def test_frees_gradient_in_backward_reads_the_handle_now():
    from fasttrain import FusedAdamW
    from fasttrain.optim.in_backward import frees_gradient_in_backward, step_in_backward

    model = _TiedLM(61, 8, torch.float32)
    weight, outsider = model.embed.weight, nn.Parameter(torch.zeros(3))
    opt = FusedAdamW(model.parameters(), lr=1e-2)
    assert not frees_gradient_in_backward(weight)  # no handle
    syncing = [False]
    handle = step_in_backward(opt, armed=lambda: syncing[0])
    try:
        assert not frees_gradient_in_backward(weight)  # an accumulating backward keeps every gradient
        syncing[0] = True
        assert frees_gradient_in_backward(weight)
        assert not frees_gradient_in_backward(outsider)  # not this optimizer's
    finally:
        handle.remove()
    assert not frees_gradient_in_backward(weight)  # removed
