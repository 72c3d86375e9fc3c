"""fasttrain as an Axolotl plugin: ``fasttrain: true`` in an Axolotl config.

fasttrain's wheel registers ``FasttrainPlugin`` on Axolotl's ``axolotl.plugins`` entry points, so Axolotl loads it
on every run (also in the processes ``axolotl train`` re-launches through ``accelerate launch``); it does nothing
unless the config says::

    fasttrain: true
    fasttrain_disable: [sampler]              # optional: hot paths to leave off (names of fasttrain.HotPaths)
    fasttrain_optim_args: "state_dtype=8bit"  # optional: FusedAdamW options, as TrainingArguments.optim_args

Then, at Axolotl's hooks:

- ``pre_model_load``: refuses to stack two fused LM heads -- Liger's ``liger_fused_linear_cross_entropy``, the
  Cut-Cross-Entropy plugin or Axolotl's ``chunked_cross_entropy`` each replace the same head and loss (Liger's layer
  kernels are fine: set its fused cross-entropy off, or ``fasttrain_disable: [loss]``);
- ``post_model_load`` (after PEFT): says whether the model's loss can be fused, and why not;
- ``get_training_args``: ``fasttrain_optim_args`` become the Trainer's ``optim_args``;
- ``get_collator_cls_and_kwargs``: fasttrain's Rust ``DataCollatorForSeq2Seq`` where Axolotl would use its plain
  ``DataCollatorForSeq2Seq`` (same batches byte for byte on rows without ``position_ids``; ``collator_problem``
  says where not);
- ``post_trainer_create``: fasttrain's seam on the trainer Axolotl built (``fasttrain.integration.apply``; the fused
  forward goes on the model when training starts), its status logged after the first optimizer step -- through
  Axolotl's logging (as ``axolotl.integrations.fasttrain``), whose console shows other libraries' INFO lines only
  with ``LOG_LEVEL=INFO``.

Axolotl's ``sample_packing`` stays Axolotl's: its packing collators are not ones fasttrain replaces, so fasttrain's
collator and packing paths say so in the status and leave its batches as they are.
"""

from __future__ import annotations

import logging
from typing import Any

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, field_validator

from ..hot_paths import HotPaths

_logger = logging.getLogger("fasttrain")
# Axolotl's console shows other libraries' loggers from LOG_LEVEL up (WARNING by default) and its own from INFO up:
# fasttrain's lines go out under this name, so that its status line shows as Axolotl's own messages do
_AXOLOTL_NAME = "axolotl.integrations.fasttrain"


class _ThroughAxolotl(logging.Handler):
    """Re-logs fasttrain's records under ``axolotl.integrations.fasttrain`` (Axolotl's handlers, filters, files)."""

    def emit(self, record: logging.LogRecord) -> None:
        target = logging.getLogger(_AXOLOTL_NAME)
        target.handle(logging.makeLogRecord({**record.__dict__, "name": target.name}))


def _log_through_axolotl() -> None:
    from axolotl.logging_config import AxolotlOrWarnErrorFilter

    if not any(isinstance(h, _ThroughAxolotl) for h in _logger.handlers):
        _logger.addHandler(_ThroughAxolotl())
        _logger.propagate = False  # each line once: through Axolotl's logger only
    # A logger made after Axolotl set up logging carries Axolotl's filter for other libraries (INFO dropped):
    # fasttrain's records are Axolotl's to filter now, at its handlers, as ``axolotl.integrations.fasttrain``
    for found in [f for f in _logger.filters if isinstance(f, AxolotlOrWarnErrorFilter)]:
        _logger.removeFilter(found)


