"""TRL's SFTTrainer and DPOTrainer with ``fasttrain.integration.loss_trl.enable``: the loss and every
logged metric are as close to the truth as the unpatched TRL run at every step (fp32), TRL's own kernel and the
lm_head module are not called, and ``fused_calls`` counts the forwards that took fasttrain's kernel.

The truth is the unpatched TRL run in float64 from the same fp32 initial weights (tests/_truth_ops.py): all the
logged values of a run, each relative to its truth, form one vector, and ours may be at most ``K`` times as far
from the truth's as the reference's, plus a floor of fp32 roundings. Means of 0/1 hits (token accuracy, reward
accuracy) are compared where the reference and the truth agree (no hit was within rounding of its threshold).
TRL's fused head upcasts its logits tiles with ``.float()``: in the float64 run that head still computes in
fp32 (the backbone, the rest of the loss and the optimizer in float64). Single forwards are compared with
plain float64 logits instead.

The functions are called directly (not through ``fasttrain.patch()`` or ``fasttrain.Trainer``). Tiny models, 2-3 steps.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import _tiny
from _truth_ops import assert_truth, check_truth
from fasttrain.integration import loss_trl
from fasttrain.loss import trl_support

trl = pytest.importorskip("trl")
trl_utils = pytest.importorskip("trl.trainer.utils")

pytestmark = [pytest.mark.numeric, pytest.mark.trl]

# Runs of the same fp32 arithmetic, ours chunked: twice the reference's distance to the truth (a pooled vector of
# dozens of values, so the ratio of two rounding-noise norms concentrates), plus 16 fp32 roundings of each value
# (a training step chains hundreds of roundings; this floor only matters where the reference is exact by chance).
K = 2.0
ULPS = 16.0
EXACT = {"num_tokens", "epoch", "learning_rate"}  # counts and schedules, not numerics
HITS = {"mean_token_accuracy", "rewards/accuracies", "eval_mean_token_accuracy"}  # means of 0/1 hits
ZERO = 1e-6  # a value whose truth is exactly 0 is measured relative to 1e-6


def _magnitude(key, log, beta):
    """The magnitude a value's roundings scale with: its own, or for a DPO reward, beta * (policy log-prob -
    reference log-prob), that of the log-probs it is the difference of (rewards start at exactly 0)."""
    if key.startswith("rewards/") and "logps/chosen" in log:
        return max(abs(log[key]), beta * abs(log["logps/chosen"]), beta * abs(log["logps/rejected"]), ZERO)
    return max(abs(log[key]), ZERO)


class _Detectors:
    """Counts calls of TRL's ChunkedLogProbFunction and of every lm_head module's forward."""

    def __init__(self, monkeypatch):
        self.trl_kernel = 0
        self.lm_head = 0
        original = trl_utils._ChunkedLogProbFunction
        detector = self

        class Counting(original):
            @staticmethod
            def forward(ctx, *args, **kwargs):
                detector.trl_kernel += 1
                return original.forward(ctx, *args, **kwargs)

        monkeypatch.setattr(trl_utils, "_ChunkedLogProbFunction", Counting)

    def watch(self, *models):
        for model in models:
            if model is not None:
                model.get_output_embeddings().register_forward_hook(self._hit)

    def _hit(self, *_):
        self.lm_head += 1


def _train(make_trainer, enable, monkeypatch, truth=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's deprecation / padding-free notes
        trainer = make_trainer(truth)
    detectors = _Detectors(
        monkeypatch
    )  # counts from here: DPO may precompute reference log-probs in __init__
    if enable:
        assert loss_trl.enable(trainer) is None
        assert loss_trl.enable(trainer) is None  # idempotent
    detectors.watch(trainer.model, getattr(trainer, "ref_model", None))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return trainer, logs, detectors


def _compare(ref_logs, our_logs, truth_logs, must_have, min_logs=2, beta=None):
    assert len(ref_logs) == len(our_logs) == len(truth_logs) >= min_logs
    values, names = [], []  # (ours, reference, truth), relative to the truth
    for step, (a, b, t) in enumerate(zip(ref_logs, our_logs, truth_logs, strict=True), start=1):
        assert a.keys() == b.keys() == t.keys(), step
        assert must_have <= a.keys(), sorted(a)
        for key, expected in a.items():
            got, true = b[key], t[key]
            if key in HITS:
                if expected == true:  # no hit was within rounding of its threshold
                    assert got == expected, (step, key, got, expected, true)
            elif isinstance(expected, float) and math.isfinite(expected) and key not in EXACT:
                scale = _magnitude(key, t, beta)
                values.append([got / scale, expected / scale, true / scale])
                names.append(f"step {step} {key}: ours {got!r} ref {expected!r} f64 {true!r}")
            else:
                assert got == expected, (step, key)
    ours, ref, truth = torch.tensor(values, dtype=torch.float64).unbind(1)
    message = check_truth(ours, ref, truth, k=K, ulps=ULPS, dtype=torch.float32, what="logged values")
    worst = sorted(zip((ours - truth).abs().tolist(), names, strict=True), reverse=True)[:6]
    assert message is None, message + "\n  largest relative distances:\n  " + "\n  ".join(n for _, n in worst)


def _as_truth(model):
    """The float64 run starts from the same (fp32) initial weights."""
    return model.to(torch.float64)


def _run_both(make_trainer, monkeypatch, must_have, beta=None):
    # the truth first: each run's detector wraps TRL's kernel as the run before left it
    _, truth_logs, _ = _train(make_trainer, False, monkeypatch, truth=True)
    _, ref_logs, ref_det = _train(make_trainer, False, monkeypatch)
    trainer, our_logs, our_det = _train(make_trainer, True, monkeypatch)
    _compare(ref_logs, our_logs, truth_logs, must_have, beta=beta)
    assert ref_det.trl_kernel > 0  # the detector sees TRL's kernel when it runs ...
    assert our_det.trl_kernel == 0 and our_det.lm_head == 0  # ... and nothing but fasttrain's when enabled
    # every forward TRL's head served in the unpatched run took fasttrain's kernel instead
    assert loss_trl.fused_calls(trainer) == ref_det.trl_kernel
    return trainer


# ---------------------------------------------------------------------------------------------- SFTTrainer

SFT_METRICS = {"loss", "grad_norm", "entropy", "mean_token_accuracy", "num_tokens"}
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} [EOS] "
    "{% endgeneration %}{% else %}{{ m['content'] }} {% endif %}{% endfor %}"
)


def _sft_dataset(kind):
    ds = _tiny.text_dataset(n=24, seed=1)
    if kind == "text":
        return ds.select_columns(["text"])
    if kind == "prompt-completion":
        return ds.select_columns(["prompt", "chosen"]).rename_column("chosen", "completion")
    # conversational, for assistant_only_loss
    return ds.map(
        lambda r: {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["chosen"]},
                {"role": "user", "content": r["rejected"]},
                {"role": "assistant", "content": r["prompt"]},
            ]
        },
        remove_columns=ds.column_names,
    )


def _sft_factory(tmp_path, dataset="text", model="llama", with_eval=False, **config):
    def make(truth=False):
        tokenizer = _tiny.tokenizer()
        tokenizer.chat_template = CHAT_TEMPLATE
        settings = dict(
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            learning_rate=1e-3,
            max_length=48,
            disable_tqdm=True,
            dataloader_num_workers=0,
            bf16=False,  # TRL defaults to bf16 autocast, also on CPU: the comparison is in fp32
        )
        settings.update(config)
        data = _sft_dataset(dataset)
        return trl.SFTTrainer(
            model=_as_truth(_tiny.model(model)) if truth else _tiny.model(model),
            args=trl.SFTConfig(**settings),
            train_dataset=data,
            eval_dataset=data.select(range(8)) if with_eval else None,
            processing_class=tokenizer,
        )

    return make


@pytest.mark.parametrize(
    ("case", "dataset", "config"),
    [
        ("nll", "text", {}),
        ("chunked_nll", "text", {"loss_type": "chunked_nll"}),
        ("dft (non-uniform gradient)", "text", {"loss_type": "dft"}),
        ("completion-only", "prompt-completion", {}),
        ("assistant-only", "conversational", {"assistant_only_loss": True}),
        ("packing (padding-free, position_ids)", "text", {"packing": True}),
        ("padding_free", "prompt-completion", {"padding_free": True, "max_length": None}),
    ],
)
def test_sft_same_loss_and_metrics(case, dataset, config, tmp_path, monkeypatch):
    from fasttrain.loss import chunked_head

    speculation = []  # for each speculating backward: could it use the forward's gradients (exactly)?
    check = chunked_head._exact_ratio
    monkeypatch.setattr(
        chunked_head, "_exact_ratio", lambda *a: speculation.append(check(*a) is not None) or check(*a)
    )
    _run_both(_sft_factory(tmp_path, dataset, **config), monkeypatch, SFT_METRICS)
    if config.get("loss_type") == "dft":  # a per-token weight: no speculation, the backward recomputes
        assert speculation == []
    else:  # -sum(log_probs) / n: every backward used the gradients the forward computed
        assert speculation and all(speculation), speculation


def test_sft_qwen3_with_eval(tmp_path, monkeypatch):
    make = _sft_factory(
        tmp_path, "prompt-completion", model="qwen3", with_eval=True, eval_strategy="steps", eval_steps=2
    )
    truth, truth_logs, _ = _train(make, False, monkeypatch, truth=True)  # first: see _run_both
    ref, ref_logs, ref_det = _train(make, False, monkeypatch)
    ours, our_logs, _ = _train(make, True, monkeypatch)
    _compare(ref_logs, our_logs, truth_logs, SFT_METRICS)
    keys = ("eval_loss", "eval_entropy", "eval_mean_token_accuracy")
    evals = [
        [{k: h[k] for k in keys} for h in t.state.log_history if "eval_loss" in h] for t in (ref, ours, truth)
    ]
    _compare(*evals, set(keys), min_logs=1)
    assert loss_trl.fused_calls(ours) == ref_det.trl_kernel  # training micro-batches + eval batches


# ---------------------------------------------------------------------------------------------- DPOTrainer

DPO_METRICS = {
    "loss",
    "grad_norm",
    "entropy",
    "mean_token_accuracy",
    "num_tokens",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
}


DPO_BETA = trl.DPOConfig.__dataclass_fields__["beta"].default  # the tests keep DPOConfig's beta


def _dpo_factory(tmp_path, with_ref=True, peft_config=None, **config):
    def make(truth=False):
        settings = dict(
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=4,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            seed=0,
            learning_rate=5e-3,
            max_length=48,
            disable_tqdm=True,
            dataloader_num_workers=0,
            bf16=False,  # TRL defaults to bf16 autocast, also on CPU: the comparison is in fp32
        )
        settings.update(config)
        data = _tiny.text_dataset(n=24, seed=2).select_columns(["prompt", "chosen", "rejected"])
        # a model built from a config has no hub name to reload as the reference: pass one (or use PEFT)
        return trl.DPOTrainer(
            model=_as_truth(_tiny.model("llama")) if truth else _tiny.model("llama"),
            ref_model=None
            if not with_ref
            else _as_truth(_tiny.model("llama"))
            if truth
            else _tiny.model("llama"),
            args=trl.DPOConfig(**settings),
            train_dataset=data,
            processing_class=_tiny.tokenizer(),
            peft_config=peft_config,
        )

    return make


@pytest.mark.parametrize(
    ("case", "config"),
    [
        ("sigmoid (default)", {}),
        ("ipo", {"loss_type": ["ipo"]}),
        ("hinge + sft (two losses)", {"loss_type": ["hinge", "sft"], "loss_weights": [1.0, 0.5]}),
        ("apo_zero, WPO weighting (log_sum_sq_probs)", {"loss_type": ["apo_zero"], "use_weighting": True}),
        ("sigmoid_norm, ld_alpha", {"loss_type": ["sigmoid_norm"], "ld_alpha": 0.5}),
    ],
)
def test_dpo_same_loss_and_metrics(case, config, tmp_path, monkeypatch):
    trainer = _run_both(_dpo_factory(tmp_path, **config), monkeypatch, DPO_METRICS, DPO_BETA)
    assert loss_trl.fused_calls(trainer) == 3 * 2, case  # a policy and a reference forward per step


def test_dpo_precomputed_reference(tmp_path, monkeypatch):
    # the reference log-probs are computed in __init__ (by TRL's head); the policy's then by fasttrain's
    factory = _dpo_factory(tmp_path, precompute_ref_log_probs=True)
    _, truth_logs, _ = _train(factory, False, monkeypatch, truth=True)  # first: see _run_both
    _, ref_logs, _ = _train(factory, False, monkeypatch)
    trainer, our_logs, det = _train(factory, True, monkeypatch)
    _compare(ref_logs, our_logs, truth_logs, DPO_METRICS, beta=DPO_BETA)
    assert loss_trl.fused_calls(trainer) == 3 and det.trl_kernel == 0  # the policy forwards only


def test_dpo_peft_reference_is_the_adapter_free_policy(tmp_path, monkeypatch):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    trainer = _run_both(
        _dpo_factory(tmp_path, with_ref=False, peft_config=lora), monkeypatch, DPO_METRICS, DPO_BETA
    )
    assert loss_trl.fused_calls(trainer) == 3 * 2  # the reference forward runs the same model


# ---------------------------------------------------------------------------------------------- reasons


def test_reasons_and_disable(tmp_path, monkeypatch):
    import transformers

    plain = transformers.Trainer(model=_tiny.model("llama"), args=_tiny.training_args(str(tmp_path)))
    assert loss_trl.enable(plain) == "Trainer is not a TRL trainer"

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _sft_factory(tmp_path)()
    monkeypatch.setattr(trl, "__version__", "1.15.0")
    assert "TRL 1.15.0: fasttrain serves TRL's fused LM head for TRL >= 1.16" in loss_trl.enable(trainer)
    monkeypatch.delattr(trl_utils, "add_fused_lm_head")  # as in TRL releases before the fused head
    assert "has no fused LM head" in loss_trl.enable(trainer)
    monkeypatch.undo()
    monkeypatch.setitem(trl_support.TRAINERS["sft"].kernel, "cpu", "trl")
    assert "measured faster" in loss_trl.enable(trainer)
    monkeypatch.undo()

    trl_forward = trainer.model.forward
    assert loss_trl.enable(trainer) is None
    assert trainer.model.forward is not trl_forward
    loss_trl.disable(trainer)
    assert trainer.model.forward == trl_forward and loss_trl.fused_calls(trainer) == 0

    del trainer.model.forward  # no fused head installed (e.g. an older TRL)
    assert "no TRL fused LM head" in loss_trl.enable(trainer)


def test_head_under_accelerate_autocast_wrapper(tmp_path):
    # bf16: Accelerator.prepare_model wraps TRL's forward in autocast after TRL installed it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _sft_factory(tmp_path, bf16=True)()
    model = trainer.model
    trl_forward = model.forward
    trainer.accelerator.prepare_model(model)
    wrapper = model.forward
    assert model._original_forward == trl_forward and wrapper != trl_forward
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        ref = model(input_ids=ids, labels=ids, fused_lm_head=True)  # TRL's head under the same wrapper
    truth = _plain_truth(tmp_path, ids)
    assert loss_trl.enable(trainer) is None
    ours = model._original_forward
    assert getattr(ours.__func__, "_fasttrain_trl_head", False) and trl_support._wraps(
        model.forward, ours.__func__
    )
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        inner = ours(input_ids=ids, labels=ids, fused_lm_head=True)  # without the wrapper: fp32 matmul
    assert loss_trl.fused_calls(trainer) == 2 and out.log_probs.dtype == torch.float32
    # the wrapper's autocast reached the kernel: its matmul ran in bf16, so the values differ from fp32's
    assert not torch.equal(out.log_probs, inner.log_probs)
    # as close to the float64 run as TRL's head under the same autocast (bf16 roundings of the whole model)
    assert_truth(out.log_probs, ref.log_probs, truth["log_probs"], k=K, ulps=4.0, what="log_probs")
    loss_trl.disable(trainer)
    assert model.forward == wrapper and model._original_forward == trl_forward


def test_calls_without_fused_head_keep_trl_forward(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _sft_factory(tmp_path)()
    model = trainer.model
    lm_head_calls = []
    model.lm_head.register_forward_hook(lambda *_: lm_head_calls.append(1))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        before = model(input_ids=ids, labels=ids)
        trl_fused = model(input_ids=ids, labels=ids, fused_lm_head=True)
        assert loss_trl.enable(trainer) is None
        after = model(input_ids=ids, labels=ids)
        ours = model(input_ids=ids, labels=ids, fused_lm_head=True)
        generated = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert torch.equal(before.logits, after.logits) and torch.equal(before.loss, after.loss)
    assert loss_trl.fused_calls(trainer) == 1
    assert (
        len(lm_head_calls) == 2 + 3
    )  # the plain calls and generate() use the lm_head module: the detector works
    assert type(ours) is type(trl_fused)
    truth = _plain_truth(tmp_path, ids)
    for name in ("loss", "log_probs", "entropy", "is_top1", "label_mask"):
        a, b = getattr(ours, name), getattr(trl_fused, name)
        assert a.shape == b.shape and a.dtype == b.dtype, name
    assert torch.equal(ours.label_mask, trl_fused.label_mask)
    # top-1 hits where the label's margin exceeds 4 fp32 roundings of the largest logit
    decided = truth["top1_margin"].abs() > 4 * torch.finfo(torch.float32).eps * truth["max_abs_logit"]
    assert torch.equal(ours.is_top1[decided], truth["is_top1"][decided])
    for name in (
        "loss",
        "log_probs",
        "entropy",
    ):  # one fp32 forward: twice TRL's distance plus 4 fp32 roundings
        assert_truth(getattr(ours, name), getattr(trl_fused, name), truth[name], k=K, ulps=4.0, what=name)
    assert generated.shape == (1, 8)


def _plain_truth(tmp_path, ids):
    """TRL's fused-head outputs for ``ids``, from the float64 model's plain logits. (TRL's own head upcasts its
    logits tiles with ``.float()``, so on a float64 model it would compute them in fp32.)"""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _sft_factory(tmp_path)(truth=True).model
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]  # [1, T - 1, V] float64: position t predicts ids[t + 1]
    labels = ids[:, 1:]
    log_p = torch.log_softmax(logits, -1)
    log_probs = log_p.gather(-1, labels[..., None]).squeeze(-1)
    label_logit = logits.gather(-1, labels[..., None]).squeeze(-1)
    return {
        "loss": -log_probs.mean(),
        "log_probs": log_probs,
        "entropy": -(log_p.exp() * log_p).sum(-1),
        "is_top1": logits.argmax(-1) == labels,
        "top1_margin": label_logit - logits.scatter(-1, labels[..., None], float("-inf")).amax(-1),
        "max_abs_logit": logits.abs().amax(-1),
    }


def test_model_patch_leaves_trl_models_to_trl_support(tmp_path):
    from fasttrain.loss.model_patch import enable_fused_loss

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = _sft_factory(tmp_path)()
    assert "TRL's fused LM head" in enable_fused_loss(trainer.model)
