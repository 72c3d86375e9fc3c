"""``fasttrain bench``: the transformers Trainer and fasttrain side by side on the same model, data and seed.

The command is the product; this package is its implementation, not a library: nothing here is public API
and any module may change with the command. (The scripts under benchmarks/ share benchmarks/_common.py, and
tests/test_bench_scripts.py keeps them off this package.)

Layout: ``corpus`` (the stdlib source corpus), ``tokenizer`` (a BPE trained on it, cached), ``models``
(built-in Qwen3 shapes), ``data`` (examples), ``config`` (one run's settings), ``worker`` (one training run
in a child process), ``runner`` (alternating runs, progress), ``summary`` (medians, ratios), ``report``
(table, JSON, Markdown, plot), ``trl_runs`` (the TRL trainers), ``rl_runs`` (GRPO and RLOO: prompts, completions),
``rewards`` (their reward functions), ``phases`` (a generating step's generation and training phases, apart),
``presets`` (every default), ``provenance`` (where a result came from). How it measures: docs/method.md.
"""
