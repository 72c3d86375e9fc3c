"""LLaMA-Factory's own CLI (`llamafactory-cli train cfg.yaml`), plain and with fasttrain, on CPU: SFT, DPO and KTO.

Runs in LLaMA-Factory's environment (``bash .ci/env-llamafactory``, after ``bash benchmarks/gpu/prepare.sh`` has
built this tree's wheel; FASTTRAIN_LLAMAFACTORY_PYTHON points elsewhere). Without it the tests skip, unless
FASTTRAIN_REQUIRE_CLIENTS=1. fasttrain reaches the unmodified CLI through FASTTRAIN_PATCH=1, or through a
``sitecustomize.py`` with FASTTRAIN_LLAMAFACTORY_VIA=sitecustomize (tests/_client_llamafactory.py).

Each case makes three runs from the same data, seed and batches: plain, with fasttrain, and plain from the same
weights nudged by one unit in the last place (the probe). Every value logged at every step must satisfy

    |fasttrain - plain| <= K * D + RTOL * scale

- D, the probe's largest distance to the plain run over the steps: how far rounding-sized changes move this value
  in this run, drift through the steps included. A backward-stable computation's rounding is an exact computation
  on inputs off by a few units in the last place; fasttrain rounds in another order (the chunked head, the fused
  optimizer and clip), so its distance is another draw of that size. K = 2 leaves room for the draw (as
  tests/_truth.py). A wrong token, mask, scale or step is orders of magnitude above.
- RTOL * scale, for a value the nudge happens not to move (the SFT loss, logged in float32, often stays put):
  8 units in the last place in float32; half a bf16 unit under bf16 autocast (a value computed from bf16 matmuls
  is resolved to that at best). ``scale`` is the magnitude the value's rounding scales with: the value itself for
  the SFT loss, grad_norm and log-prob sums (logps/*); beta * the run's largest |logps| for rewards/* and KTO's kl
  (beta times a difference of two log-prob sums of that size) and, with the value itself, for the DPO and KTO
  losses (their slope in a log-ratio is at most beta); the run's largest |logits/*| for those means (DPO) or
  per-example sums (KTO) of logits of both signs.
- epoch, learning_rate and step are equal; so is DPO's rewards/accuracies (a count), except where the plain run's
  rewards are all exactly zero (the first step: the policy is the reference), where rounding decides each
  comparison.

The probe itself must stay within PROBE_CAP of each scale, else it measures something other than rounding and
the bound would be vacuous.
"""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest

import _client_llamafactory as lf

pytestmark = pytest.mark.client