class FasttrainArgs(BaseModel):
    """The config keys this plugin adds to Axolotl's schema."""

    fasttrain: bool | None = None
    fasttrain_disable: list[str] | None = None
    fasttrain_optim_args: str | None = None

    @field_validator("fasttrain_disable", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        unknown = sorted(set(value or ()) - set(HotPaths.names()))
        if unknown:
            raise ValueError(
                f"fasttrain_disable names unknown hot paths {unknown}; known: {', '.join(HotPaths.names())}"
            )
        return value


def _on(cfg: Any) -> bool:
    return bool(cfg.get("fasttrain"))


def _hot_paths(cfg: Any) -> HotPaths:
    return HotPaths(**dict.fromkeys(cfg.get("fasttrain_disable") or (), False))


def collator_problem(cfg: Any) -> str | None:
    """Why Axolotl's collator for this config is not its plain ``DataCollatorForSeq2Seq`` on rows without
    ``position_ids`` (None: it is, and fasttrain's Rust ``DataCollatorForSeq2Seq`` makes the same batches, byte
    for byte: keys, dtypes, values, for every padding side and ``pad_to_multiple_of``)."""
    for key in (
        "sample_packing",
        "eval_sample_packing",
        "batch_flattening",
        "reward_model",
        "process_reward_model",
    ):
        if cfg.get(key):
            return f"{key} collates with another of Axolotl's collators"
    if cfg.get("processor_type"):
        return "a multimodal model collates with Axolotl's multimodal collator"
    if cfg.get("pretraining_dataset"):
        return "pretraining datasets are collated by Axolotl's pretraining path"
    if (cfg.get("context_parallel_size") or 1) > 1:
        return "context parallelism pads position_ids, which fasttrain's collator does not take"
    from axolotl.model_support import get_model_support_for_cfg, resolve_model_support

    profile = resolve_model_support(get_model_support_for_cfg(cfg))
    if profile is not None and profile.strategies.collator_factory is not None:
        return f"the {cfg.get('model_config_type')} model's support profile brings its own collator"
    return None


def stacked_heads(cfg: Any) -> list[str]:
    """The other fused LM heads this config switches on (each replaces the head and loss fasttrain serves)."""
    plugins = " ".join(cfg.get("plugins") or ())
    found = []
    if cfg.get("liger_fused_linear_cross_entropy"):
        found.append("liger_fused_linear_cross_entropy (Liger's fused linear cross-entropy)")
    if "cut_cross_entropy" in plugins and cfg.get("cut_cross_entropy"):
        found.append("cut_cross_entropy (the Cut-Cross-Entropy plugin)")
    if cfg.get("chunked_cross_entropy"):
        found.append("chunked_cross_entropy (Axolotl's chunked loss)")
    return found


class FasttrainPlugin(BasePlugin):
    """fasttrain's hot paths for the trainer Axolotl builds (``fasttrain: true``)."""

    def get_input_args(self) -> str:
        return "fasttrain.integrations.axolotl.FasttrainArgs"

    def pre_model_load(self, cfg: Any) -> None:
        if not _on(cfg):
            return
        _log_through_axolotl()
        if not _hot_paths(cfg).loss:
            return
        others = stacked_heads(cfg)
        if others:
            raise ValueError(
                f"fasttrain: fasttrain's fused cross-entropy serves the LM head and loss, and so would {', '.join(others)}"
                ": switch that off (Liger's layer kernels may stay) or set `fasttrain_disable: [loss]`"
            )

    def post_model_load(self, cfg: Any, model: Any) -> None:
        if not _on(cfg) or not _hot_paths(cfg).loss:
            return
        from ..loss.model_patch import fused_loss_problem

        problem = fused_loss_problem(model)
        if problem is None:
            _logger.info("fasttrain: %s takes the fused loss while it trains", type(model).__name__)
        else:
            _logger.warning("fasttrain: the loss keeps the model's own path: %s", problem)

    def get_collator_cls_and_kwargs(self, cfg: Any, is_eval: bool = False) -> tuple[type, dict] | None:
        """fasttrain's Rust ``DataCollatorForSeq2Seq`` where Axolotl would use its plain one (Axolotl calls it with
        the tokenizer and its own padding arguments); Axolotl's choice everywhere else."""
        if not _on(cfg) or not _hot_paths(cfg).collator:
            return None
        problem = collator_problem(cfg)
        if problem is not None:
            _logger.info("fasttrain: Axolotl's collator stays: %s", problem)
            return None
        from ..data.collators import DataCollatorForSeq2Seq

        return DataCollatorForSeq2Seq, {}

    def get_training_args(self, cfg: Any) -> dict[str, Any] | None:
        if not _on(cfg) or not cfg.get("fasttrain_optim_args"):
            return None
        if cfg.get("optim_args"):
            raise ValueError("fasttrain: set either optim_args or fasttrain_optim_args, not both")
        return {"optim_args": cfg.get("fasttrain_optim_args")}

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        if not _on(cfg):
            return
        from .. import integration

        _log_through_axolotl()
        integration.apply_from_plugin(trainer, _hot_paths(cfg))
