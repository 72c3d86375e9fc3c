"""Tiny causal LMs, a local tokenizer and a prompt-masked dataset for Trainer-level tests (no hub access)."""

from __future__ import annotations

import inspect
import random

import datasets
import pytest
import tokenizers
import torch
import transformers

VOCAB = 256


def tokenizer(padding_side: str = "right") -> transformers.PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )
    fast.padding_side = padding_side
    return fast


# The shape of every tiny test model: two layers, grouped-query attention, the tokenizer's vocabulary and pad id.
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    pad_token_id=0,
)
# The one registry of test model families: model type -> config class, and what the family's own defaults would
# get wrong at SHAPE (Qwen3's and Gemma's head_dim is fixed at 128 or 256, not hidden_size / heads).
FAMILIES = {
    "llama": (transformers.LlamaConfig, {}),
    "qwen2": (transformers.Qwen2Config, {}),
    "qwen3": (transformers.Qwen3Config, {"head_dim": 8}),
    "mistral": (transformers.MistralConfig, {}),
    "gemma": (transformers.GemmaConfig, {"head_dim": 8}),
    "gemma2": (transformers.Gemma2Config, {"head_dim": 8}),
    "gemma3_text": (transformers.Gemma3TextConfig, {"head_dim": 8}),
    "phi3": (transformers.Phi3Config, {}),
    "olmo2": (transformers.Olmo2Config, {}),
}


def config(family: str, **overrides) -> transformers.PretrainedConfig:
    """The tiny config of ``family`` (a key of FAMILIES), ``overrides`` over SHAPE and the family's settings."""
    config_class, settings = FAMILIES[family]
    return config_class(**{**SHAPE, **settings, **overrides})


def model(
    kind: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32
) -> transformers.PreTrainedModel:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(kind), dtype=dtype)


def dataset(n: int = 48, seed: int = 0, min_len: int = 6, max_len: int = 40, with_length: bool = False):
    """Token sequences of varied length whose first two tokens encode the row index (so a test can tell
    which examples a batch holds) and whose labels mask a prompt of random length with -100."""
    rng = random.Random(seed)
    rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for i in range(n):
        length = rng.randint(min_len, max_len)
        ids = [2 + i // 200, 2 + i % 200] + [rng.randint(2, VOCAB - 1) for _ in range(length - 2)]
        prompt = rng.randint(1, length - 2)
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * length)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    if with_length:
        rows["length"] = [len(x) for x in rows["input_ids"]]
    return datasets.Dataset.from_dict(rows)


def row_ids(input_ids: torch.Tensor) -> list[int]:
    """Recover the row indices encoded by ``dataset`` from a right-padded batch."""
    return [int(a - 2) * 200 + int(b - 2) for a, b in input_ids[:, :2].tolist()]


def batch_rows(inputs: dict) -> tuple[list[int], int]:
    """The row indices a training batch holds and its real tokens, padded (one example per row, an
    attention_mask) or packed by fasttrain (one row, no mask, position_ids restarting at each example)."""
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    if mask is not None or "position_ids" not in inputs:
        return row_ids(ids), int(mask.sum()) if mask is not None else ids.numel()
    starts = (inputs["position_ids"][0] == 0).nonzero().flatten().tolist()
    return row_ids(torch.stack([ids[0, starts], ids[0, [s + 1 for s in starts]]], dim=1)), ids.shape[1]


def recording(base: type) -> type:
    """``base`` (a Trainer class) that records the row indices (``row_ids``) each epoch's training steps saw,
    in ``rows_by_epoch``: the distributed tests check every example is seen exactly once per epoch."""

    class Recording(base):
        rows_by_epoch: dict[int, list[int]]

        def training_step(self, model, inputs, *args, **kwargs):
            epoch = int(self.state.epoch or 0)
            self.rows_by_epoch.setdefault(epoch, []).extend(row_ids(inputs["input_ids"]))
            return super().training_step(model, inputs, *args, **kwargs)

    return Recording


def record_forwards(trainer) -> None:
    """What ``recording`` records, read at the model's training forwards instead (a pre-hook), so that the
    Trainer's own ``training_step`` stays unoverridden and fasttrain may pack its batches."""

    def record(module, args, kwargs):
        if module.training:
            rows, tokens = batch_rows(kwargs)
            trainer.rows_by_epoch.setdefault(int(trainer.state.epoch or 0), []).extend(rows)
            trainer.batch_tokens.append(tokens)

    trainer.rows_by_epoch, trainer.batch_tokens = {}, []
    trainer.model.register_forward_pre_hook(record, with_kwargs=True)


def training_args(out: str, **overrides) -> transformers.TrainingArguments:
    base = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=3e-3,
        warmup_steps=1,
        max_grad_norm=0.5,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    base.update(overrides)
    if not hasattr(transformers.TrainingArguments, "train_sampling_strategy"):  # transformers < 5
        base["group_by_length"] = base.pop("train_sampling_strategy", None) == "group_by_length"
    return transformers.TrainingArguments(**base)


