"""TRL's GRPOTrainer, RLOOTrainer and KTOTrainer under ``fasttrain.patch()``: fasttrain's kernel serves their fused
LM head (policy, old policy, reference model), and the loss and every value TRL logs are as close to the truth as
plain TRL's at every step, in fp32 and in bf16 (TRL's default).

The truth is plain TRL with its models in float64 and its head too (tests/test_trl_patch.py's ``_train``). GRPO and
RLOO generate their completions with ``model.generate`` (TRL's forward, not the fused head): the completions must be
the same token for token in the three runs, which the identical completion-length statistics and rewards check (a
reward is a function of the completion's text). Generation happens once, at the first step, from equal weights.
Step times are not compared.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import _tiny as tiny
import _truth
import fasttrain
from _trl_bounds import BOUNDS

trl = pytest.importorskip("trl")

pytestmark = [pytest.mark.numeric, pytest.mark.trl]

SKIP = ("step_time",)


@pytest.fixture(autouse=True)
def _unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


def reward_length(completions, **kwargs):
    return [len(c.split()) / 10 for c in completions]


def reward_token(completions, **kwargs):
    return [float(c.count("t7") + c.count("t9")) for c in completions]


def _prompts(n=16):
    import datasets

    rows = [" ".join(f"t{3 + (i * 7 + j) % 200}" for j in range(3 + i % 4)) for i in range(n)]
    return datasets.Dataset.from_dict({"prompt": rows})


def _rl_config(cls, tmp_path, bf16, **overrides):
    base = dict(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=bf16,
        seed=0,
        learning_rate=1e-2,
        disable_tqdm=True,
        temperature=0.7,
    )
    base.update(overrides)
    return cls(**base)


def _named(model, tmp_path):
    """``model`` saved to a folder that its config names: TRL builds the reference model (beta > 0) from that name
    (a model made from a config has none, and the hub is out of reach), in the policy's dtype."""
    path = tmp_path / f"model-{str(model.dtype).removeprefix('torch.')}"
    model.save_pretrained(path)
    model.config._name_or_path = str(path)
    return model


def _rl_make(trainer_cls, config_cls, tmp_path, bf16, peft=False, **overrides):
    def make(model, bf16=bf16):
        kwargs = {}
        if peft:
            import peft as peft_lib

            kwargs["peft_config"] = peft_lib.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        return trainer_cls(
            model=_named(model(), tmp_path),
            reward_funcs=[reward_length, reward_token],
            args=_rl_config(config_cls, tmp_path, bf16, **overrides),
            train_dataset=_prompts(),
            processing_class=tiny.tokenizer(padding_side="left"),
            **kwargs,
        )

    return make


def _assert_status(ours, name):
    status = ours.fasttrain_status
    assert status["loss"] == "on" and status["optimizer"] == "on", status
    assert status["collator"] == f"off: {name} builds its batches itself (TRL's identity collator)", status


class _NoTrlKernel:
    """Stands in for TRL's chunked kernel while a patched trainer trains: every scoring call must take fasttrain's."""

    @staticmethod
    def apply(*args, **kwargs):
        raise AssertionError("TRL's fused-head kernel ran under fasttrain.patch()")


def _run(make, patched, truth=False):
    """``make(model, bf16=None)`` builds the trainer; the truth run gets float64 models, no autocast, and the float64
    TRL head. Under patch(), TRL's kernel is refused from the first training step on (reference log-probs that TRL
    precomputes in its constructor, before fasttrain is applied, keep TRL's head)."""
    if patched:
        fasttrain.patch()
    try:
        with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
            warnings.simplefilter("ignore")
            if truth:
                mp.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _truth.Float64TrlHead())
                trainer = make(lambda: _truth.float64_twin(tiny.model("llama")), bf16=False)
            else:
                trainer = make(tiny.model)
            if patched:
                mp.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", _NoTrlKernel)
            trainer.train()
    finally:
        fasttrain.unpatch()
    return trainer


