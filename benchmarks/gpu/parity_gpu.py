"""One-GPU Trainer parity: fasttrain.Trainer against transformers.Trainer, in fp32 and in bf16 autocast.

Both trainers get the same model weights (a 2-layer Qwen3 with Qwen3's 151,936-token vocabulary, so the fused
loss spans many vocabulary blocks), the same prompt-masked data of varied lengths, the same seed and
arguments (gradient accumulation 2, clipping at 1.0, group_by_length); only the Trainer class differs. A third
case, fp32 without group_by_length, has batches of mixed lengths that fasttrain packs into one padding-free row
(sdpa with the packed-sequence mask; issue 18) while the reference pads: it checks that packing on the GPU leaks
no attention across examples and keeps the loss's denominator. For each case it compares, at every optimizer
step, the logged loss and grad_norm, and at the end the parameters, as the norm of their difference relative to the norm of the reference's total update (Adam normalises each
update, so rounding-level gradient differences on near-zero gradients move single tensors by update-sized
amounts: the whole-model ratio is the meaningful one; the worst tensor is reported beside it).

Passes when fp32 agrees within FP32_TOLERANCE, bf16 within BF16_TOLERANCE, and (on the GPU) every hot path the
case is about reports "on" (grouped batches of near-equal lengths may stay padded: packing then only needs to say
why; the packed case needs packing on and has no length-grouped sampler). Writes <out>/parity_gpu.json and .md
(``parity_gpu_smoke.*`` with --smoke); exits 1 when a check fails.

    python benchmarks/gpu/parity_gpu.py [--out benchmarks/results] [--smoke]

``--smoke``: a tiny model on CPU (Triton kernels in the interpreter), to check that the script runs through.
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first import of triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse
import dataclasses
import datetime as dt
import json
import platform
import random
import shlex
import tempfile
import time
from pathlib import Path

import torch
import transformers

import fasttrain

# Per step: loss and grad_norm, relative to the reference's; at the end: the parameters' difference relative to
# the reference's update. fp32: the fused loss and the reference differ in reduction order only. bf16 autocast:
# the fused loss keeps the logits in fp32 where the reference rounds them to bf16 first.
FP32_TOLERANCE = {"loss": 1e-4, "grad_norm": 1e-3, "params": 1e-2}
BF16_TOLERANCE = {"loss": 2e-2, "grad_norm": 5e-2, "params": 0.25}

SIZES = {  # vocab, hidden, layers, heads, kv heads, head dim, intermediate, rows, max length, steps
    "gpu": dict(vocab=151_936, hidden=512, layers=2, heads=8, kv=4, head_dim=64, inter=1024, rows=128, max_len=512, steps=8),
    "smoke": dict(vocab=300, hidden=32, layers=1, heads=2, kv=1, head_dim=16, inter=64, rows=24, max_len=24, steps=3),
}  # fmt: skip


def tokenizer(vocab: int) -> transformers.PreTrainedTokenizerFast:
    """A word-level tokenizer over ``vocab`` ids: the collator only needs its pad id."""
    import tokenizers

    words = {"[PAD]": 0, "[UNK]": 1, "[EOS]": 2, **{f"t{i}": i for i in range(3, vocab)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]"
    )


def dataset(size: dict, seed: int = 0):
    """Rows of 8..max_len random ids whose labels mask a prompt of random length with -100."""
    import datasets

    rng = random.Random(seed)
    rows: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": []}
    for _ in range(size["rows"]):
        length = rng.randint(8, size["max_len"])
        ids = [rng.randint(3, size["vocab"] - 1) for _ in range(length)]
        prompt = rng.randint(1, length - 2)
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * length)
        rows["labels"].append([-100] * prompt + ids[prompt:])
    return datasets.Dataset.from_dict(rows)


def model(size: dict, device: str) -> transformers.PreTrainedModel:
    config = transformers.Qwen3Config(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv"],
        head_dim=size["head_dim"],
        intermediate_size=size["inter"],
        max_position_embeddings=max(size["max_len"], 64),
        tie_word_embeddings=True,
        pad_token_id=0,
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.Qwen3ForCausalLM(config)


def train(trainer_cls, size: dict, device: str, bf16: bool, out_dir: str, grouped: bool = True):
    tok = tokenizer(size["vocab"])
    net = model(size, device)
    initial = {name: p.detach().clone() for name, p in net.named_parameters()}
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    grouping = {}
    if grouped:  # transformers 5.x names it train_sampling_strategy; older releases group_by_length
        if "train_sampling_strategy" in fields:
            grouping["train_sampling_strategy"] = "group_by_length"
        else:
            grouping["group_by_length"] = True
    args = transformers.TrainingArguments(
        **grouping,
        output_dir=out_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=size["steps"],
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        bf16=bf16,
        use_cpu=device == "cpu",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trainer_cls(
        model=net,
        args=args,
        train_dataset=dataset(size),
        data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
        processing_class=tok,
    )
    started = time.perf_counter()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h]
    return {
        "losses": [float(h["loss"]) for h in logs],
        "grad_norms": [float(h["grad_norm"]) for h in logs],
        "params": {name: p.detach().float() for name, p in trainer.model.named_parameters()},
        "initial": {name: p.float() for name, p in initial.items()},
        "status": dict(getattr(trainer, "fasttrain_status", None) or {}),
        "train_s": time.perf_counter() - started,
    }


# (name, bf16, tolerance, group_by_length)
CASES = (
    ("fp32", False, FP32_TOLERANCE, True),
    ("bf16", True, BF16_TOLERANCE, True),
    ("fp32 packed", False, FP32_TOLERANCE, False),
)


def _as_expected(path: str, state: str, grouped: bool) -> bool:
    """Whether a hot path's status is what the case should show: on, except packing in a grouped case (batches of
    near-equal lengths stay padded where a packed row would cost more; the status says so) and the sampler in the
    ungrouped case (there is no length-grouped sampler to replace)."""
    if state == "on":
        return True
    if grouped:
        return path == "packing" and state.startswith("off: every batch stayed padded")
    return path == "sampler"


def _max_rel(reference: list[float], ours: list[float]) -> float:
    if len(reference) != len(ours) or not reference:
        return float("inf")
    return max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, ours, strict=True))


def compare(reference: dict, ours: dict) -> dict:
    diff_sq = update_sq = 0.0
    worst_name, worst = None, 0.0
    for name, p_ref in reference["params"].items():
        delta = (ours["params"][name] - p_ref).norm().item()
        update = (p_ref - reference["initial"][name]).norm().item()
        diff_sq += delta**2
        update_sq += update**2
        if update > 0 and delta / update > worst:
            worst_name, worst = name, delta / update
    return {
        "loss": _max_rel(reference["losses"], ours["losses"]),
        "grad_norm": _max_rel(reference["grad_norms"], ours["grad_norms"]),
        "params": (diff_sq**0.5) / max(update_sq**0.5, 1e-30),
        "worst_tensor": worst_name,
        "worst_tensor_rel": worst,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU (Triton interpreter)")
    args = parser.parse_args()
    if args.smoke:
        device, size = "cpu", SIZES["smoke"]
    elif torch.cuda.is_available():
        device, size = "cuda", SIZES["gpu"]
    else:
        sys.exit("parity_gpu.py: no CUDA device (use --smoke to check the script on CPU)")
    transformers.logging.set_verbosity_error()
    started = time.perf_counter()
    cases = []
    for precision, bf16, tolerance, grouped in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            reference = train(transformers.Trainer, size, device, bf16, tmp, grouped)
            ours = train(fasttrain.Trainer, size, device, bf16, tmp, grouped)
        measured = compare(reference, ours)
        failures = [key for key, bound in tolerance.items() if not measured[key] <= bound]
        off = {
            path: state for path, state in ours["status"].items() if not _as_expected(path, state, grouped)
        }
        if device == "cuda" and off:
            failures.append(f"hot paths off: {off}")
        cases.append(
            {
                "precision": precision,
                "measured": measured,
                "tolerance": tolerance,
                "passed": not failures,
                "failures": failures,
                "hot_paths": ours["status"],
                "reference_losses": reference["losses"],
                "fasttrain_losses": ours["losses"],
                "reference_grad_norms": reference["grad_norms"],
                "fasttrain_grad_norms": ours["grad_norms"],
                "train_s": {"reference": reference["train_s"], "fasttrain": ours["train_s"]},
            }
        )
        print(f"{precision}: {'ok' if not failures else 'FAILED ' + '; '.join(failures)}  {measured}")
    result = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "command": shlex.join([sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "fasttrain": fasttrain.__version__,
        },
        "size": size,
        "smoke": args.smoke,
        "passed": all(case["passed"] for case in cases),
        "cases": cases,
        "wall_s": time.perf_counter() - started,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "parity_gpu_smoke" if args.smoke else "parity_gpu"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(result))
    return 0 if result["passed"] else 1


def markdown(result: dict) -> str:
    lines = [
        "# Trainer parity on one GPU: fasttrain.Trainer vs transformers.Trainer",
        "",
        f"- date (UTC): {result['date_utc']}",
        f"- device: {result['device']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
        f"- command: `{result['command']}`",
        f"- model: Qwen3, vocab {result['size']['vocab']:,}, hidden {result['size']['hidden']}, "
        f"{result['size']['layers']} layers; {result['size']['steps']} steps x batch 4 x grad-accum 2, "
        "clip 1.0, prompt-masked labels, group_by_length (the packed case: not grouped, fasttrain packs)",
        "",
        "| precision | loss (max rel/step) | grad_norm (max rel/step) | params (diff / update) | worst tensor | result |",
        "| --- | ---: | ---: | ---: | --- | --- |",
    ]
    for case in result["cases"]:
        m, t = case["measured"], case["tolerance"]
        lines.append(
            f"| {case['precision']} | {m['loss']:.2e} (<= {t['loss']:g}) | {m['grad_norm']:.2e} (<= {t['grad_norm']:g}) "
            f"| {m['params']:.2e} (<= {t['params']:g}) | {m['worst_tensor']} {m['worst_tensor_rel']:.2e} "
            f"| {'pass' if case['passed'] else 'FAIL: ' + '; '.join(case['failures'])} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
