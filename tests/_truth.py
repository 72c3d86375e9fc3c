"""Comparisons anchored to a float64 run (the truth), for Trainer- and TRL-level parity tests.

Two float32 runs that sum in different orders differ by rounding, and how much depends on the CPU (its vector
width, its thread count). A fixed bound between fasttrain and the reference therefore fails on some machine
while both are equally exact. Here the reference is run a second time with its model in float64 and fasttrain
off, and fasttrain must be about as close to that truth as the reference is:

    |ours - truth| <= k * |reference - truth| + floor * |truth|

``k`` says how much less exact than the reference fasttrain may be; the floor (relative to the truth's own
magnitude) covers rounding that no order of summation avoids, for when the reference lands on the truth by luck.
Both are written below with their reason, from the dtype alone.

A logged value at one step is a single draw: the reference's distance there can be near zero by chance (its
logged loss is often the truth rounded to float32) while ours, rounded in another order, is not. So for values
logged per step, ``|reference - truth|`` is the reference's largest distance over the run's steps: how exact
this computation is in this dtype (absolute, not relative: a mean of logits or a reward is a small difference of
larger terms, and its rounding scales with the terms). For per-item values (DPO's per-example margins) it is the
reference's largest distance over the items of the step. Whole tensors are compared tensor by tensor: a norm
over many elements is no single draw.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Iterable, Sequence

import torch
import transformers
from transformers.loss.loss_utils import ForCausalLMLoss, fixed_cross_entropy

EPS32 = torch.finfo(torch.float32).eps  # 2**-23
EPS_BF16 = torch.finfo(torch.bfloat16).eps  # 2**-7


@dataclasses.dataclass(frozen=True)
class Bound:
    """``|ours - truth| <= k * |reference - truth| + floor * |truth|``."""

    k: float
    floor: float

    def limit(self, ref_err: float, scale: float) -> float:
        return self.k * ref_err + self.floor * scale


# k = 2 everywhere: fasttrain rounds in another order than the reference (chunked loss, fused optimizer), so its
# distance to the truth is another draw of the same size; twice the reference's leaves room for the draw. A real
# difference (a wrong scale, step, clip or gradient) is orders of magnitude above rounding and fails at any such k.
K = 2.0
# Per logged step, float32 runs: the logged loss is accumulated in a float32 tensor by the Trainer (also for a
# float64 model) and grad_norm is a float32 reduction: each is exact only to a few units in its last place.
FP32_STEP = Bound(k=K, floor=8 * EPS32)
# Whole tensors (parameters after training, gradients), float32: every stored element is rounded to float32,
# a relative half-unit each; the norm of that rounding is at most EPS32 / 2 of the tensor's norm per rounding,
# and a parameter is rounded once per step: a few units of EPS32 of its norm.
FP32_TENSOR = Bound(k=K, floor=8 * EPS32)
# bf16 autocast: the matmuls round their inputs to half a bf16 unit, so a value computed from them is resolved
# to half a bf16 unit of itself at best (often better, where errors cancel: the reference's distance shows it).
BF16_STEP = Bound(k=K, floor=EPS_BF16 / 2)
# A model whose weights are bf16 (not autocast): its logits and gradients are stored in bf16, every element
# rounded by up to half a bf16 unit whatever the order of summation: one bf16 unit of the value's magnitude.
BF16_STORED = Bound(k=K, floor=EPS_BF16)


def record(line: str) -> None:
    """With TRUTH_REPORT=<file>, every comparison appends its distances there (to see how much room a bound has)."""
    path = os.environ.get("TRUTH_REPORT")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a") as f:
            f.write(f"{test} | {line}\n")


def float64_causal_lm_loss(
    logits, labels, vocab_size, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs
):
    """transformers' ``ForCausalLMLoss`` without its ``logits.float()``: that cast would round the truth's logits
    to float32 and hide the reference's own loss rounding."""
    if shift_labels is None:
        shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
    logits = logits.view(-1, vocab_size)
    return fixed_cross_entropy(
        logits, shift_labels.view(-1).to(logits.device), num_items_in_batch, ignore_index, **kwargs
    )


