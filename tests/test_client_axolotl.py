"""Axolotl's own CLI on CPU, plain and under fasttrain: the same steps, the same numbers, and fasttrain's status.

Each case runs `axolotl train cfg.yml` twice on the same tiny model, data and seed (tests/_client_axolotl.py):
plain, and under fasttrain as FASTTRAIN_AXOLOTL_VIA says: `plugin` (the default: `fasttrain: true` in the YAML,
read by fasttrain's Axolotl plugin) or `sitecustomize` (`fasttrain.patch()` from a sitecustomize.py). The runs need
CI's Axolotl environment (`bash .ci/env-axolotl`, or FASTTRAIN_AXOLOTL_PYTHON): without it these tests skip, and
fail under FASTTRAIN_REQUIRE_CLIENTS=1. About a minute a run; marked `client`, outside the default selection:

    bash .ci/env-axolotl && .venv/bin/python -m pytest -m client tests/test_client_axolotl.py
"""

from __future__ import annotations

import os
import subprocess

import pytest

import _client_axolotl as client

pytestmark = pytest.mark.client

VIA = os.environ.get("FASTTRAIN_AXOLOTL_VIA", "plugin")

# fp32: both runs do the same arithmetic up to rounding order (fasttrain's fused AdamW and one-pass norm; once its
# loss path runs, the chunked cross-entropy's online log-sum-exp). Measured with the optimizer alone: SFT losses
# equal and grad_norm within 9.1e-8 (about one float32 unit), DPO within 1.7e-7. 1e-5 leaves fifty times that for
# rounding to grow over four updates (Adam turns a rounding-level difference in a near-zero gradient into an
# update-sized one). What it catches, measured on plain runs: no clipping instead of clipping at 1.0 moves
# grad_norm by 5.6e-4 at step 3. What it cannot: clipping at 0.5 instead moves nothing by more than 7.5e-6, as
# Adam all but cancels a uniform scale of the gradients; the clip's own exactness is fasttrain's unit tests' job.
FP32_RTOL = 1e-5
# bf16 (weights and autocast in bf16 on CPU; tests/_client_axolotl.py says how): the runs round their bf16 products
# and updates apart, so the logged values part by more than float32 rounding. Measured with the optimizer alone:
# loss within 2.3e-5, grad_norm within 1.4e-4. The bound is one bf16 unit (2**-7): a logged mean over hundreds of
# tokens that moves by a whole unit of the format is no longer rounding. Only gross errors show at that bound (a
# missing clip does not: the fp32 case is the one that sees it); plain Axolotl repeats its own runs bit for bit.
BF16_RTOL = 2**-7
# The bf16 pair is also marked slow: CI's clients stage leaves it out (about 140 s of a stage that must fit CI's
# 45 minutes; LLaMA-Factory's bf16 SFT pair runs there and takes the same fasttrain paths under bf16 autocast).
# Run it with `bash .ci/clients -m client`.
PRECISIONS = pytest.mark.parametrize(
    "bf16", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fp32", "bf16"]
)


@pytest.fixture(scope="module")
def interpreter():
    path = client.python()
    if not path.is_file():
        message = (
            f"no Axolotl environment at {path}: run `bash .ci/env-axolotl` (or set FASTTRAIN_AXOLOTL_PYTHON)"
        )
        if os.environ.get("FASTTRAIN_REQUIRE_CLIENTS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return path


@pytest.fixture(scope="module")
def runs(interpreter, tmp_path_factory):
    """``runs(kind, bf16)``: the plain run and the fasttrain run of that case, each made once per module."""
    if VIA not in ("plugin", "sitecustomize"):
        pytest.fail(f"FASTTRAIN_AXOLOTL_VIA={VIA!r}: use plugin or sitecustomize")
    root = tmp_path_factory.mktemp("axolotl")
    client.write_fixtures(interpreter, root)
    made: dict[tuple[str, bool], tuple[client.Run, client.Run]] = {}

    def get(kind: str, bf16: bool = False) -> tuple[client.Run, client.Run]:
        if (kind, bf16) not in made:
            settings = client.config(kind, root, bf16=bf16)
            name = f"{kind}-{'bf16' if bf16 else 'fp32'}"
            pair = tuple(
                client.train(interpreter, settings, root / f"{name}-{via}", via) for via in ("plain", VIA)
            )
            for via, run in zip(("plain", VIA), pair, strict=True):
                print(f"[axolotl] {name} {via}: {run.wall_s:.1f} s")
            made[kind, bf16] = pair
        return made[kind, bf16]

    return get


def assert_same_steps(plain: client.Run, ours: client.Run, keys: tuple[str, ...], rtol: float) -> None:
    # without fasttrain in the second run this would compare Axolotl with itself
    assert ours.statuses, (
        "the fasttrain run logged no status line: fasttrain did not run there, or did not say so"
    )
    assert len(plain.steps) == len(ours.steps) == client.STEPS
    for step, (a, b) in enumerate(zip(plain.steps, ours.steps, strict=True), start=1):
        assert b["step"] == a["step"] == step
        assert b["learning_rate"] == a["learning_rate"], f"learning_rate differs at step {step}"
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=rtol), f"{key} differs at step {step}"