def _compare(make, bf16, min_keys):
    from fasttrain.integration import loss_trl

    ref, ours, truth = _run(make, False), _run(make, True), _run(make, False, truth=True)
    assert loss_trl.fused_calls(ours) > 0
    logs = tiny.step_logs(ref)
    assert len(logs) >= 2 and min_keys <= logs[0].keys(), sorted(logs[0])
    generated = [
        k
        for k in logs[0]
        if k.startswith(("completions/", "rewards/reward_")) or k in ("reward", "reward_std")
    ]
    for key in generated:  # GRPO's and RLOO's completions, and the reward functions' scores of them: the same
        assert [s.get(key) for s in tiny.step_logs(ours)] == [s.get(key) for s in logs], key
    _truth.assert_logs_near_truth(
        ours, ref, truth, BOUNDS[bf16], skip=SKIP, abs_floor=_truth.difference_floors(truth)
    )
    return ours


GRPO_KEYS = {"loss", "grad_norm", "entropy", "reward", "completions/mean_length"}

GRPO_CASES = {
    # TRL's default loss (dapo), beta 0: no reference model
    "dapo": {},
    "grpo-beta": {"loss_type": "grpo", "beta": 0.1},
    "dr_grpo": {"loss_type": "dr_grpo"},
    "bnpo": {"loss_type": "bnpo"},
    "cispo": {"loss_type": "cispo"},
    "sapo": {"loss_type": "sapo"},
    "vespo": {"loss_type": "vespo"},
    "luspo-sequence": {"loss_type": "luspo", "importance_sampling_level": "sequence"},
    "grpo-sequence": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    # the old policy's log-probs (no_grad) and the ratios they give; the high-entropy token mask
    "iterations-entropy-quantile": {"num_iterations": 2, "top_entropy_quantile": 0.5},
    "cast-head-fp32": {"cast_lm_head_to_fp32": True, "beta": 0.1},
}


@pytest.mark.parametrize("case", list(GRPO_CASES))
def test_grpo_under_patch(tmp_path, case):
    make = _rl_make(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, False, **GRPO_CASES[case])
    ours = _compare(make, False, GRPO_KEYS)
    _assert_status(ours, "GRPOTrainer")


def test_grpo_bf16_under_patch(tmp_path):
    make = _rl_make(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, True, beta=0.1, loss_type="grpo")
    _assert_status(_compare(make, True, GRPO_KEYS), "GRPOTrainer")


def test_grpo_peft_without_a_reference_model(tmp_path):
    # beta > 0 with LoRA: TRL scores the reference with the adapter disabled, through the same (served) head
    make = _rl_make(trl.GRPOTrainer, trl.GRPOConfig, tmp_path, False, peft=True, beta=0.1)
    _assert_status(_compare(make, False, GRPO_KEYS | {"kl"}), "GRPOTrainer")


RLOO_CASES = {"beta0": {"beta": 0.0}, "beta": {"beta": 0.05}, "iterations": {"num_iterations": 2}}


@pytest.mark.parametrize("case", list(RLOO_CASES))
def test_rloo_under_patch(tmp_path, case):
    make = _rl_make(trl.RLOOTrainer, trl.RLOOConfig, tmp_path, False, **RLOO_CASES[case])
    _assert_status(_compare(make, False, {"loss", "grad_norm", "reward"}), "RLOOTrainer")


def test_rloo_bf16_under_patch(tmp_path):
    make = _rl_make(trl.RLOOTrainer, trl.RLOOConfig, tmp_path, True, beta=0.05)
    _assert_status(_compare(make, True, {"loss", "grad_norm", "reward"}), "RLOOTrainer")


def _kto_rows():
    import datasets

    pairs = tiny.text_dataset()
    rows = {"prompt": [], "completion": [], "label": []}
    for i, row in enumerate(pairs):
        good = i % 3 != 2  # unpaired and unbalanced, as KTO data are
        rows["prompt"].append(row["prompt"])
        rows["completion"].append(row["chosen"] if good else row["rejected"])
        rows["label"].append(good)
    return datasets.Dataset.from_dict(rows)


