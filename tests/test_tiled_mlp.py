"""The tiled decoder MLP (fasttrain.tiling.mlp): its output and every gradient bounded by the truth, and the
behaviour around it (below the threshold bit for bit, checkpointing, one gradient accumulation per parameter).

Each value is compared with the plain MLP run in float64 (the truth): the tiled MLP may be at most ``k`` times as
far from it as the plain MLP in the same dtype, plus a floor (tests/_truth_ops.py).
"""

from __future__ import annotations

import copy
import logging
import math
import types

import pytest
import torch
import transformers
from torch.utils.checkpoint import checkpoint

import _tiny as tiny
import _truth
import fasttrain
from _truth_ops import assert_all_truth
from fasttrain.integration.tiling import chunk_tokens, engine_problem
from fasttrain.tiling import TiledMLP, disable_tiled_mlp, enable_tiled_mlp, tiled_mlp_calls

pytestmark = pytest.mark.numeric

# fp32: the same arithmetic, the parameters' gradients summed chunk by chunk (another order of summation): twice the
# plain MLP's distance to float64, plus 4 fp32 roundings of the value where the plain one lands on it by chance.
FP32 = {"k": 2.0, "ulps": 4.0}
# bf16 or fp16 (autocast or stored): both round the projections' inputs and outputs to the half dtype; a chunk's
# parameter gradient is rounded to it before the sum (stored) where the plain one is rounded once: twice the plain
# MLP's distance plus 1/2 ulp of the dtype (one more rounding of the sum, ours only).
HALF = {"k": 2.0, "ulps": 0.5}
BOUNDS = {"fp32": FP32, "autocast_bf16": HALF, "bf16": HALF, "autocast_fp16": HALF, "fp16": HALF}
STORED = {"bf16": torch.bfloat16, "fp16": torch.float16}
AUTOCAST = {"autocast_bf16": torch.bfloat16, "autocast_fp16": torch.float16}