def float64_twin(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights in float64 (a copy: the float32 model stays as it is), its causal-LM loss in float64 too."""
    twin = copy.deepcopy(model).to(torch.float64)
    for module in twin.modules():  # the causal LM itself, also inside a PEFT wrapper
        if isinstance(module, transformers.GenerationMixin) and module.loss_function is ForCausalLMLoss:
            module.loss_function = float64_causal_lm_loss
    return twin


def step_logs(run) -> list[dict]:
    """The per-step log entries of a Trainer (entries with a loss), or a list of them as they are."""
    if isinstance(run, transformers.Trainer):
        return [h for h in run.state.log_history if "loss" in h]
    return list(run)


def _near(
    ours: float,
    ref: float,
    truth: float,
    bound: Bound,
    abs_floor: float = 0.0,
    ref_scale: float | None = None,
) -> tuple[bool, str]:
    """``ref_scale``: the reference's distance to use in the limit (by default its distance here)."""
    ref_err, our_err = abs(ref - truth), abs(ours - truth)
    limit = bound.limit(ref_err if ref_scale is None else ref_scale, abs(truth)) + abs_floor
    text = (
        f"ours {ours!r}, reference {ref!r}, float64 {truth!r}: |ours - f64| = {our_err:.3e}, "
        f"|ref - f64| = {ref_err:.3e}, limit {limit:.3e}"
    )
    return our_err <= limit, text


def assert_scalar_near_truth(
    what: str,
    ours: float,
    ref: float,
    truth: float,
    bound: Bound,
    abs_floor: float = 0.0,
    ref_scale: float | None = None,
) -> None:
    ok, text = _near(ours, ref, truth, bound, abs_floor, ref_scale)
    record(f"{what}: {text}")
    assert ok, f"{what}: {text}"


def assert_logs_near_truth(
    ours,
    ref,
    truth,
    bound: Bound = FP32_STEP,
    keys: Iterable[str] | None = None,
    skip: Iterable[str] = (),
    abs_floor: dict[str, float] | None = None,
) -> None:
    """Every float the three runs log at each step (or only ``keys``): ours within ``bound`` of the truth.

    Keys whose value is not a finite float (counts, a learning rate equal in all three, NaN) must be equal."""
    ours_logs, ref_logs, truth_logs = step_logs(ours), step_logs(ref), step_logs(truth)
    assert len(ours_logs) == len(ref_logs) == len(truth_logs) > 0, (
        len(ours_logs),
        len(ref_logs),
        len(truth_logs),
    )
    skip, abs_floor = set(skip), abs_floor or {}

    def measured(key, value):
        return isinstance(value, float) and math.isfinite(value)

    # the reference's largest relative distance to the truth over the run, per key (see the module's docstring)
    def run_scale(key):  # over the steps that log the key (GRPO's later iterations log fewer)
        distances = [
            abs(a[key] - t[key])
            for a, t in zip(ref_logs, truth_logs, strict=True)
            if key in t and key in a and measured(key, t[key]) and measured(key, a[key])
        ]
        return max(distances, default=0.0)

    ref_scale = {key: run_scale(key) for step in truth_logs for key in step}
    for step, (b, a, t) in enumerate(zip(ours_logs, ref_logs, truth_logs, strict=True), start=1):
        assert a.keys() == b.keys() == t.keys(), (step, sorted(a), sorted(b), sorted(t))
        for key in t.keys() if keys is None else keys:
            if key in skip:
                continue
            if measured(key, t[key]):
                assert_scalar_near_truth(
                    f"step {step} {key}",
                    b[key],
                    a[key],
                    t[key],
                    bound,
                    abs_floor.get(key, 0.0),
                    ref_scale=ref_scale[key],
                )
            else:
                assert b[key] == a[key] == t[key] or (b[key] != b[key] and a[key] != a[key]), (
                    step,
                    key,
                    b[key],
                    a[key],
                )


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().double() - b.detach().double()).norm())


def assert_tensors_near_truth(
    ours: dict[str, torch.Tensor],
    ref: dict[str, torch.Tensor],
    truth: dict[str, torch.Tensor],
    bound: Bound = FP32_TENSOR,
    what: str = "tensor",
) -> None:
    """Per named tensor, as norms: ``|ours - truth| <= k |ref - truth| + floor |truth|``.

    Whole tensors, not elements: Adam normalises every update, so an element whose gradient is near zero can take
    an update-sized rounding difference in either run; the norm over the tensor is what rounding keeps small."""
    assert ours.keys() == ref.keys() == truth.keys()
    off = []
    for name, t in truth.items():
        if t is None:
            assert ours[name] is None and ref[name] is None, name
            continue
        ref_err, our_err = _distance(ref[name], t), _distance(ours[name], t)
        limit = bound.limit(ref_err, float(t.detach().double().norm()))
        record(f"{what} {name}: |ours - f64| = {our_err:.3e}, |ref - f64| = {ref_err:.3e}, limit {limit:.3e}")
        if not our_err <= limit:
            off.append(
                f"{name}: |ours - f64| = {our_err:.3e}, |ref - f64| = {ref_err:.3e}, limit {limit:.3e}"
            )
    assert not off, f"{what}s farther from float64 than the reference allows:\n" + "\n".join(off)


