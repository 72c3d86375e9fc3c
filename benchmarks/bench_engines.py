"""Distributed engines with and without fasttrain: DDP, DeepSpeed ZeRO-1/2/3 and FSDP2, 2 CPU processes (gloo).

How it measures (what runs, what each figure is): docs/method.md, "Distributed engines".

    python benchmarks/bench_engines.py                       # all engines; results under benchmarks/results/
    python benchmarks/bench_engines.py --engines ddp,fsdp2 --reps 1 --steps 4 --out /tmp   # smoke run
"""

from __future__ import annotations

import itertools
import os
import random
import statistics
import time
from pathlib import Path

import datasets
import torch.distributed as dist
import transformers
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

import _common
import fasttrain

ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
WARMUP_STEPS = 2  # the first steps build optimizer state, allocate buffers, compile nothing: not timed


# ------------------------------------------------------------------------------------------------ worker side
def _status_mib(field: str) -> float:
    """VmRSS or VmHWM (the peak resident set) of this process, MiB."""
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return int(status[field].split()[0]) / 1024


def _start_engine(engine: str) -> int:
    """Start the process state the engine needs on CPU; returns this process's rank."""
    if engine.startswith("zero"):
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a minutes-long C++ build
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        state = PartialState()
        # as tests/_deepspeed_worker.py
        if dist.is_initialized() and state.num_processes != dist.get_world_size():
            state.num_processes = dist.get_world_size()
            state.process_index = dist.get_rank()
            state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return state.process_index
    if engine == "fsdp2":
        return PartialState(cpu=True, backend="gloo").process_index
    return int(os.environ.get("RANK", 0))  # DDP: the Trainer starts the state itself (use_cpu=True)


