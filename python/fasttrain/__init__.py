"""fasttrain: a faster drop-in for the Hugging Face ``transformers`` Trainer.

``import fasttrain`` is cheap: the public names below are resolved on first use, so a script that only
needs the collators does not pay for importing the Trainer, and one that never trains does not import
triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it (relative to this package)
_EXPORTS: dict[str, str] = {
    "Trainer": ".trainer",
    "TrainingArguments": ".trainer",
    "HotPaths": ".hot_paths",
    "patch": ".patching",
    "unpatch": ".patching",
    "FusedAdamW": ".optim",
    "fused_linear_cross_entropy": ".loss",
    "DataCollatorWithPadding": ".data.collators",
    "DataCollatorForLanguageModeling": ".data.collators",
    "DataCollatorForSeq2Seq": ".data.collators",
    "DataCollatorWithFlattening": ".data.collators",
    "LengthGroupedSampler": ".data.sampler",
    "DistributedLengthGroupedSampler": ".data.sampler",
    "TokenBudgetBatchSampler": ".data.sampler",
}

__all__ = [
    "DataCollatorForLanguageModeling",
    "DataCollatorForSeq2Seq",
    "DataCollatorWithFlattening",
    "DataCollatorWithPadding",
    "DistributedLengthGroupedSampler",
    "FusedAdamW",
    "HotPaths",
    "LengthGroupedSampler",
    "TokenBudgetBatchSampler",
    "Trainer",
    "TrainingArguments",
    "__version__",
    "fused_linear_cross_entropy",
    "patch",
    "unpatch",
]
assert set(__all__) == {*_EXPORTS, "__version__"}


def __getattr__(name: str) -> Any:
    if name == "__version__":
        # One source: Cargo.toml's version, compiled into the native module (and written by maturin into
        # the wheel's metadata), so the package, the wheel and the extension cannot disagree.
        from ._native import __version__

        globals()["__version__"] = __version__
        return __version__
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'fasttrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name, __name__), name)
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from ._native import __version__
    from .data.collators import (
        DataCollatorForLanguageModeling,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        DataCollatorWithPadding,
    )
    from .data.sampler import DistributedLengthGroupedSampler, LengthGroupedSampler, TokenBudgetBatchSampler
    from .hot_paths import HotPaths
    from .loss import fused_linear_cross_entropy
    from .optim import FusedAdamW
    from .patching import patch, unpatch
    from .trainer import Trainer, TrainingArguments
