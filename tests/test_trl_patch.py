"""TRL's SFTTrainer and DPOTrainer under ``fasttrain.patch()``: every hot path runs (fasttrain's kernel behind
TRL's fused LM head, its collators, the sampler when grouping is asked), and the loss and every metric TRL logs
are as close to the truth as plain TRL's at every step. A user's subclass of those trainers gets the same.

The truth is plain TRL with its models in float64 (``_truth``), its LM head too (TRL's own folds in float32).
Metrics that count 0/1 decisions are compared through what they threshold: DPO's per-example reward margins
(``rewards/accuracies``) and the truth's top-1 logit margins (``mean_token_accuracy``, compared where no hit lies
within the run's dtype resolution)."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers

import _tiny as tiny
import _truth
import fasttrain
from _trl_bounds import BOUNDS

trl = pytest.importorskip("trl")

pytestmark = [pytest.mark.dropin, pytest.mark.numeric, pytest.mark.trl]

EPS = {False: _truth.EPS32, True: _truth.EPS_BF16}
# a top-1 hit is within a run's resolution when its margin is within this many units of its logits' scale:
# the last matmul alone rounds a logit by up to eps |h| |w|; what the run rounded before adds the same order
TOP1_ULPS = 16
THRESHOLDED = ("rewards/accuracies", "mean_token_accuracy")


@pytest.fixture(autouse=True)
def _unpatched():
    fasttrain.unpatch()
    yield
    fasttrain.unpatch()


class _RewardMargins:
    """Per-example DPO reward margins of each step. TRL logs only their mean and the 0/1 accuracy thresholding
    them; it passes chosen rewards, rejected rewards, accuracies and margins through ``accelerator.gather`` in
    turn, and the four are recognised by content (accuracies == chosen > rejected, margins == chosen - rejected)."""

    def __init__(self, trainer):
        self.gathered = []
        gather = trainer.accelerator.gather

        def recording(tensor):
            self.gathered.append(tensor.detach().clone())
            return gather(tensor)

        trainer.accelerator.gather = recording

    def per_step(self) -> list[torch.Tensor]:
        found = []
        for chosen, rejected, accuracies, margins in zip(
            *(self.gathered[i:] for i in range(4)), strict=False
        ):
            shapes = {t.shape for t in (chosen, rejected, accuracies, margins)}
            if (
                len(shapes) == 1
                and torch.equal(accuracies, (chosen > rejected).to(accuracies.dtype))
                and torch.equal(margins, chosen - rejected)
            ):
                found.append(margins)
        return found


def _train(make, patched, truth=False):
    """``make(model, bf16=None)`` builds the trainer; the truth run gets float64 models, no autocast, and the
    float64 TRL head."""
    if patched:
        fasttrain.patch()
    lm_head_calls = []
    head = _truth.Float64TrlHead()
    with warnings.catch_warnings(), pytest.MonkeyPatch.context() as mp:
        warnings.simplefilter("ignore")
        if truth:
            mp.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", head)
            trainer = make(lambda: _truth.float64_twin(tiny.model("llama")), bf16=False)
        else:
            trainer = make(tiny.model)
        for model in (trainer.model, getattr(trainer, "ref_model", None)):
            if model is not None:
                model.get_output_embeddings().register_forward_hook(lambda *_: lm_head_calls.append(1))
        trainer.reward_margins = _RewardMargins(trainer)
        trainer.forwards_while_training = {}  # fasttrain serves TRL's heads while training only
        trainer.add_callback(
            _ForwardSnapshot(
                trainer.forwards_while_training, trainer.model, getattr(trainer, "ref_model", None)
            )
        )
        trainer.train()
    fasttrain.unpatch()
    trainer.truth_head = head
    return trainer, len(lm_head_calls)


def _assert_metrics_near_truth(ref, ours, truth, must_have, bf16):
    assert len(tiny.step_logs(ref)) >= 2 and must_have <= tiny.step_logs(ref)[0].keys()
    bound = BOUNDS[bf16]
    _truth.assert_logs_near_truth(
        ours, ref, truth, bound, skip=THRESHOLDED, abs_floor=_truth.difference_floors(truth)
    )
    steps = len(tiny.step_logs(truth))
    logs = [tiny.step_logs(run) for run in (ours, ref, truth)]
    # rewards/accuracies: each example's margin near the truth's; the accuracy equal where every sign is decided
    margins = [run.reward_margins.per_step() for run in (ours, ref, truth)]
    if "rewards/accuracies" in logs[2][0]:
        assert [len(m) for m in margins] == [steps] * 3, [len(m) for m in margins]
        for step in range(steps):
            decided = _truth.assert_values_near_truth(
                f"step {step + 1} reward margin", *(m[step].tolist() for m in margins), bound
            )
            if all(decided):
                assert logs[0][step]["rewards/accuracies"] == logs[2][step]["rewards/accuracies"], step + 1
    # mean_token_accuracy: equal to the truth's where no top-1 hit of the step lies within the dtype's resolution
    undecided = truth.truth_head.undecided(EPS[bf16], TOP1_ULPS)
    assert len(undecided) % steps == 0 and undecided, undecided
    per_step = len(undecided) // steps
    compared = 0
    for step in range(steps):
        if sum(undecided[step * per_step : (step + 1) * per_step]) == 0:
            compared += 1
            assert logs[0][step]["mean_token_accuracy"] == logs[2][step]["mean_token_accuracy"], step + 1
    _truth.record(
        f"mean_token_accuracy compared at {compared} of {steps} steps; undecided hits per call {undecided}"
    )
    assert compared or bf16, "in float32 no top-1 hit should lie within rounding of a tie"


# bf16 runs: the step-1 loss and every step's grad_norm against the reference's own distance at that step, with
# only float32's floor (not half a bf16 unit): both heads round the same bf16 operands and logit gradients, so
# ours must be another draw of the reference's rounding, not a shift. A head that rounds a logit gradient
# before its upstream scale, or returns bf16 gradients, is ~1e-3 off at every step (issue 17) and fails here.
BF16_SAME_ROUNDING = _truth.Bound(k=_truth.K, floor=8 * _truth.EPS32)


def _assert_bf16_tracks_reference(ref, ours, truth):
    logs = [tiny.step_logs(run) for run in (ours, ref, truth)]
    checks = [("loss", 0)] + [("grad_norm", step) for step in range(len(logs[2]))]
    for key, step in checks:
        _truth.assert_scalar_near_truth(
            f"bf16 step {step + 1} {key} (per-step bound)",
            *(run[step][key] for run in logs),
            BF16_SAME_ROUNDING,
        )


class _ForwardSnapshot(transformers.TrainerCallback):
    """The models' forward attributes at the end of the first step (what training ran with)."""

    def __init__(self, into, *models):
        self.into, self.models = into, [m for m in models if m is not None]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            for model in self.models:
                self.into[id(model)] = {k: model.__dict__.get(k) for k in ("forward", "_original_forward")}