def _train(engine: str, patched: bool, a) -> dict:
    fasttrain.unpatch()
    if patched:
        fasttrain.patch()
    extra: dict = dict(use_cpu=True)  # DDP
    if engine != "ddp":
        AcceleratorState._reset_state(reset_partial_state=False)
        extra["accelerator_config"] = {"use_configured_state": True}
    if engine.startswith("zero"):
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        unset_hf_deepspeed_config()
        auto = dict.fromkeys(("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                              "gradient_clipping"), "auto")  # fmt: skip
        extra.update(use_cpu=False, deepspeed={"zero_optimization": {"stage": int(engine[-1])}, **auto})
    elif engine == "fsdp2":
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # keeps the FSDP plugin
        wrap = {"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]}
        extra.update(fsdp=True, fsdp_config=wrap)
    model = _common.tiny_qwen3(a.vocab, a.hidden, a.layers, intermediate_size=2 * a.hidden,
                               max_position_embeddings=a.seq_len)  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(Path(a.out_file).parent / f"{engine}-{patched}"), per_device_train_batch_size=a.batch,
        max_steps=a.steps, learning_rate=1e-3, warmup_steps=1, max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to=[], seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True,
        train_sampling_strategy="group_by_length", **extra,
    )  # fmt: skip
    step_ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    collator = transformers.DataCollatorForSeq2Seq(_common.word_level_tokenizer(a.vocab), padding=True)
    rng = random.Random(0)  # rows of random tokens and lengths, twice what the steps take
    ids = [[rng.randrange(2, a.vocab) for _ in range(rng.randint(a.seq_len // 2, a.seq_len))]
           for _ in range(a.steps * a.batch * 2)]  # fmt: skip
    dataset = datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})
    trainer = transformers.Trainer(model, args, collator, dataset, callbacks=[StepClock()])
    Path("/proc/self/clear_refs").write_text("5")  # resets this process's peak resident set (VmHWM)
    rss_start = _status_mib("VmRSS")
    trainer.train()
    steps = [b - a_ for a_, b in itertools.pairwise(step_ends)][WARMUP_STEPS - 1 :]
    fasttrain.unpatch()
    return {
        "step_s": statistics.median(steps),
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        # what the run added at its peak over what the process held when it started: DeepSpeed keeps some memory
        # of earlier runs in the process, so absolute peaks grow from run to run and would favour the first
        "peak_rss_growth_mib": _status_mib("VmHWM") - rss_start,
        "rss_start_mib": rss_start,
        "status": dict(getattr(trainer, "fasttrain_status", {})),
        "distributed_type": str(trainer.accelerator.distributed_type),
        "world_size": trainer.args.world_size,
    }


def worker(a) -> None:
    rank = _start_engine(a.engine)
    runs: dict[str, list[dict]] = {"reference": [], "fasttrain": []}
    for _, name in itertools.product(range(a.reps), runs):
        runs[name].append(_train(a.engine, name == "fasttrain", a))
    _common.worker_done(rank, a.out_file, runs)


# ------------------------------------------------------------------------------------------------ driver side
def launch(engine: str, a) -> dict:
    """One torchrun launch of 2 processes training under ``engine``: both sides' medians, loss agreement, status."""
    started = time.perf_counter()
    job = ["--engine", engine, *_common.forwarded(a, a.sizes)]
    runs, failure = _common.torchrun(__file__, 2, job, a.threads)
    if failure:
        raise RuntimeError(f"{engine} failed: {failure}")
    ref, ours = runs["reference"], runs["fasttrain"]
    ref_s, ours_s = (statistics.median(r["step_s"] for r in side) for side in (ref, ours))
    loss_diff = max(abs(x - y) / abs(x) for x, y in zip(ref[0]["losses"], ours[0]["losses"], strict=True))
    return {"engine": engine, "distributed_type": ours[0]["distributed_type"], "world_size": ours[0]["world_size"],
            "reference_step_s": ref_s, "fasttrain_step_s": ours_s, "speedup": ref_s / ours_s,
            "max_rel_loss_diff": loss_diff, "status": ours[0]["status"], "launch_s": time.perf_counter() - started,
            **{f"{side}_peak_growth_mib": statistics.median(r["peak_rss_growth_mib"] for r in runs[side])
               for side in ("reference", "fasttrain")}, "runs": runs}  # fmt: skip


def _markdown(rows: list[dict], a) -> list[str]:
    lines = [
        f"Qwen3, hidden {a.hidden}, {a.layers} layers, vocabulary {a.vocab}; sequences of {a.seq_len // 2}..{a.seq_len}"
        f" random tokens, {a.batch} a rank per step, fp32, {a.threads} thread(s) a process; {a.steps} optimizer steps"
        f" a run, the first {WARMUP_STEPS} not timed; reference and fasttrain alternating in the same processes,"
        f" {a.reps} repetitions each; medians. fasttrain's kernels run their PyTorch backends on CPU (Triton needs a"
        " GPU). Peak memory: how far rank 0's resident set rose above its level at the start of the run, at its peak"
        " (VmHWM, reset before the run, minus VmRSS then), median over repetitions.",
        "",
        "| engine | reference step | fasttrain step | speed-up | max rel. loss difference | peak memory reference"
        " | peak memory fasttrain |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]  # fmt: skip
    lines += [f"| {r['engine']} | {r['reference_step_s'] * 1000:.1f} ms | {r['fasttrain_step_s'] * 1000:.1f} ms"
              f" | {r['speedup']:.2f}x | {r['max_rel_loss_diff']:.1e} | {r['reference_peak_growth_mib']:.0f} MiB"
              f" | {r['fasttrain_peak_growth_mib']:.0f} MiB |" for r in rows]  # fmt: skip
    lines += ["", "fasttrain's status line per engine:", ""]
    for r in rows:
        status = ", ".join(f"{k}={v}" for k, v in r["status"].items())
        lines.append(f"- {r['engine']} ({r['distributed_type']}, {r['world_size']} processes): {status}")
    return lines


def main() -> None:
    p = _common.parser(__doc__)
    sizes = dict(steps=12, reps=3, batch=4, seq_len=256, hidden=256, layers=4, vocab=16384, threads=1)
    _common.launcher_options(p, ENGINES, "--engine", **sizes)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    result = _common.new_result("engines_cpu", "deepspeed")
    rows = result["results"] = []
    for engine in a.engines.split(","):
        rows.append(row := launch(engine, a))
        print(f"{engine}: {row['speedup']:.2f}x, loss difference {row['max_rel_loss_diff']:.1e}", flush=True)
    title = "Engines with and without fasttrain: DDP, DeepSpeed ZeRO-1/2/3, FSDP2 (2 CPU processes, gloo)"
    _common.write(a.out, "engines_cpu", result, title, _markdown(rows, a))


if __name__ == "__main__":
    main()
