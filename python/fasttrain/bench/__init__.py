"""``fasttrain bench``: the transformers Trainer and fasttrain side by side on the same model, data and seed.

The command is the product; this package is its implementation, not a library: nothing here is public API
and any module may change with the command (benchmarks/_common.py says what the scripts may use).

A run: ``presets`` and ``config`` (its settings), ``runner`` (alternating child processes), ``worker`` (one
training run: ``data`` from ``corpus`` and ``tokenizer``, ``models``, TRL's trainers in ``trl_runs``,
``rl_runs``), ``summary`` and ``report`` (medians, ratios, the outputs). How it measures: docs/method.md.
"""
