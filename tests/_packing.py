"""What the packing tests share: the tiny config of each family on the packing allow-list, and a batch of examples
packed exactly as fasttrain's packer packs it."""

from __future__ import annotations

import _tiny as tiny
import fasttrain
from fasttrain.data import packing

# what each family on the allow-list takes over tiny.config's settings
SETTINGS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "mistral": {"sliding_window": None},
    # a sliding window shorter than the longest example: the window is applied per example in the packed row
    "gemma2": {"sliding_window": 6},
    "gemma3_text": {"sliding_window": 6},
    "phi3": {},
    "olmo2": {},
}


def config(family: str):
    """The tiny config of a packing family, with the tiny tokenizer's [EOS] (2) as its end-of-sequence id."""
    return tiny.config(family, eos_token_id=2, bos_token_id=1, **SETTINGS[family])


def packed(examples, flash: bool = False) -> packing.PackedBatch:
    collator = fasttrain.DataCollatorForSeq2Seq(tiny.tokenizer(), padding=True)
    batch = packing.PackingCollator(collator, flash=flash)([dict(e) for e in examples])
    assert isinstance(batch, packing.PackedBatch)
    return batch