def assert_params_near_truth(
    ours: torch.nn.Module, ref: torch.nn.Module, truth: torch.nn.Module, bound: Bound = FP32_TENSOR
) -> None:
    """The trained parameters, tensor by tensor (see ``assert_tensors_near_truth``)."""
    assert_tensors_near_truth(
        dict(ours.named_parameters()),
        dict(ref.named_parameters()),
        dict(truth.named_parameters()),
        bound,
        "parameter",
    )


def assert_grads_near_truth(
    ours: torch.nn.Module, ref: torch.nn.Module, truth: torch.nn.Module, bound: Bound = FP32_TENSOR
) -> None:
    """The gradients after one backward, tensor by tensor (see ``assert_tensors_near_truth``)."""

    def grads(model):
        return {name: p.grad for name, p in model.named_parameters()}

    assert_tensors_near_truth(grads(ours), grads(ref), grads(truth), bound, "gradient")


def assert_values_near_truth(
    what: str, ours: Sequence[float], ref: Sequence[float], truth: Sequence[float], bound: Bound
) -> list[bool]:
    """Per-item values (DPO's per-example reward margins), each within ``bound`` of the truth. Returns, per item,
    whether the truth is farther from zero than that bound: there ours has the truth's sign (it is within the bound
    of it), so a 0/1 metric thresholding the value at zero must agree with the truth's; elsewhere the sign is within
    rounding and the metric may go either way in any float32 run, the reference's included."""
    assert len(ours) == len(ref) == len(truth) > 0, (len(ours), len(ref), len(truth))
    ref_scale = max(abs(a - t) for a, t in zip(ref, truth, strict=True))  # see the module's docstring
    decided = []
    for i, (b, a, t) in enumerate(zip(ours, ref, truth, strict=True)):
        ok, text = _near(b, a, t, bound, ref_scale=ref_scale)
        record(f"{what}[{i}]: {text}")
        assert ok, f"{what}[{i}]: {text}"
        decided.append(abs(t) > bound.limit(ref_scale, abs(t)))
    return decided


class Float64TrlHead:
    """TRL's fused LM-head contract (``trl.kernels.ChunkedLogProbFunction.apply``) in float64, by autograd over
    the full logits, for the truth run: TRL's own head folds its logits in float32 whatever the model's dtype.

    It also records, per call, each scored token's top-1 margin (its logit minus the largest other logit) and
    ``|h| * max_v |w_v|``, which bounds by Cauchy-Schwarz every logit's magnitude: a run in a dtype of unit
    roundoff ``eps`` can only flip a top-1 hit whose margin is within a few ``eps`` of that scale."""

    def __init__(self):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def apply(
        self,
        hidden,
        weight,
        bias,
        targets,
        temperature,
        chunk_size,
        final_logit_softcapping=None,
        logit_scale=1.0,
        outputs=("entropy", "log_sum_sq_probs", "mean_logits", "is_top1"),
    ):
        hidden, weight = hidden.double(), weight.double()
        z = torch.nn.functional.linear(hidden, weight, None if bias is None else bias.double()) * logit_scale
        if final_logit_softcapping is not None:
            z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
        z = z / temperature
        log_p = z.log_softmax(-1)
        log_probs = log_p.gather(-1, targets[:, None]).squeeze(-1)
        target_z = z.gather(-1, targets[:, None]).squeeze(-1).detach()
        others = z.detach().scatter(-1, targets[:, None], -math.inf)
        # argmax takes the first maximum: a tie with an earlier token is not a hit (TRL's and fasttrain's rule)
        margin = target_z - others.amax(-1)
        scored = (
            targets != 0
        )  # off a GPU TRL scores every position, ignored ones with their label clamped to 0
        scale = hidden.detach().norm(dim=-1) * weight.detach().norm(dim=-1).max()
        self.calls.append((margin[scored], scale[scored]))
        entropy = -(log_p.exp() * log_p).sum(-1)
        first_max = z.detach().argmax(-1) == targets
        return (
            log_probs,
            entropy if "entropy" in outputs else None,
            torch.logsumexp(2 * log_p, -1).detach() if "log_sum_sq_probs" in outputs else None,
            z.detach().mean(-1) if "mean_logits" in outputs else None,
            first_max if "is_top1" in outputs else None,
        )

    def undecided(self, eps: float, ulps: float) -> list[int]:
        """Per call, how many top-1 hits lie within ``ulps * eps`` of their logits' scale (a run in that dtype may
        take them either way)."""
        return [int((margin.abs() <= ulps * eps * scale).sum()) for margin, scale in self.calls]


