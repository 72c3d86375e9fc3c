"""The causal-LM label rule, written once: which token each label is predicted from.

transformers' ``ForCausalLMLoss`` scores the token at position ``p`` from the hidden state at ``p - 1``: it pads
the labels with one ``ignore_index`` at the end and drops the first, so position ``p`` is trained on
``labels[p + 1]``. Every Python path of fasttrain that shifts labels calls :func:`shift_labels`; the Rust packer
(``_native.pack_padded``) and TRL's padding-free rows apply the same rule to packed rows, where each example's first
label is ignored (nothing of its own example predicts it): :func:`ignore_example_starts`. tests/test_labels.py checks
the packer against these two functions.
"""

from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100  # the label transformers' and TRL's losses ignore


def shift_labels(labels: Any, ignore_index: int = IGNORE_INDEX) -> Any:
    """``labels`` ``[..., seq]`` shifted left by one, with ``ignore_index`` at the end (``ForCausalLMLoss``'s rule):
    the label each position's hidden state is trained to predict."""
    import torch.nn.functional as F

    return F.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def ignore_example_starts(labels: Any, position_ids: Any, ignore_index: int = IGNORE_INDEX) -> Any:
    """In a packed row (``position_ids`` restarting at 0 at each example), ignore each example's first label, in
    place: after the shift it would be predicted from the previous example's last token."""
    labels[position_ids == 0] = ignore_index
    return labels