# transformers < 5 has no Trainer._clip_grad_norm (it clips inside its loop): the fused clip cannot run there
FUSED_CLIP = hasattr(transformers.Trainer, "_clip_grad_norm")
# transformers 5 counts num_items_in_batch over shifted labels (the pairs a causal LM scores), which a packed row
# keeps; 4.x counts every label, so fasttrain keeps its batches padded there
PACKING = "_loss_shifts_labels" in inspect.getsource(transformers.Trainer.__init__)
# transformers < 5 logs the loss rounded to 4 decimals
LOGGED_LOSS_ABS = 0.0 if FUSED_CLIP else 1.5e-4  # one unit in the 4th decimal, and float slack


def step_logs(trainer: transformers.Trainer) -> list[dict]:
    return [h for h in trainer.state.log_history if "loss" in h]


def assert_same_logs(ref: transformers.Trainer, ours: transformers.Trainer, rtol: float) -> None:
    """Loss (and grad_norm, when logged) equal to ``rtol`` at every logged step."""
    ref_logs, our_logs = step_logs(ref), step_logs(ours)
    assert len(ref_logs) == len(our_logs) > 0
    for step, (a, b) in enumerate(zip(ref_logs, our_logs, strict=True), start=1):
        assert b["loss"] == pytest.approx(a["loss"], rel=rtol, abs=LOGGED_LOSS_ABS), (
            f"loss differs at step {step}"
        )
        assert ("grad_norm" in a) == ("grad_norm" in b)
        if "grad_norm" in a:
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=rtol), (
                f"grad_norm differs at step {step}"
            )


def grouping_args() -> dict:
    """TrainingArguments settings that ask for length grouping, on this transformers."""
    if hasattr(transformers.TrainingArguments, "train_sampling_strategy"):
        return {"train_sampling_strategy": "group_by_length"}
    return {"group_by_length": True}


def all_on_status() -> dict[str, str]:
    """The status of a run with every hot path on and applicable, on this transformers."""
    clip = (
        "on" if FUSED_CLIP else f"off: transformers {transformers.__version__} has no Trainer._clip_grad_norm"
    )
    packing = (
        "on"
        if PACKING
        else (
            f"off: transformers {transformers.__version__} counts num_items_in_batch over unshifted labels "
            "(a packed row would change the loss's denominator)"
        )
    )
    return {
        "optimizer": "on",
        "clip": clip,
        "loss": "on",
        "collator": "on",
        "sampler": "on",
        "packing": packing,
    }


def text_dataset(n: int = 24, seed: int = 0):
    """Plain-text rows (``text``) and preference rows (``prompt``/``chosen``/``rejected``) for TRL."""
    rng = random.Random(seed)

    def words(k: int) -> str:
        return " ".join(f"t{rng.randint(3, VOCAB - 1)}" for _ in range(k))

    rows = {"text": [], "prompt": [], "chosen": [], "rejected": []}
    for _ in range(n):
        rows["text"].append(words(rng.randint(5, 30)))
        rows["prompt"].append(words(rng.randint(3, 8)))
        rows["chosen"].append(words(rng.randint(2, 8)))
        rows["rejected"].append(words(rng.randint(2, 8)))
    return datasets.Dataset.from_dict(rows)


def assert_same_updates(
    ours: torch.nn.Module, ref: torch.nn.Module, init: torch.nn.Module, rtol: float
) -> None:
    """Each parameter of ``ours`` equals ``ref``'s to ``rtol`` of the change training made to it.

    Adam normalises every update, so a rounding-level gradient difference on a near-zero gradient becomes an
    update-sized difference in that one element: compare whole tensors, as the norm of the difference relative
    to the norm of the update (a wrong learning rate, clip or gradient shows up as a ratio near 1)."""
    start = dict(init.named_parameters())
    expected = dict(ref.named_parameters())
    off = []
    for name, p in ours.named_parameters():
        update = (expected[name] - start[name]).detach().float().norm()
        diff = (p - expected[name]).detach().float().norm()
        if diff > rtol * update or (update == 0 and diff > 0):
            off.append(
                f"{name}: |ours - ref| = {diff:.3e}, |update| = {update:.3e}, ratio {diff / update:.2e}"
            )
    assert not off, f"parameters off by more than {rtol} of their update:\n" + "\n".join(off)


def bench_config(**overrides):
    """A ``fasttrain bench`` configuration at test size: the tiny model, the default data, CPU, fp32."""
    from fasttrain.bench.config import BenchConfig

    settings = dict(
        model="tiny",
        dataset="default",
        device="cpu",
        steps=3,
        seq_len=32,
        batch_size=2,
        grad_accum=1,
        bf16=False,
        seed=0,
        threads=torch.get_num_threads(),
        learning_rate=1e-3,
        warmup_steps=1,
        group_by_length=True,
    )
    settings.update(overrides)
    return BenchConfig(**settings)