def difference_floors(truth) -> dict[str, float]:
    """Absolute floors for what TRL's trainers (DPO, KTO; GRPO's and RLOO's loss and ``kl``) log as small
    differences of larger terms.

    - ``rewards/*`` and ``kl``: ``beta`` times a difference of two sums of log-probs (policy and reference, about -100
      each in the tests): their rounding scales with those sums, not with the difference, so one float32 unit of
      ``beta * |sum of log-probs|`` is what no order of summation avoids (the reference may land closer by luck:
      seen on DPO's rewards/rejected, 2.6e-8 from float64 against ours 7.4e-8, with the sums at ~100).
    - ``logits/*``: a mean over the vocabulary and the tokens of logits of both signs (near 0 here): each token's mean
      is an fp32 sum of logits, rounded to a unit of the largest logit, ``|h| |w_v|`` at most (the final norm's
      output, of norm ``sqrt(H) max|g|``, times the largest output row; seen on KTO's logits/rejected, 3.8e-10 from
      float64 for the reference against ours 1.7e-9, the bound at ~6e-1).
    """
    logs = step_logs(truth)
    floors = {}
    sums = [
        abs(v) for step in logs for k, v in step.items() if k.startswith("logps/") and isinstance(v, float)
    ]
    if sums:
        floor = EPS32 * truth.args.beta * max(sums)
        floors.update({k: floor for k in logs[0] if k.startswith("rewards/") or k == "kl"})
    elif hasattr(truth.args, "num_generations"):  # GRPO, RLOO: losses and kl over sampled tokens' log-probs
        floors.update(_sampled_token_floors(truth, logs))
    bound = _largest_logit_bound(truth.model)
    if bound is not None:
        floors.update({k: EPS32 * bound for k in logs[0] if k.startswith("logits/")})
    return floors


def _sampled_token_floors(truth, logs) -> dict[str, float]:
    """GRPO's and RLOO's ``loss`` and ``kl``: functions of per-token log-probs, each an fp32 value of about ``log V``
    (near-uniform predictions at initialisation) rounded to a unit of itself whatever the order of summation, so
    each token's log-prob carries ``EPS32 log V`` of rounding.

    - ``loss``: a mean over tokens of advantage-weighted importance ratios ``exp(logp - old_logp)`` (advantages
      normalised to about 1): ``EPS32 log V`` (seen on an AMD EPYC under ATEN_CPU_CAPABILITY=default: GRPO vespo's
      step-3 loss 2.0e-7 from float64 for fasttrain against 8.4e-8 for TRL, the loss at 4.8e-3);
    - ``kl``: a mean of ``exp(d) - d - 1``, ``d`` the reference's minus the policy's log-prob, moved by
      ``|exp(d) - 1| EPS32 log V``, and ``|exp(d) - 1|`` is about ``sqrt(2 kl)`` where kl is small (seen on an AMD
      EPYC: GRPO's step-2 kl 1.9e-8 from float64 for fasttrain against 4.4e-9 for TRL, the floor 4.9e-8)."""
    per_token = EPS32 * math.log(truth.model.config.get_text_config().vocab_size)
    floors = {"loss": per_token}
    if "kl" in logs[0]:
        kl = max((abs(step["kl"]) for step in logs if isinstance(step.get("kl"), float)), default=0.0)
        floors["kl"] = per_token * math.sqrt(2 * kl)
    return floors


def _largest_logit_bound(model) -> float | None:
    """``|h| max_v |w_v|``: h the final norm's output (RMS-normalised, so ``|h| <= sqrt(H) max|g|``)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    norm = getattr(getattr(base, base.base_model_prefix, None), "norm", None)
    head = base.get_output_embeddings()
    if norm is None or getattr(norm, "weight", None) is None or head is None:
        return None
    weight = head.weight.detach().double()
    hidden = weight.shape[1] ** 0.5 * float(norm.weight.detach().double().abs().max())
    return hidden * float(weight.norm(dim=1).max())