class Layer(torch.nn.Module):
    """A decoder layer's seat of the MLP: ``enable_tiled_mlp`` looks for modules held as ``mlp``."""

    def __init__(self, hidden: int = 32, intermediate: int = 64, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        config = transformers.Qwen3Config(
            hidden_size=hidden, intermediate_size=intermediate, hidden_act="silu"
        )
        self.mlp = transformers.models.qwen3.modeling_qwen3.Qwen3MLP(config)
        for p in self.mlp.parameters():  # weights of the scale a trained MLP has (the default init is 0.02)
            torch.nn.init.normal_(p, std=hidden**-0.5)

    def forward(self, x):
        return self.mlp(x)


def _grads(module: torch.nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor | None]:
    return {"input": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def _run(module, x, grad, dtype_case, through=None):
    x = x.clone().requires_grad_()
    autocast = AUTOCAST.get(dtype_case)
    with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        y = module(x) if through is None else through(module, x)
    y.backward(grad.to(y.dtype))
    return y.detach(), _grads(module, x)


def _three(dtype_case: str, chunk: int, min_tokens: int = 0, **layer):
    """The truth (float64), the reference (plain, in the case's dtype) and ours (tiled)."""
    ref = Layer(**layer)
    if dtype_case in STORED:
        ref = ref.to(STORED[dtype_case])
    truth = copy.deepcopy(ref).double()  # the weights the others hold, rounded to bf16/fp16 ones included
    ours = copy.deepcopy(ref)
    assert enable_tiled_mlp(ours, chunk_tokens=chunk, min_tokens=min_tokens) == 1
    return truth, ref, ours


def _inputs(shape, hidden, dtype_case, seed=1):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, hidden, generator=generator)
    grad = torch.randn(*shape, hidden, generator=generator)
    if dtype_case in STORED:
        x, grad = x.to(STORED[dtype_case]), grad.to(STORED[dtype_case])
    return x, grad


def _check_against_truth(dtype_case, chunk, shape, hidden=32, intermediate=64, through=None, min_tokens=0):
    truth, ref, ours = _three(dtype_case, chunk, min_tokens, hidden=hidden, intermediate=intermediate)
    x, grad = _inputs(shape, hidden, dtype_case)
    y_truth, g_truth = _run(truth, x.double(), grad.double(), "fp64", through)
    y_ref, g_ref = _run(ref, x, grad, dtype_case, through)
    calls = tiled_mlp_calls(ours)
    y_ours, g_ours = _run(ours, x, grad, dtype_case, through)
    assert tiled_mlp_calls(ours) > calls, "the MLP did not run tiled"
    assert y_ours.dtype == y_ref.dtype and y_ours.shape == y_ref.shape
    triples = [("output", y_ours, y_ref, y_truth)]
    triples += [(name, g_ours[name], g_ref[name], g_truth[name]) for name in g_truth]
    for name, ours_t, ref_t, _ in triples:
        assert ours_t.dtype == ref_t.dtype, name
        assert torch.isfinite(ours_t).all(), name
    assert_all_truth(triples, **BOUNDS[dtype_case], what=f"{dtype_case} chunk {chunk}")
    return ours


@pytest.mark.parametrize("dtype_case", list(BOUNDS))
@pytest.mark.parametrize("chunk", [7, 256, 1000, 1024, 2999])
def test_chunks_match_truth(dtype_case, chunk):
    # 2 x 1500 = 3000 rows: 1000 divides them, 7, 256, 1024 and 2999 leave a shorter last chunk
    _check_against_truth(dtype_case, chunk, (2, 1500))


@pytest.mark.parametrize("dtype_case", list(BOUNDS))
@pytest.mark.parametrize("chunk", [1000, 4096])
def test_long_sequence_tiny_width(dtype_case, chunk):
    _check_against_truth(dtype_case, chunk, (1, 8192), hidden=32, intermediate=64)


@pytest.mark.parametrize("shape", [(3, 2, 101), (301,)])
def test_leading_dims(shape):
    _check_against_truth("fp32", 64, shape)


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("dtype_case", ["fp32", "autocast_bf16"])
def test_inside_checkpoint(dtype_case, use_reentrant):
    def through(module, x):
        return checkpoint(module, x, use_reentrant=use_reentrant)

    _check_against_truth(dtype_case, 100, (2, 333), through=through)


@pytest.mark.parametrize("use_reentrant", [None, False, True])
def test_one_accumulation_per_parameter(use_reentrant):
    """A post-accumulate-grad hook (fasttrain's optimizer step in backward, DDP's reducer) fires once per parameter
    and backward, with the whole gradient, however many chunks the backward ran."""
    *_, ours = _three("fp32", 100, 0)
    seen: dict[str, list[torch.Tensor]] = {}
    for name, p in ours.named_parameters():
        p.register_post_accumulate_grad_hook(
            lambda p, name=name: seen.setdefault(name, []).append(p.grad.clone())
        )
    x, grad = _inputs((2, 1000), 32, "fp32")
    for backward in range(2):
        seen.clear()
        ours.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = ours(xi) if use_reentrant is None else checkpoint(ours, xi, use_reentrant=use_reentrant)
        y.backward(grad)
        assert {name: len(calls) for name, calls in seen.items()} == dict.fromkeys(
            (name for name, _ in ours.named_parameters()), 1
        ), backward
        for name, p in ours.named_parameters():
            assert torch.equal(seen[name][0], p.grad), name  # the hook saw the final gradient


def test_tensor_hooks_see_one_gradient():
    """A hook on a parameter (``Tensor.register_hook``) sees its whole gradient once per backward, as for the plain
    module (the recomputation differentiates aliases of the parameters, not the parameters)."""
    *_, ours = _three("fp32", 100, 0)
    seen: dict[str, int] = {}
    for name, p in ours.named_parameters():
        p.register_hook(lambda grad, name=name: seen.__setitem__(name, seen.get(name, 0) + 1))
    x, grad = _inputs((2, 1000), 32, "fp32")
    ours(x.requires_grad_()).backward(grad)
    assert seen == dict.fromkeys((name for name, _ in ours.named_parameters()), 1)


def test_saves_only_its_input():
    """What the forward keeps for the backward: the plain MLP keeps [tokens, intermediate] tensors, the tiled one
    only its input (the memory it removes)."""
    _, ref, ours = _three("fp32", 256, 0)
    x, _ = _inputs((2, 1000), 32, "fp32")
    for module, most in ((ref, None), (ours, 2000 * 32)):
        shapes = []

        def pack(t, shapes=shapes):
            shapes.append(tuple(t.shape))
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(x.clone().requires_grad_())
        saved = sum(math.prod(shape) for shape in shapes)
        if most is None:
            assert saved >= 3 * 2000 * 64, shapes  # gate, up and their product at least
        else:
            assert saved <= most, shapes


def test_below_threshold_is_the_plain_module_bit_for_bit():
    _, ref, ours = _three("fp32", 64, min_tokens=2000)
    for shape in [(2, 1000), (2000,), (1, 5)]:  # 2000 tokens: not above the threshold
        x, grad = _inputs(shape, 32, "fp32")
        ref.zero_grad(set_to_none=True)
        ours.zero_grad(set_to_none=True)
        y_ref, g_ref = _run(ref, x, grad, "fp32")
        y_ours, g_ours = _run(ours, x, grad, "fp32")
        assert torch.equal(y_ours, y_ref)
        for name in g_ref:
            assert torch.equal(g_ours[name], g_ref[name]), name
    assert tiled_mlp_calls(ours) == 0
    x, grad = _inputs((1, 2001), 32, "fp32")
    _run(ours, x, grad, "fp32")
    assert tiled_mlp_calls(ours) == 1


def test_eval_under_no_grad_runs_plain():
    _, ref, ours = _three("fp32", 16, 0)
    ref.eval()
    ours.eval()
    x, _ = _inputs((2, 300), 32, "fp32")
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    with torch.inference_mode():
        assert torch.equal(ours(x), ref(x))
    assert tiled_mlp_calls(ours) == 0


def test_frozen_parameter():
    truth, ref, ours = _three("fp32", 100, 0)
    for module in (truth, ref, ours):
        module.mlp.gate_proj.weight.requires_grad_(False)
    x, grad = _inputs((2, 500), 32, "fp32")
    y_truth, g_truth = _run(truth, x.double(), grad.double(), "fp64")
    y_ref, g_ref = _run(ref, x, grad, "fp32")
    y_ours, g_ours = _run(ours, x, grad, "fp32")
    assert tiled_mlp_calls(ours) == 1
    assert g_ours["mlp.gate_proj.weight"] is None
    names = [n for n in g_truth if g_truth[n] is not None]
    assert_all_truth(
        [("output", y_ours, y_ref, y_truth), *[(n, g_ours[n], g_ref[n], g_truth[n]) for n in names]], **FP32
    )


def test_input_without_grad_and_frozen_mlp():
    truth, ref, ours = _three("fp32", 100, 0)
    x, grad = _inputs((2, 500), 32, "fp32")
    for module, dtype in ((truth, torch.float64), (ref, torch.float32), (ours, torch.float32)):
        # the input needs no gradient: only the parameters get one
        module(x.to(dtype)).backward(grad.to(dtype))
    assert tiled_mlp_calls(ours) == 1
    grads = [dict(m.named_parameters()) for m in (ours, ref, truth)]
    assert_all_truth([(n, grads[0][n].grad, grads[1][n].grad, grads[2][n].grad) for n in grads[0]], **FP32)
    ours.requires_grad_(False)
    assert ours(x).grad_fn is None  # nothing needs a gradient: the plain forward
    assert tiled_mlp_calls(ours) == 1


def test_backward_recomputes_under_the_forwards_autocast():
    """The recomputation in backward runs in the dtype the forward ran in (bf16 here), whatever autocast is in force
    where ``backward()`` is called (DeepSpeed's and Liger's tiled MLPs recompute in fp32 there)."""
    _, _, ours = _three("fp32", 100, 0)
    dtypes = []
    ours.mlp.down_proj.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
    x, _ = _inputs((1, 300), 32, "fp32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ours(x.requires_grad_())
    y.float().sum().backward()
    assert dtypes == [torch.bfloat16] * 6  # 3 chunks forward, 3 again in backward


def test_lora_projections():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"])
    ref = peft.get_peft_model(Layer(), config)
    with torch.no_grad():  # LoRA's B starts at zero: give it a value
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    truth, ours = copy.deepcopy(ref).double(), copy.deepcopy(ref)
    assert enable_tiled_mlp(ours, chunk_tokens=100, min_tokens=0) == 1
    x, grad = _inputs((2, 500), 32, "fp32")
    y_truth, g_truth = _run(truth, x.double(), grad.double(), "fp64")
    y_ref, g_ref = _run(ref, x, grad, "fp32")
    y_ours, g_ours = _run(ours, x, grad, "fp32")
    assert tiled_mlp_calls(ours) == 1
    trained = [n for n in g_truth if g_truth[n] is not None]
    assert len(trained) == 1 + 6  # the input and A, B of three projections; the base weights are frozen
    assert_all_truth(
        [("output", y_ours, y_ref, y_truth), *[(n, g_ours[n], g_ref[n], g_truth[n]) for n in trained]], **FP32
    )


@pytest.mark.parametrize("dtype_case", ["fp32", "autocast_bf16"])
def test_lora_dropout_replays_its_masks(dtype_case):
    """LoRA's dropout in training: the tiled forward draws a mask per chunk and the backward replays the same draws.
    The reference and the truth run the plain module over the same chunks in the same order from the same seed
    (so they draw the same masks); the output equals the reference's bit for bit, the gradients are bounded by the
    truth, and the generator ends where the reference's does (the replay leaves it as it was)."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj"], lora_dropout=0.3
    )
    ref = peft.get_peft_model(Layer(), config)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    truth, ours = copy.deepcopy(ref).double(), copy.deepcopy(ref)
    for module in (truth, ref, ours):
        module.train()
    assert enable_tiled_mlp(ours, chunk_tokens=100, min_tokens=0) == 1

    def chunkwise(module, x):  # the plain MLP over the chunks the tiled one takes, in its order
        mlp = module.base_model.model.mlp
        return torch.cat([mlp(part) for part in x.reshape(-1, 32).split(100)]).view(x.shape)

    def seeded(module, x):
        torch.manual_seed(5)
        return module(x) if module is ours else chunkwise(module, x)

    x, grad = _inputs((2, 450), 32, "fp32")
    y_truth, g_truth = _run(truth, x.double(), grad.double(), "fp64", seeded)
    y_ref, g_ref = _run(ref, x, grad, dtype_case, seeded)
    after_ref = torch.get_rng_state()
    y_ours, g_ours = _run(ours, x, grad, dtype_case, seeded)
    assert torch.equal(torch.get_rng_state(), after_ref)
    assert tiled_mlp_calls(ours) == 1
    assert torch.equal(y_ours, y_ref)
    trained = [n for n in g_truth if g_truth[n] is not None]
    assert_all_truth(
        [("output", y_ours, y_ref, y_truth), *[(n, g_ours[n], g_ref[n], g_truth[n]) for n in trained]],
        **BOUNDS[dtype_case],
    )


def test_gathered_parameters_run_plain():
    """Parameters gathered by module hooks (a ZeRO-3 partition, FSDP1's views in place of the parameters) would not
    be there, or not be differentiated, in the recomputation: those calls run the plain forward."""
    _, ref, ours = _three("fp32", 100, 0)
    x, grad = _inputs((2, 500), 32, "fp32")
    ours.mlp.up_proj.weight.ds_id = 7
    _run(ours, x, grad, "fp32")
    assert tiled_mlp_calls(ours) == 0
    del ours.mlp.up_proj.weight.ds_id
    view = (
        ours.mlp.down_proj.weight * 1.0
    )  # a tensor read in place of the parameter, as FSDP1 sets in the forward
    del ours.mlp.down_proj.weight
    ours.mlp.down_proj.weight = view
    ref.zero_grad(set_to_none=True)
    y_ref, _ = _run(ref, x, grad, "fp32")
    y_ours, _ = _run(ours, x, grad, "fp32")
    assert tiled_mlp_calls(ours) == 0
    assert torch.equal(y_ours, y_ref)
    assert ours.mlp.gate_proj.weight.grad is not None


@pytest.mark.parametrize(
    ("fsdp", "deepspeed", "problem"),
    [
        (False, None, None),
        (False, {"zero_optimization": {"stage": 2}}, None),
        (False, {"zero_optimization": {"stage": 3}}, "DeepSpeed ZeRO-3"),
        (True, None, "FSDP"),
    ],
)
def test_engines_that_gather_in_hooks_leave_the_mlps_plain(fsdp, deepspeed, problem):
    said = engine_problem(
        types.SimpleNamespace(is_fsdp_enabled=fsdp), types.SimpleNamespace(deepspeed=deepspeed)
    )
    assert said is None if problem is None else said.startswith(problem)


def test_last_projection_not_recomputed():
    """The recomputation stands in for down_proj's product (the backward needs only its input): its output in the
    backward comes from the deferred linear, and the gradients are the truth's (test_chunks_match_truth)."""
    *_, ours = _three("fp32", 100, 0)
    made_by = []
    ours.mlp.down_proj.register_forward_hook(
        lambda module, args, out: made_by.append(out.grad_fn and out.grad_fn.name())
    )
    x, grad = _inputs((1, 300), 32, "fp32")
    ours(x.requires_grad_()).backward(grad)
    assert (
        made_by == [None] * 3 + ["_DeferredLinearBackward"] * 3
    )  # 3 chunks under no_grad, then 3 in backward


@pytest.mark.parametrize("dtype_case", ["fp32", "autocast_bf16"])
def test_more_after_the_last_projection(dtype_case):
    """An MLP that does more with down_proj's output than return it: the chunks are recomputed whole."""

    class Scaled(transformers.models.qwen3.modeling_qwen3.Qwen3MLP):
        def forward(self, x):
            return super().forward(x) * 2

    def scaled(layer):
        scaled_mlp = Scaled(transformers.Qwen3Config(hidden_size=32, intermediate_size=64))
        scaled_mlp.to(layer.mlp.down_proj.weight.dtype).load_state_dict(layer.mlp.state_dict())
        layer.mlp = scaled_mlp
        return layer

    truth, ref, ours = (scaled(m) for m in _three(dtype_case, 100, 0))
    assert enable_tiled_mlp(ours, chunk_tokens=100, min_tokens=0) == 1
    x, grad = _inputs((2, 450), 32, dtype_case)
    y_truth, g_truth = _run(truth, x.double(), grad.double(), "fp64")
    y_ref, g_ref = _run(ref, x, grad, dtype_case)
    y_ours, g_ours = _run(ours, x, grad, dtype_case)
    assert tiled_mlp_calls(ours) == 1
    assert_all_truth(
        [("output", y_ours, y_ref, y_truth), *[(n, g_ours[n], g_ref[n], g_truth[n]) for n in g_truth]],
        **BOUNDS[dtype_case],
    )


def test_other_projections_stay_plain():
    class Scaled(torch.nn.Linear):
        pass

    layer = Layer()
    layer.mlp.up_proj = Scaled(32, 64, bias=False)
    assert enable_tiled_mlp(layer) == 0
    assert "forward" not in layer.mlp.__dict__


def test_disable_restores_the_forward():
    layer = Layer()
    assert enable_tiled_mlp(layer, chunk_tokens=10, min_tokens=0) == 1
    assert "forward" in layer.mlp.__dict__
    disable_tiled_mlp(layer)
    assert "forward" not in layer.mlp.__dict__
    assert tiled_mlp_calls(layer) == 0


def test_function_chunks_nothing_twice():
    """``TiledMLP`` on its own: each row computed once forward (counted), and the last, shorter chunk included."""
    rows = []
    weight = torch.randn(5, 3, requires_grad=True)

    def run(x):
        rows.append(x.shape[0])
        return x @ weight.t()

    x = torch.randn(2, 11, 3, requires_grad=True)
    y = TiledMLP.apply(run, 4, x, weight)
    assert rows == [4, 4, 4, 4, 4, 2] and y.shape == (2, 11, 5)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(weight.grad, torch.ones(22, 5).t() @ x.detach().reshape(22, 3))
    torch.testing.assert_close(x.grad, torch.ones(2, 11, 5) @ weight.detach())


# ---- through a Trainer: FASTTRAIN_TILED_MLP -------------------------------------------------------------------


def _train(trainer_cls, tmp_path, name, truth=False, **arg_overrides):
    tok = tiny.tokenizer()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny.config("qwen3", max_position_embeddings=256))
    if truth:
        model = _truth.float64_twin(model)
    trainer = trainer_cls(
        model=model,
        args=tiny.training_args(str(tmp_path / name), **{"max_steps": 4, **arg_overrides}),
        train_dataset=tiny.dataset(n=16, min_len=100, max_len=200),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    trainer.train()
    return trainer


@pytest.mark.parametrize(("gradient_checkpointing", "bf16"), [(False, False), (True, False), (False, True)])
def test_trainer_steps_near_truth(tmp_path, monkeypatch, caplog, gradient_checkpointing, bf16):
    """fasttrain.Trainer with FASTTRAIN_TILED_MLP=64 (micro-batches of 400 to 800 tokens: every MLP tiled) against
    the same Trainer without it: loss and grad_norm at every step, and the trained weights, as close to the float64
    plain Trainer as the untiled run is; the status line names the path with its evidence. bf16: autocast, the truth
    without it (as tests/test_trainer_parity.py)."""
    common = dict(gradient_checkpointing=gradient_checkpointing)
    truth = _train(transformers.Trainer, tmp_path, "truth", truth=True, **common)
    common["bf16"] = bf16
    ref = _train(fasttrain.Trainer, tmp_path, "ref", **common)
    monkeypatch.setenv("FASTTRAIN_TILED_MLP", "64")
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        ours = _train(fasttrain.Trainer, tmp_path, "ours", **common)
    if bf16:
        _truth.assert_logs_near_truth(ours, ref, truth, _truth.BF16_STEP, keys=("loss", "grad_norm"))
    else:
        _truth.assert_logs_near_truth(ours, ref, truth, _truth.FP32_STEP, keys=("loss", "grad_norm"))
        _truth.assert_params_near_truth(ours.model, ref.model, truth.model)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fasttrain hot paths:")]
    assert len(lines) == 1 and "tiled_mlp=on (2 MLPs, chunks of 64 tokens, " in lines[0], lines
    assert ours.fasttrain_status == ref.fasttrain_status  # the hot paths' own entries are unchanged
    assert all("forward" not in layer.mlp.__dict__ for layer in ours.model.model.layers)  # off after training


def test_trainer_below_threshold_says_so(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("FASTTRAIN_TILED_MLP", "100000")
    with caplog.at_level(logging.INFO, logger="fasttrain"):
        _train(fasttrain.Trainer, tmp_path, "ours", max_steps=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("fasttrain hot paths:")]
    assert len(lines) == 1 and "tiled_mlp=off: no micro-batch had more than 100000 tokens" in lines[0], lines


def test_env_setting(monkeypatch):
    for raw, expected in [("", None), ("off", None), ("0", None), ("on", 4096), ("1", 4096), ("2048", 2048)]:
        monkeypatch.setenv("FASTTRAIN_TILED_MLP", raw)
        assert chunk_tokens() == expected, raw
    for raw in ("-3", "lots"):
        monkeypatch.setenv("FASTTRAIN_TILED_MLP", raw)
        with pytest.raises(ValueError, match="FASTTRAIN_TILED_MLP"):
            chunk_tokens()