def the_status(plain: client.Run, ours: client.Run) -> dict[str, str]:
    """The fasttrain run's status fields. The plain run has none: the plugin stays out unless asked for."""
    assert plain.statuses == []
    assert len(ours.statuses) == 1, (
        f"expected one fasttrain status line, got {ours.statuses} (Axolotl's console shows loggers other than its "
        "own from LOG_LEVEL up, WARNING by default: an INFO line of the `fasttrain` logger does not show)"
    )
    status = client.parse_status(ours.statuses[0])
    assert list(status) == list(client.HOT_PATHS)
    return status


@PRECISIONS
def test_sft_steps_match_plain_axolotl(runs, bf16):
    plain, ours = runs("sft", bf16)
    assert_same_steps(plain, ours, ("loss", "grad_norm"), BF16_RTOL if bf16 else FP32_RTOL)


@PRECISIONS
def test_sft_status_says_optimizer_clip_and_loss_on(runs, bf16):
    status = the_status(*runs("sft", bf16))
    assert status["optimizer"] == "on"
    assert status["clip"] == "on"
    assert status["loss"] == "on"
    assert status["collator"] == "on"  # the plugin's Rust twin of Axolotl's DataCollatorForSeq2Seq


def test_dpo_steps_match_plain_axolotl(runs):
    plain, ours = runs("dpo")
    assert_same_steps(plain, ours, ("loss", "grad_norm", "logps/chosen", "logps/rejected"), FP32_RTOL)


def test_dpo_status_says_optimizer_and_clip_on(runs):
    status = the_status(*runs("dpo"))
    assert status["optimizer"] == "on"
    assert status["clip"] == "on"
    # Axolotl 0.21 pins TRL 1.14.1, whose DPOTrainer has no fused-head contract to serve (docs/support.md)
    assert status["loss"] == (
        "off: TRL 1.14.1 has no fused LM head (the contract fasttrain serves, added in TRL 1.16): its trainers "
        "compute their log-probs and metrics from the full logits inside their own loss, so their loss keeps "
        "TRL's path"
    )


# Checked here, not in the main environment: Axolotl brings bitsandbytes (its 8-bit optimizers), and with
# bitsandbytes installed, peft imports it -- and through it torch's Inductor -- whenever transformers' Trainer is
# imported: about 8 CPU-seconds more for every training process the other tests start.
_MAPS_ARE_BITSANDBYTES = """
import torch
from bitsandbytes.functional import create_dynamic_map
from fasttrain.optim import blockwise8

tables = blockwise8.tables(torch.device("cpu"))
for signed, key in ((True, blockwise8.SIGNED), (False, blockwise8.UNSIGNED)):
    theirs = create_dynamic_map(signed=signed)
    assert torch.equal(tables[key], theirs), (signed, (tables[key] - theirs).abs().max().item())
print("equal")
"""


def test_fasttrain_8bit_maps_are_the_bitsandbytes_maps(interpreter):
    """fasttrain's 8-bit state quantizes with bitsandbytes' dynamic maps, value for value (the format a user of
    bitsandbytes' 8-bit AdamW expects)."""
    done = subprocess.run([str(interpreter), "-c", _MAPS_ARE_BITSANDBYTES], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "equal", done.stderr[-3000:]
