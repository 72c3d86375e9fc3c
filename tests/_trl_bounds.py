"""The per-step bounds of the TRL tests (tests/test_trl_patch.py, tests/test_trl_rl.py), by whether the run is bf16.

bf16 autocast: both heads run the matmul in bf16 but reduce in their own order; that ours runs under the same
autocast is checked by structure (test_trl_patch._assert_under_accelerate_autocast)."""

from __future__ import annotations

import _truth

BOUNDS = {False: _truth.FP32_STEP, True: _truth.BF16_STEP}
