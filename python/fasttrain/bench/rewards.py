"""The reward functions of ``fasttrain bench --trainer grpo|rloo``: cheap, deterministic functions of the completion's
token ids, so that rewards cost nothing beside the step and are the same for the same completions on both sides.

TRL calls each with ``prompts``, ``completions`` (text), ``completion_ids`` and the dataset's other columns, and logs
each one's mean as ``rewards/<function name>/mean``.
"""

from __future__ import annotations

# The length the length reward prefers, in tokens: about half of the default completion limit (512)
TARGET_LENGTH = 256


def length_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """1 at ``TARGET_LENGTH`` tokens, falling linearly to 0 at no tokens or twice the target, negative beyond."""
    return [1.0 - abs(len(ids) - TARGET_LENGTH) / TARGET_LENGTH for ids in completion_ids]


def distinct_tokens_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """The share of the completion's tokens that are distinct (1: no token repeated; repetitive text scores lower)."""
    return [len(set(ids)) / len(ids) if ids else 0.0 for ids in completion_ids]


REWARD_FUNCS = (length_reward, distinct_tokens_reward)
