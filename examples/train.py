"""A plain transformers causal-LM fine-tuning script, made faster by one line: ``fasttrain.patch()``.

Runs unchanged on one device, under DDP, DeepSpeed ZeRO-1/2/3 and FSDP2 (the launch configs beside this file;
see examples/README.md). Every TrainingArguments flag works (``--bf16``, ``--max_steps``, ``--save_strategy``...);
the script's own:

    --model_name_or_path NAME   a causal LM from the hub or a folder (default: a tiny random Qwen3, no download)
    --dataset_name NAME         a dataset with a ``text`` column (default: random token rows, no download)
    --max_length N              tokens per example (default 128)

``--seed`` (a TrainingArguments flag) seeds the model's initialisation and the random rows: two runs with the
same seed log the same values.

    python examples/train.py --output_dir out --max_steps 20
    accelerate launch --config_file examples/accelerate/fsdp2_full_shard.yaml examples/train.py --output_dir out

The run prints fasttrain's status line once, after the first optimizer step: which hot paths ran
(``optimizer=on clip=on loss=on ...``) and, for any that did not, why.
"""

from __future__ import annotations

import dataclasses
import random

import datasets
import tokenizers
import transformers

import fasttrain

fasttrain.patch()  # every Trainer built from here on (TRL's too) uses fasttrain's hot paths


@dataclasses.dataclass
class ScriptArguments:
    model_name_or_path: str | None = None
    dataset_name: str | None = None
    max_length: int = 128
    rows: int = 512  # rows of the random dataset


def tiny_model() -> tuple[transformers.PreTrainedModel, int]:
    config = transformers.Qwen3Config(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        pad_token_id=0,
    )
    return transformers.AutoModelForCausalLM.from_config(config), config.vocab_size


def tiny_tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    words = {"[PAD]": 0, "[UNK]": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def random_rows(n: int, vocab: int, max_length: int, seed: int) -> datasets.Dataset:
    rng = random.Random(seed)
    ids = [[rng.randrange(2, vocab) for _ in range(rng.randint(8, max_length))] for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": ids})


def main() -> None:
    parser = transformers.HfArgumentParser((ScriptArguments, transformers.TrainingArguments))
    script, args = parser.parse_args_into_dataclasses()
    # The Trainer seeds itself only once it is built; the model's random initialisation comes first, so seed it
    # here or two runs with the same --seed start from different weights
    transformers.set_seed(args.seed)
    if script.model_name_or_path is None:
        model, vocab = tiny_model()
        tokenizer = tiny_tokenizer(vocab)
        train = random_rows(script.rows, vocab, script.max_length, args.seed)
    else:
        tokenizer = transformers.AutoTokenizer.from_pretrained(script.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = transformers.AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
        if script.dataset_name is None:
            train = random_rows(script.rows, len(tokenizer), script.max_length, args.seed)
        else:
            text = datasets.load_dataset(script.dataset_name, split="train")
            train = text.map(
                lambda rows: tokenizer(rows["text"], truncation=True, max_length=script.max_length),
                batched=True,
                remove_columns=text.column_names,
            )
    # pads input_ids and attention_mask; labels = input_ids with -100 on the padding (fasttrain's Rust copy)
    collator = transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()
    if trainer.is_world_process_zero():
        print("fasttrain status:", getattr(trainer, "fasttrain_status", "not patched"))


if __name__ == "__main__":
    main()
