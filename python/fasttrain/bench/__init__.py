"""``fasttrain bench``: the transformers Trainer and fasttrain side by side on the same model, data and seed.

Layout: ``corpus`` (the stdlib source corpus), ``tokenizer`` (a BPE trained on it, cached), ``models``
(built-in Qwen3 shapes), ``data`` (examples), ``config`` (one run's settings), ``worker`` (one training run
in a child process), ``runner`` (alternating runs, progress), ``report`` (table, JSON, Markdown, plot).
"""
