"""Run in LLaMA-Factory's environment (tests/test_client_llamafactory.py does): LLaMA-Factory's SFT, pairwise and
KTO collators against their fasttrain twins (``fasttrain.integration.llamafactory.native_collator``), which run
LLaMA-Factory's own code around fasttrain's Rust padding. Every batch must be the same, byte for byte (type, keys
in order, dtypes, shapes, values), for batches of 1 to 16 rows up to 2,048 tokens, right and left padding,
pad_to_multiple_of 8 and none, and neat packing's 4D mask. The twin must have used the Rust padding (its calls
counted), and a collator of another class must get no twin. Prints one line per case; exits non-zero on the first
difference."""

from __future__ import annotations

import sys

import numpy as np
import tokenizers
import torch
import transformers

from fasttrain.data import collators as fast_collators
from fasttrain.integration.llamafactory import native_collator

IGNORE_INDEX = -100
MEDIA = ("images", "videos", "audios")


def tokenizer(padding_side: str):
    words = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, 100)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
    fast.padding_side = padding_side
    return fast


def collators(padding_side: str, multiple: int | None, neat_packing: bool):
    """The three collators as LLaMA-Factory's workflows build them (the qwen3 template, a text model)."""
    from llamafactory.data import (
        KTODataCollatorWithPadding,
        PairwiseDataCollatorWithPadding,
        SFTDataCollatorWith4DAttentionMask,
        get_template_and_fix_tokenizer,
    )
    from llamafactory.hparams import DataArguments

    tok = tokenizer(padding_side)
    template = get_template_and_fix_tokenizer(tok, DataArguments(template="qwen3"))
    config = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
    )
    common = dict(
        template=template,
        model=transformers.AutoModelForCausalLM.from_config(config),
        processor=None,
        pad_to_multiple_of=multiple,
        label_pad_token_id=IGNORE_INDEX,
        tokenizer=tok,
    )
    sft = SFTDataCollatorWith4DAttentionMask(
        **common,
        block_diag_attn=neat_packing,
        neat_packing=neat_packing,
        attn_implementation="sdpa",
        compute_dtype=torch.float32,
    )
    return {
        "sft": sft,
        "dpo": PairwiseDataCollatorWithPadding(**common),
        "kto": KTODataCollatorWithPadding(**common),
    }


def row(rng, high: int) -> dict:
    n = int(rng.integers(2, high + 1))
    ids = rng.integers(2, 100, n).tolist()
    prompt = int(rng.integers(1, n))
    return {"input_ids": ids, "attention_mask": [1] * n, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]}


def rows(stage: str, batch: int, rng, high: int) -> list[dict]:
    """Rows as LLaMA-Factory's dataset processors write them, media columns None."""
    out = []
    for i in range(batch):
        if stage == "sft":
            r = row(rng, high)
        elif stage == "dpo":
            r = {f"{side}_{k}": v for side in ("chosen", "rejected") for k, v in row(rng, high).items()}
        else:
            r = {
                **row(rng, high),
                **{f"kl_{k}": v for k, v in row(rng, high).items()},
                "kto_tags": i % 3 != 1,
            }
        out.append({**r, **dict.fromkeys(MEDIA)})
    return out


def difference(a, b) -> str | None:
    if type(a) is not type(b):
        return f"type {type(a).__name__} vs {type(b).__name__}"
    if list(a.keys()) != list(b.keys()):
        return f"keys {list(a.keys())} vs {list(b.keys())}"
    for k in a.keys():  # noqa: SIM118 - BatchEncoding
        x, y = a[k], b[k]
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y):
            return f"{k}: {x.dtype} {tuple(x.shape)} vs {y.dtype} {tuple(y.shape)}, or other values"
    return None


def main() -> None:
    rng = np.random.default_rng(0)
    native_calls = []
    real_native = fast_collators.DataCollatorForSeq2Seq._native_call

    def counting(self, *args, **kwargs):
        native_calls.append(1)
        return real_native(self, *args, **kwargs)

    fast_collators.DataCollatorForSeq2Seq._native_call = counting
    cases = 0
    for side in ("right", "left"):
        for multiple in (8, None):
            for neat in (False, True):
                for stage, theirs in collators(side, multiple, neat).items():
                    if neat and stage != "sft":
                        continue
                    ours = native_collator(theirs)
                    assert ours is not None and type(ours).__module__.startswith("fasttrain."), (stage, ours)
                    for batch, high in ((1, 9), (2, 40), (7, 300), (16, 2048)):
                        features = rows(stage, batch, rng, high)
                        before = len(native_calls)
                        expected = theirs([dict(r) for r in features])  # it pops the media keys: copies
                        got = ours([dict(r) for r in features])
                        diff = difference(expected, got)
                        if diff is not None:
                            sys.exit(f"{stage} {side} {multiple} neat={neat} batch {batch}: {diff}")
                        assert len(native_calls) > before, f"{stage}: the twin did not pad in Rust"
                        cases += 1
    assert native_collator(transformers.DataCollatorForSeq2Seq(tokenizer("right"))) is None
    print(f"OK {cases} batches identical, {len(native_calls)} padded in Rust")


if __name__ == "__main__":
    main()