def _assert_under_accelerate_autocast(trainer, bf16):
    """Under mixed precision, fasttrain's forward sits where TRL's was: inside Accelerate's autocast wrapper."""
    from fasttrain.loss import trl_support

    for model in (trainer.model, getattr(trainer, "ref_model", None)):
        if model is None:
            continue
        attrs = trainer.forwards_while_training[id(model)]
        original = attrs["_original_forward"]
        if not bf16:
            assert original is None
            continue
        assert getattr(original.__func__, "_fasttrain_trl_head", False), original
        assert trl_support._wraps(attrs["forward"], original.__func__)
    # after training TRL's own heads are back
    assert trl_support.fused_calls([trainer.model]) == 0


class MySFTTrainer(trl.SFTTrainer):
    """A user's subclass (its own hook on logging), as people write them."""

    def log(self, logs, *args, **kwargs):
        super().log(logs, *args, **kwargs)


@pytest.mark.parametrize(
    ("cls", "bf16"),
    [(trl.SFTTrainer, False), (MySFTTrainer, False), (trl.SFTTrainer, True)],
    ids=["SFTTrainer", "subclass", "SFTTrainer-bf16"],
)
def test_sft_under_patch(tmp_path, cls, bf16):
    def make(model, bf16=bf16):
        config = trl.SFTConfig(
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
            max_length=64,
            disable_tqdm=True,
            **tiny.grouping_args(),
        )
        return cls(
            model=model(),
            args=config,
            train_dataset=tiny.text_dataset().select_columns(["text"]),
            processing_class=tiny.tokenizer(),
        )

    ref, _ = _train(make, patched=False)
    ours, lm_head_calls = _train(make, patched=True)
    truth, _ = _train(make, patched=False, truth=True)
    assert ours.fasttrain_status == tiny.all_on_status()
    assert lm_head_calls == 0
    _assert_under_accelerate_autocast(ours, bf16)
    _assert_metrics_near_truth(
        ref, ours, truth, {"loss", "mean_token_accuracy", "entropy", "num_tokens", "grad_norm"}, bf16
    )
    if bf16:
        _assert_bf16_tracks_reference(ref, ours, truth)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_dpo_under_patch(tmp_path, bf16):
    def make(model, bf16=bf16):
        config = trl.DPOConfig(
            output_dir=str(tmp_path),
            max_steps=2,
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
        # a model built from a config has no hub name: TRL cannot reload it as the reference, so pass one
        return trl.DPOTrainer(
            model=model(),
            ref_model=model(),
            args=config,
            train_dataset=tiny.text_dataset().select_columns(["prompt", "chosen", "rejected"]),
            processing_class=tiny.tokenizer(),
        )

    ref, _ = _train(make, patched=False)
    ours, lm_head_calls = _train(make, patched=True)
    truth, _ = _train(make, patched=False, truth=True)
    # DPO's preference batches (chosen and rejected rows of one prompt) are not ones packing starts from
    packing = (
        "off: the collator fasttrain.data.trl_collators.DataCollatorForPreference is not a padding collator "
        "fasttrain knows (its batches are kept as they are)"
    )
    assert ours.fasttrain_status == {
        **tiny.all_on_status(),
        "sampler": "off: group_by_length is not set",
        "packing": packing,
    }
    assert lm_head_calls == 0
    _assert_under_accelerate_autocast(ours, bf16)
    _assert_metrics_near_truth(
        ref,
        ours,
        truth,
        {"loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen", "grad_norm"},
        bf16,
    )
    if bf16:
        _assert_bf16_tracks_reference(ref, ours, truth)


def test_a_trl_trainer_whose_head_cannot_be_served_keeps_trls(tmp_path, monkeypatch):
    from fasttrain.loss import trl_support

    monkeypatch.setitem(trl_support.TRAINERS["sft"].kernel, "cpu", "trl")

    def make(model):
        config = trl.SFTConfig(
            output_dir=str(tmp_path),
            max_steps=2,
            per_device_train_batch_size=4,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            max_length=64,
            disable_tqdm=True,
        )
        return trl.SFTTrainer(
            model=model(),
            args=config,
            train_dataset=tiny.text_dataset().select_columns(["text"]),
            processing_class=tiny.tokenizer(),
        )

    ours, _ = _train(make, patched=True)
    assert ours.fasttrain_status["loss"] == (
        "off: TRL's own fused LM head measured faster for sft on cpu (trl_support.TRAINERS)"
    )