K = 2.0
RTOL = {False: 8 * 2**-23, True: 2**-8}  # by bf16
# Measured over these 4 steps: the probe moves a value by at most 1e-5 (float32) and 6e-4 (bf16) of its scale.
PROBE_CAP = {False: 1e-4, True: 1e-2}
EXACT = ("epoch", "learning_rate", "step")
BETA = 0.1  # pref_beta of the DPO and KTO configs (lf.config)
CASES = [("sft", False), ("sft", True), ("dpo", False), ("kto", False)]
IDS = [f"{stage}-{'bf16' if bf16 else 'fp32'}" for stage, bf16 in CASES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """run(stage, bf16, fasttrain, nudged=False) -> lf.Run, each made once per module (the status and closeness
    tests of a case share its runs)."""
    if not lf.python().exists():
        message = f"no LLaMA-Factory environment at {lf.python()}: run bash .ci/env-llamafactory"
        if os.environ.get("FASTTRAIN_REQUIRE_CLIENTS") == "1":
            pytest.fail(message + " (FASTTRAIN_REQUIRE_CLIENTS=1)")
        pytest.skip(message)
    root = tmp_path_factory.mktemp("llamafactory")
    paths = lf.prepare(root)
    done: dict[tuple, lf.Run] = {}

    def run(stage: str, bf16: bool, fasttrain: str | None, nudged: bool = False) -> lf.Run:
        key = (stage, bf16, fasttrain, nudged)
        if key not in done:
            name = f"{stage}-{'bf16' if bf16 else 'fp32'}-{fasttrain or 'plain'}{'-nudged' * nudged}"
            model = paths["nudged" if nudged else "model"]
            cfg = lf.config(stage, model, paths["data"], root / name / "out", bf16=bf16)
            done[key] = lf.train(cfg, root / name, fasttrain)
            print(f"[llamafactory] {name}: {done[key].wall_s:.1f} s")
        return done[key]

    return run


def scale(key: str, step: dict, steps: list[dict], stage: str) -> float:
    """The magnitude ``key``'s rounding at ``step`` scales with (see the module's docstring)."""
    logps = max((abs(s[k]) for s in steps for k in ("logps/chosen", "logps/rejected") if k in s), default=0.0)
    if key.startswith("logits/"):
        return max(abs(s[k]) for s in steps for k in s if k.startswith("logits/"))
    if key.startswith("rewards/") or key == "kl":
        return BETA * logps
    if key == "loss" and stage != "sft":
        return max(abs(step[key]), BETA * logps)
    return abs(step[key])


def rounded(key: str) -> bool:
    """Whether ``key`` is compared within the bound (else it must be equal: see the module's docstring)."""
    return key not in EXACT and key != "rewards/accuracies"


def assert_steps_close(plain: lf.Run, fast: lf.Run, probe: lf.Run, stage: str, bf16: bool) -> None:
    assert len(plain.steps) == len(fast.steps) == len(probe.steps) == 4
    off = []
    for a, b, n in zip(plain.steps, fast.steps, probe.steps, strict=True):
        assert a.keys() == b.keys() == n.keys(), (a["step"], sorted(a), sorted(b), sorted(n))
        rewards = [a[k] for k in a if k.startswith("rewards/") and k != "rewards/accuracies"]
        for key in a:
            decided = key != "rewards/accuracies" or any(r != 0.0 for r in rewards)
            if not rounded(key) and decided and a[key] != b[key]:
                off.append(f"step {a['step']} {key}: plain {a[key]!r}, fasttrain {b[key]!r} (must be equal)")
    for key in filter(rounded, plain.steps[0]):
        probe_distance = max(abs(a[key] - n[key]) for a, n in zip(plain.steps, probe.steps, strict=True))
        for a, b in zip(plain.steps, fast.steps, strict=True):
            assert math.isfinite(a[key]) and math.isfinite(b[key]), (a["step"], key, a[key], b[key])
            s = scale(key, a, plain.steps, stage)
            assert probe_distance <= PROBE_CAP[bf16] * s, (
                f"{key}: the probe moved {probe_distance:.3e}, over {PROBE_CAP[bf16]} of the scale {s:.3e}"
            )
            limit = K * probe_distance + RTOL[bf16] * s
            if not abs(a[key] - b[key]) <= limit:
                off.append(
                    f"step {a['step']} {key}: plain {a[key]!r}, fasttrain {b[key]!r}, |diff| "
                    f"{abs(a[key] - b[key]):.3e} > limit {limit:.3e} (probe's distance {probe_distance:.3e}, scale {s:.3e})"
                )
    assert not off, "fasttrain's run differs from the plain run:\n" + "\n".join(off)


@pytest.mark.parametrize(("stage", "bf16"), CASES, ids=IDS)
def test_fasttrain_logs_the_plain_runs_values(runs, stage, bf16):
    plain, fast = runs(stage, bf16, None), runs(stage, bf16, lf.default_variant())
    assert plain.status is None, f"the plain run has fasttrain in it: {plain.status_line}"
    assert fast.status is not None, (
        f"fasttrain did not run in llamafactory-cli (no status line; variant {lf.default_variant()!r})"
    )
    assert_steps_close(plain, fast, runs(stage, bf16, None, nudged=True), stage, bf16)


@pytest.mark.parametrize(("stage", "bf16"), CASES, ids=IDS)
def test_fasttrain_status(runs, stage, bf16):
    fast = runs(stage, bf16, lf.default_variant())
    assert fast.status is not None, (
        f"fasttrain did not run in llamafactory-cli (no status line; variant {lf.default_variant()!r})"
    )
    assert list(fast.status) == list(lf.PATHS), fast.status_line
    # SFT: LLaMA-Factory's CustomSeq2SeqTrainer ends in the Trainer's loss; DPO and KTO compute log-probs
    # themselves (concatenated_forward, forward), which fasttrain's chunked log-prob head serves.
    # Their collators keep LLaMA-Factory's code and pad in Rust (test_collators_pad_in_rust_and_batch_the_same).
    expected = {"optimizer": "on", "clip": "on", "loss": "on", "collator": "on"}
    assert {path: fast.status[path] for path in expected} == expected, fast.status_line


def test_collators_pad_in_rust_and_batch_the_same(tmp_path):
    """LLaMA-Factory's SFT, pairwise and KTO collators against their fasttrain twins, in LLaMA-Factory's
    environment: the same batches byte for byte over batch sizes, lengths, padding sides, pad_to_multiple_of and
    neat packing, padded in Rust (tests/_llamafactory_collators.py)."""
    if not lf.python().exists():
        message = f"no LLaMA-Factory environment at {lf.python()}: run bash .ci/env-llamafactory"
        if os.environ.get("FASTTRAIN_REQUIRE_CLIENTS") == "1":
            pytest.fail(message + " (FASTTRAIN_REQUIRE_CLIENTS=1)")
        pytest.skip(message)
    script = Path(__file__).with_name("_llamafactory_collators.py")
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(lf.python()), str(script)], capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert done.stdout.strip().splitlines()[-1].startswith("OK 64 batches identical"), done.stdout[-2000:]
