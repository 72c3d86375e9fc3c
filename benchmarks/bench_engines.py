"""Distributed engines with and without fasttrain: DDP, DeepSpeed ZeRO-1/2/3 and FSDP2, 2 CPU processes (gloo).

For each engine one ``torchrun`` launch trains a small Qwen3 through ``transformers.Trainer``, plain and under
``fasttrain.patch()`` alternating (reference, fasttrain, reference, ...) in the same processes, on the same data
and from the same weights. Per engine it reports, side by side:

- step time: the median over repetitions of each run's median optimizer-step time (first steps dropped as warm-up),
  and the ratio reference / fasttrain (above 1: fasttrain is faster);
- loss agreement: the largest relative difference of the logged per-step loss between the two (first repetition);
- peak memory: how far rank 0's resident set rose during the run above its level at the start (``VmHWM``, reset
  before each run through ``/proc/self/clear_refs``, minus ``VmRSS`` then), reference and fasttrain;
- fasttrain's status line for the engine.

Engines run through the Trainer the way the tests drive them on CPU: DDP with ``use_cpu=True``; DeepSpeed with
``DS_ACCELERATOR=cpu`` (tests/_deepspeed_worker.py); FSDP2 through the harness of tests/_fsdp_trainer_worker.py
(Accelerate's gloo process state relabelled so that its FSDP plugin is kept; transformers refuses FSDP on CPU
otherwise). On CPU fasttrain's kernels run their PyTorch backends (Triton needs a GPU): the ratios show the CPU
paths, not the GPU kernels.

    python benchmarks/bench_engines.py                       # all engines; results under benchmarks/results/
    python benchmarks/bench_engines.py --engines ddp,fsdp2 --reps 1 --steps 4 --out /tmp   # smoke run
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp2")
WARMUP_STEPS = 2  # the first steps build optimizer state, allocate buffers, compile nothing: not timed


# ------------------------------------------------------------------------------------------------ worker side


def _peak_rss_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5" resets the peak resident set (VmHWM) of this process
        f.write("5")


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _model(a):
    import torch
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=a.hidden // 4,
        max_position_embeddings=a.seq_len,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config)


def _dataset(a, rows: int):
    import random

    import datasets

    rng = random.Random(0)
    ids = [
        [rng.randrange(2, a.vocab) for _ in range(rng.randint(a.seq_len // 2, a.seq_len))]
        for _ in range(rows)
    ]
    return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})


def _start_engine(engine: str) -> int:
    """Start the process state the engine needs on CPU; returns this process's rank."""
    import torch.distributed as dist
    from accelerate.state import PartialState

    if engine.startswith("zero"):
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # skip a minutes-long C++ build
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        state = PartialState()
        if (
            dist.is_initialized() and state.num_processes != dist.get_world_size()
        ):  # as tests/_deepspeed_worker.py
            state.num_processes = dist.get_world_size()
            state.process_index = dist.get_rank()
            state.local_process_index = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
        return state.process_index
    if engine == "fsdp2":
        state = PartialState(cpu=True, backend="gloo")
        return state.process_index
    return int(os.environ.get("RANK", 0))  # DDP: the Trainer starts the state itself (use_cpu=True)


def _train(engine: str, patched: bool, a) -> dict:
    import transformers
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    import fasttrain

    fasttrain.unpatch()
    if patched:
        fasttrain.patch()
    extra: dict = {}
    if engine.startswith("zero"):
        from transformers.integrations.deepspeed import unset_hf_deepspeed_config

        AcceleratorState._reset_state(reset_partial_state=False)
        unset_hf_deepspeed_config()
        extra = dict(
            use_cpu=False,
            deepspeed={
                "zero_optimization": {"stage": int(engine[-1])},
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
            },
            accelerator_config={"use_configured_state": True},
        )
    elif engine == "fsdp2":
        AcceleratorState._reset_state(reset_partial_state=False)
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU  # keeps the FSDP plugin
        extra = dict(
            use_cpu=True,
            fsdp=True,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen3DecoderLayer"]},
            accelerator_config={"use_configured_state": True},
        )
    else:
        extra = dict(use_cpu=True)
    model = _model(a)
    args = transformers.TrainingArguments(
        output_dir=str(Path(a.out_dir) / f"{engine}-{patched}"),
        per_device_train_batch_size=a.batch,
        gradient_accumulation_steps=1,
        max_steps=a.steps,
        learning_rate=1e-3,
        warmup_steps=1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        train_sampling_strategy="group_by_length",
        **extra,
    )
    step_ends: list[float] = []

    class StepClock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append(time.perf_counter())

    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=_dataset(a, a.steps * a.batch * 2),
        data_collator=transformers.DataCollatorForSeq2Seq(
            _common.word_level_tokenizer(a.vocab), padding=True
        ),
        callbacks=[StepClock()],
    )
    _peak_rss_reset()
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
    import torch.distributed as dist

    rank = _start_engine(a.engine)
    runs: dict[str, list[dict]] = {"reference": [], "fasttrain": []}
    for _ in range(a.reps):
        for name in ("reference", "fasttrain"):
            runs[name].append(_train(a.engine, name == "fasttrain", a))
    if rank == 0:
        Path(a.out_dir, f"{a.engine}.json").write_text(json.dumps(runs))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ driver side