def _kto_make(tmp_path, bf16, explicit_ref=True, **overrides):
    def make(model, bf16=bf16):
        base = dict(
            output_dir=str(tmp_path),
            max_steps=3,
            per_device_train_batch_size=4,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=bf16,
            seed=0,
            learning_rate=1e-3,
            max_length=48,
            disable_tqdm=True,
        )
        if "train_sampling_strategy" in trl.KTOConfig.__dataclass_fields__:
            base["train_sampling_strategy"] = "sequential"  # KTO's KL pass pairs each row with the next one's
        base.update(overrides)
        policy = _named(model(), tmp_path)
        return trl.KTOTrainer(
            model=policy,
            ref_model=model() if explicit_ref else None,
            args=trl.KTOConfig(**base),
            train_dataset=_kto_rows(),
            processing_class=tiny.tokenizer(),
        )

    return make


KTO_KEYS = {"loss", "grad_norm", "kl", "logps/chosen", "rewards/chosen"}
KTO_CASES = {
    "kto": ({}, True),
    "apo_zero_unpaired": ({"loss_type": "apo_zero_unpaired"}, True),
    "reference-by-name": ({}, False),  # TRL builds the reference model from the policy's name
    "precomputed-reference": ({"precompute_ref_log_probs": True}, True),
}


@pytest.mark.parametrize("case", list(KTO_CASES))
def test_kto_under_patch(tmp_path, case):
    overrides, explicit_ref = KTO_CASES[case]
    keys = KTO_KEYS - ({"kl"} if overrides.get("loss_type") == "apo_zero_unpaired" else set())
    ours = _compare(_kto_make(tmp_path, False, explicit_ref, **overrides), False, keys)
    assert ours.fasttrain_status["loss"] == "on" and ours.fasttrain_status["collator"] == "on", (
        ours.fasttrain_status
    )


def test_kto_bf16_under_patch(tmp_path):
    ours = _compare(_kto_make(tmp_path, True), True, KTO_KEYS)
    assert ours.fasttrain_status["loss"] == "on"


def _fp16(model):
    """A checkpoint saved in fp16 (common), loaded as it is; the truth run keeps its float64 twin."""
    built = model()
    return built if built.dtype == torch.float64 else built.half()


@pytest.mark.parametrize("trainer", ["sft", "dpo", "transformers"])
def test_fp16_weights_train_with_bf16_autocast(tmp_path, trainer):
    """TRL's test_train_model_dtype, and the same with transformers' Trainer: fp16 weights under bf16 autocast
    (TRL's default ``bf16=True``) crashed at the first step; the head now computes what autocast nn.Linear does."""
    import transformers

    def make(model, bf16=True):
        common = dict(
            output_dir=str(tmp_path / trainer), max_steps=2, per_device_train_batch_size=4, logging_steps=1,
            report_to=[], save_strategy="no", use_cpu=True, bf16=bf16, seed=0, learning_rate=1e-3,
            disable_tqdm=True,
        )  # fmt: skip
        tok, data = tiny.tokenizer(), tiny.text_dataset()
        if trainer == "sft":
            config = trl.SFTConfig(**common, max_length=64)
            return trl.SFTTrainer(_fp16(model), args=config, train_dataset=data.select_columns(["text"]),
                                  processing_class=tok)  # fmt: skip
        if trainer == "dpo":
            config = trl.DPOConfig(**common, max_length=48)
            return trl.DPOTrainer(_fp16(model), ref_model=_fp16(model), args=config, processing_class=tok,
                                  train_dataset=data.select_columns(["prompt", "chosen", "rejected"]))  # fmt: skip
        return transformers.Trainer(
            _fp16(model), args=transformers.TrainingArguments(**common), train_dataset=tiny.dataset(n=16),
            data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        )  # fmt: skip

    ours = _run(make, True)
    assert ours.model.dtype == torch.float16 and ours.fasttrain_status["loss"] == "on", ours.fasttrain_status
    ref, truth = _run(make, False), _run(make, False, truth=True)
    _truth.assert_logs_near_truth(ours, ref, truth, BOUNDS[True], keys=("loss",))
