"""The tiny local inputs of an Axolotl run: a Qwen3-architecture model, its tokenizer and the datasets.

Run as a script by the Axolotl environment's own Python (tests/_client_axolotl.py does), so that the model and the
tokenizer are written by the transformers and tokenizers that load them again in Axolotl's CLI:

    .ci-envs/axolotl/bin/python tests/_axolotl_fixtures.py DIR

DIR/model holds the model and tokenizer, DIR/sft.jsonl alpaca rows, DIR/dpo.jsonl preference rows. No hub access.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

# A small English vocabulary, so that the byte-level BPE learns real merges and the alpaca template's own words
# are tokens of it (a tokenizer of unknown tokens would make every row alike).
_TEXT = (
    "the a of to and in is it that for on with as was by this be are from or an at not but have which one all "
    "were they when can there been if more will would so what up out about into than them only other some time "
    "could these two may then first any like now my such make over our even most after also made many before "
    "must through back years where much your way well down should because each just those people how too little "
    "state good very world still own see men work long get here between both life being under never day same "
    "another know while last might great old year off come since against go came right used take three"
)
WORDS = _TEXT.split()
INSTRUCTIONS = (
    "Sort these words alphabetically.",
    "Repeat the words in reverse order.",
    "Write a sentence that uses every word.",
    "Name the longest word.",
    "Count the words.",
)
# Qwen3's special tokens and ChatML template (the template Axolotl's `chat_template: tokenizer_default` renders
# for DPO's chat_template.default rows); <|im_end|> ends a turn and is the EOS, as in Qwen3's tokenizer.
PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
VOCAB_SIZE = 512


def _words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def sft_rows(n: int, seed: int) -> list[dict]:
    """Alpaca rows (instruction, input, output) of varied length; every third has no input, as in alpaca."""
    rng = random.Random(seed)
    return [
        {
            "instruction": rng.choice(INSTRUCTIONS),
            "input": "" if i % 3 == 2 else _words(rng, 3, 30),
            "output": _words(rng, 2, 40),
        }
        for i in range(n)
    ]


def dpo_rows(n: int, seed: int) -> list[dict]:
    """Rows of Axolotl's `chat_template.default` DPO format: the prompt as messages, each answer one message."""
    rng = random.Random(seed)
    return [
        {
            "messages": [{"role": "user", "content": f"{rng.choice(INSTRUCTIONS)} {_words(rng, 3, 20)}"}],
            "chosen": {"role": "assistant", "content": _words(rng, 2, 24)},
            "rejected": {"role": "assistant", "content": _words(rng, 2, 24)},
        }
        for _ in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def tokenizer(texts: list[str]):
    """A byte-level BPE trained on ``texts`` with Qwen3's special tokens and a ChatML template."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, chat_template=CHAT_TEMPLATE
    )


def model(tok, seed: int):
    """A Qwen3-architecture causal LM: 2 layers, hidden 64, fp32, at random initialisation."""
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def write(root: Path, seed: int = 0) -> None:
    sft, dpo = sft_rows(64, seed), dpo_rows(64, seed + 1)
    write_jsonl(root / "sft.jsonl", sft)
    write_jsonl(root / "dpo.jsonl", dpo)
    # The alpaca template's own text (Axolotl's AlpacaPrompter) is part of what the tokenizer learns from.
    texts = [
        " ".join(WORDS),
        "Below is an instruction that describes a task. ### Instruction: ### Input: ### Response:",
    ]
    texts += [" ".join(row.values()) for row in sft]
    texts += [row["messages"][0]["content"] + " " + row["chosen"]["content"] for row in dpo]
    tok = tokenizer(texts)
    tok.save_pretrained(root / "model")
    model(tok, seed).save_pretrained(root / "model")


if __name__ == "__main__":
    write(Path(sys.argv[1]))