def _free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _git_state() -> str:
    """The commit the launch ran (and whether the working tree differed from it): the tree may change between
    launches when others work in it."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True)  # fmt: skip
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


def launch(engine: str, a, out_dir: Path) -> dict:
    git = _git_state()
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), DS_ACCELERATOR="cpu")
    env.pop("TRITON_INTERPRET", None)  # the CPU paths, not the Triton interpreter
    model_args = ["--steps", a.steps, "--reps", a.reps, "--batch", a.batch, "--seq-len", a.seq_len,
                  "--hidden", a.hidden, "--layers", a.layers, "--vocab", a.vocab, "--threads", a.threads]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", _free_port(),
           __file__, "--worker", "--engine", engine, "--out-dir", str(out_dir), *map(str, model_args)]  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    runs = json.loads((out_dir / f"{engine}.json").read_text())
    ref, ours = runs["reference"], runs["fasttrain"]
    ref_s = statistics.median(r["step_s"] for r in ref)
    ours_s = statistics.median(r["step_s"] for r in ours)
    loss_diff = max(abs(x - y) / abs(x) for x, y in zip(ref[0]["losses"], ours[0]["losses"], strict=True))
    return {
        "engine": engine,
        "distributed_type": ours[0]["distributed_type"],
        "world_size": ours[0]["world_size"],
        "reference_step_s": ref_s,
        "fasttrain_step_s": ours_s,
        "speedup": ref_s / ours_s,
        "max_rel_loss_diff": loss_diff,
        "reference_peak_growth_mib": statistics.median(r["peak_rss_growth_mib"] for r in ref),
        "fasttrain_peak_growth_mib": statistics.median(r["peak_rss_growth_mib"] for r in ours),
        "status": ours[0]["status"],
        "launch_s": time.perf_counter() - started,
        "git": git,
        "runs": runs,
    }


def _environment() -> dict:
    return {
        "date": _common.utc_now(),
        "cpu": _common.cpu_model(),
        "cores": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],
        **_common.versions("torch", "transformers", "accelerate", "deepspeed", "fasttrain"),
        "command": _common.command(),
    }


def _markdown(env: dict, rows: list[dict], a) -> str:
    def status(s: dict) -> str:
        return ", ".join(f"{k}={v}" for k, v in s.items())

    lines = [
        "# Engines with and without fasttrain: DDP, DeepSpeed ZeRO-1/2/3, FSDP2 (2 CPU processes, gloo)",
        "",
        f"{env['date']} · {env['cpu']}, {env['cores']} cores (load average at start {env['load_average_at_start']:.2f}"
        + ("; a machine shared with other work" if a.shared else "")
        + f") · Python {env['python']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"accelerate {env['accelerate']}, deepspeed {env['deepspeed']}, fasttrain {env['fasttrain']}",
        "",
        f"Command: `{env['command']}`",
        "",
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
    ]
    for r in rows:
        lines.append(
            f"| {r['engine']} | {r['reference_step_s'] * 1000:.1f} ms | {r['fasttrain_step_s'] * 1000:.1f} ms"
            f" | {r['speedup']:.2f}x | {r['max_rel_loss_diff']:.1e} | {r['reference_peak_growth_mib']:.0f} MiB"
            f" | {r['fasttrain_peak_growth_mib']:.0f} MiB |"
        )
    lines += ["", "fasttrain's status line per engine:", ""]
    lines += [f"- {r['engine']} ({r['distributed_type']}, {r['world_size']} processes; fasttrain at {r['git']}):"
              f" {status(r['status'])}" for r in rows]  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--shared", action="store_true", help="say in the results that the machine was shared")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(a)
        return
    engines = a.engines.split(",")
    unknown = set(engines) - set(ENGINES)
    if unknown:
        p.error(f"unknown engines {sorted(unknown)}; choose from {','.join(ENGINES)}")
    env = _environment()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(
        tempfile.mkdtemp(prefix="bench_engines-")
    )  # per-engine JSON of the workers, checkpoints none
    rows = []
    for engine in engines:
        row = launch(engine, a, scratch)
        print(f"{engine}: reference {row['reference_step_s'] * 1000:.1f} ms, fasttrain {row['fasttrain_step_s'] * 1000:.1f}"
              f" ms, {row['speedup']:.2f}x, loss diff {row['max_rel_loss_diff']:.1e}, status {row['status']}",
              flush=True)  # fmt: skip
        rows.append(row)
    (out / "engines_cpu.json").write_text(json.dumps({"environment": env, "results": rows}, indent=1))
    (out / "engines_cpu.md").write_text(_markdown(env, rows, a))
    print(f"wrote {out / 'engines_cpu.md'}")


if __name__ == "__main__":
    main()
