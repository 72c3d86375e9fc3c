"""One training run, in its own process (docs/method.md, "Runs and timing"): ``python -m fasttrain.bench.worker
JOB.json`` writes its result to the JSON path named in the job and one line per optimizer step to the progress
file the parent watches."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import re
import resource
import sys
import tempfile
import time
from typing import Any

from .config import FASTTRAIN, BenchConfig, Contender, dump
from .runner import resident_bytes


def _qualified(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _tokenizer_for(config: BenchConfig):
    """The model's own tokenizer when it has one (local directory or hub id), else the built-in stdlib BPE."""
    from . import models, tokenizer

    local = models.looks_like_local_path(config.model)
    source = os.path.expanduser(config.model) if local else config.model
    # A bare local checkpoint (weights and config only) gets the built-in tokenizer: AutoTokenizer would
    # build an empty one from the config's model type instead of failing.
    has_files = not local or any(
        os.path.exists(os.path.join(source, n)) for n in ("tokenizer.json", "tokenizer_config.json")
    )
    if config.model not in models.BUILTIN_SHAPES and has_files:
        from transformers import AutoTokenizer

        # a hub model without a tokenizer: the built-in one serves
        with contextlib.suppress(OSError, ValueError):
            tok = AutoTokenizer.from_pretrained(source, local_files_only=local or models.hub_offline())
            if tok.pad_token is None:
                tok.pad_token = tok.eos_token
            return tok
    path, _ = tokenizer.load_or_train()
    return tokenizer.as_transformers_tokenizer(path)


class RealTokenCounter:
    """Counts the real (non-pad) tokens every training forward receives (docs/method.md, "Runs and timing"),
    without touching the Trainer (whose own token count would keep fasttrain's packing off). The total stays on
    the device until ``total()``, read once per optimizer step."""

    def __init__(self, model, pad_token_id: int | None, grad_only: bool = False) -> None:
        self.pad_token_id = pad_token_id
        # GRPO and RLOO: only the forwards that build a graph (the loss's), not generation's or scoring's
        self.grad_only = grad_only
        self._total = None
        self._handle = model.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, module, args, kwargs):
        import torch

        if not module.training or (self.grad_only and not torch.is_grad_enabled()):
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        mask = kwargs.get("attention_mask")
        if mask is not None and mask.dim() == 2:
            real = mask.sum()
        elif input_ids is not None and self.pad_token_id is not None:
            real = (input_ids != self.pad_token_id).sum()
        elif input_ids is not None:
            real = input_ids.new_tensor(input_ids.numel())
        else:
            return
        self._total = real.detach() if self._total is None else self._total + real.detach()

    def total(self) -> int:
        return 0 if self._total is None else int(self._total)

    def remove(self) -> None:
        self._handle.remove()


def _recorder(progress_path: str | None, is_cuda: bool, counter: RealTokenCounter, meter=None, profiler=None):
    """A TrainerCallback that records every optimizer step: wall time, real tokens seen (``counter``), and
    every metric logged; for GRPO and RLOO, closes each step's phases (``meter``: bench/phases.py); with
    ``--profile``, profiles the last step (``profiler``: bench/profile.py)."""
    import torch
    from transformers import TrainerCallback

    class StepRecorder(TrainerCallback):
        def __init__(self) -> None:
            # at the start of training, then at the end of each optimizer step: wall clock, CPU seconds of this
            # process (all threads: unlike wall time, barely moved by other load on the machine), tokens seen
            self.times: list[float] = []
            self.cpu_times: list[float] = []
            self.tokens_seen: list[int] = [0]
            self.metrics: dict[int, dict[str, float]] = {}  # step -> what the Trainer logged at that step
            self.progress = open(progress_path, "a", encoding="ascii") if progress_path else None  # noqa: SIM115

        def _mark(self) -> None:
            if is_cuda:  # time what the GPU did, not what was queued
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            self.cpu_times.append(time.process_time())

        def on_train_begin(self, args, state, control, **kwargs):
            self._mark()
            if meter is not None:
                meter.start()

        def on_step_begin(self, args, state, control, **kwargs):
            if profiler is not None:
                profiler.begin(state.global_step, counter.total())

        def on_step_end(self, args, state, control, **kwargs):
            if profiler is not None:
                profiler.end(state.global_step, counter.total())
            self._mark()
            self.tokens_seen.append(counter.total())
            if meter is not None:
                meter.step_end()
            if self.progress:
                self.progress.write(f"{state.global_step}\n")
                self.progress.flush()

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs:  # a training step's log (the end-of-training summary has train_loss instead)
                self.metrics[state.global_step] = step_metrics(logs)

    return StepRecorder()


# Logged values that are timings or counters of this run's speed, not of what was learned: never compared.
_TIMING_KEY = re.compile(r"runtime|per_second|_flos$|^step_time$")  # step_time: GRPO's and RLOO's


def step_metrics(logs: dict[str, Any]) -> dict[str, float]:
    """The numeric values of one training-step log that both contenders must agree on."""
    return {
        key: float(value)
        for key, value in logs.items()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not _TIMING_KEY.search(key)
    }


def train_flops_per_token(model, examples: list[list[int]]) -> float:
    """FLOPs one trained token costs, forward + backward, from the shapes (docs/method.md, "The matmul
    limit"); the mean context is weighted by tokens."""
    config = model.config
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    lengths = [len(e) for e in examples] or [0]
    mean_context = sum(n * n for n in lengths) / max(sum(lengths), 1)
    return 6.0 * model.num_parameters() + 6.0 * config.num_hidden_layers * width * mean_context


class TokenCountError(RuntimeError):
    """The Trainer's token count is not the examples' real tokens: every tokens/s figure would be wrong."""


def _check_token_count(config: BenchConfig, examples: list[list[int]], tokens_seen: list[int]) -> int | None:
    """The real tokens of the examples the run consumed, which ``RealTokenCounter``'s count must equal when the run
    consumed whole epochs, or tokens/s would not compare a padded and a packed contender. TRL trainers count
    differently (DPO counts chosen and rejected rows): None, not checked."""
    if config.trainer_type != "transformers" or not examples or config.examples_needed % len(examples):
        return None
    expected = sum(len(e) for e in examples) * (config.examples_needed // len(examples))
    counted = tokens_seen[-1] if tokens_seen else 0
    if len(tokens_seen) == config.steps and counted != expected:
        raise TokenCountError(
            f"the bench counted {counted} input tokens over the run, but its examples hold {expected} real "
            "tokens: tokens/s would not compare real tokens between contenders"
        )
    return expected


def run(config: BenchConfig, contender: Contender, progress_path: str | None = None) -> dict[str, Any]:
    import torch

    torch.set_num_threads(config.threads)
    from transformers import set_seed

    from . import data, models

    is_cuda = config.device == "cuda"
    t0 = time.perf_counter()
    tok = _tokenizer_for(config)
    examples = data.build_examples(
        config.dataset, tok, config.seq_len, config.examples_needed, config.lengths, config.seed
    )
    if not examples:
        raise data.DatasetError(
            f"--dataset {config.dataset!r} yields no example of at least {data.MIN_TOKENS} tokens"
        )
    dtype = torch.bfloat16 if config.bf16 else torch.float32
    spec = (config.model, config.seq_len, config.seed, config.device, dtype)
    model = models.build_model(*spec)
    if len(tok) > model.config.vocab_size:
        raise models.ModelError(
            f"the tokenizer has {len(tok)} tokens but the model's vocabulary is {model.config.vocab_size}"
        )
    # DPO's and KTO's frozen reference: the same weights again (TRL would load it from the hub id the config names)
    ref_model = models.build_model(*spec) if config.trainer_type in ("dpo", "kto") else None
    set_seed(config.seed)
    setup_s = time.perf_counter() - t0
    if is_cuda and config.memory_budget:  # the length frontier: past the budget, torch's allocator fails
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, config.memory_budget / total))
    if is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        setup_mb = torch.cuda.memory_allocated() / 2**20
    else:  # resident now, from /proc (Linux); ru_maxrss is a peak
        setup_mb = resident_bytes(os.getpid()) / 2**20 or float("nan")

    counter = RealTokenCounter(model, tok.pad_token_id, grad_only=config.generates)
    from .phases import PhaseMeter, phase_results
    from .profile import StepProfiler
    from .trl_runs import build_trainer

    meter = PhaseMeter(is_cuda) if config.generates else None
    profiler = StepProfiler(config.steps, model.config.vocab_size, is_cuda) if config.profile else None
    recorder = _recorder(progress_path, is_cuda, counter, meter, profiler)
    with tempfile.TemporaryDirectory(prefix="fasttrain-bench-") as output_dir:
        trainer = build_trainer(config, contender, model, ref_model, tok, examples, output_dir, recorder)
        if meter is not None:
            meter.install(model)  # after the trainer: the synthetic stand-in (if any) is in place
        trainer.train()
    requested = getattr(trainer, "hot_paths", None)  # fasttrain.Trainer: HotPaths after FASTTRAIN_DISABLE

    times, cpu_times, seen = recorder.times, recorder.cpu_times, recorder.tokens_seen
    steps_done = len(times) - 1
    tokens_expected = _check_token_count(config, examples, seen[1:])
    warmup = min(config.warmup_steps, max(steps_done - 1, 0))
    timed_s = times[-1] - times[warmup]
    timed_cpu_s = cpu_times[-1] - cpu_times[warmup]
    timed_tokens = seen[-1] - seen[warmup]
    per_step = [recorder.metrics.get(step, {}) for step in range(1, steps_done + 1)]
    names = sorted({name for logged in per_step for name in logged})
    metrics = {name: [logged.get(name) for logged in per_step] for name in names}
    losses = metrics.get("loss", [None] * steps_done)
    plain = config.trainer_type == "transformers"  # transformers.Trainer, not TRL's
    result: dict[str, Any] = {
        "contender": contender.name,
        "trainer": contender.trainer,
        "trainer_class": _qualified(trainer),
        # the optimizer that stepped (Accelerate wraps it): what a contender's optim setting made
        "optimizer_class": _qualified(getattr(trainer.optimizer, "optimizer", trainer.optimizer)),
        "trainer_type": config.trainer_type,
        "patched": not plain and contender.trainer == FASTTRAIN,
        "fasttrain_disable": os.environ.get("FASTTRAIN_DISABLE") or None,
        "steps": steps_done,
        "warmup_steps_excluded": warmup,
        "tokens_per_s": timed_tokens / timed_s if timed_s > 0 else float("nan"),
        "step_time_s": timed_s / (steps_done - warmup) if steps_done > warmup else float("nan"),
        "tokens_per_cpu_s": timed_tokens / timed_cpu_s if timed_cpu_s > 0 else float("nan"),
        "step_times_s": [b - a for a, b in itertools.pairwise(times)],
        "tokens_per_step": [b - a for a, b in itertools.pairwise(seen)],
        "timed_tokens": timed_tokens,
        "tokens_expected": tokens_expected,
        "losses": losses,
        "grad_norms": metrics.get("grad_norm", [None] * steps_done),
        "metrics": metrics,
        "final_loss": losses[-1] if losses else None,
        "hot_paths": dict(getattr(trainer, "fasttrain_status", None) or {}),
        "hot_paths_requested": dataclasses.asdict(requested) if dataclasses.is_dataclass(requested) else None,
        "setup_s": setup_s,
        "num_examples": len(examples),
        "model_shape": models.model_summary(model),  # what the report says of the model's size
        "pid": os.getpid(),
        # the roofline of a training step (bench/roofline.py): plain Trainer runs only, where every counted
        # token goes forward and backward once
        "train_flops_per_token": train_flops_per_token(model, examples) if plain else None,
    }
    if is_cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
        result.update(memory_kind="torch.cuda.max_memory_allocated", gpu_name=torch.cuda.get_device_name())
    else:
        unit = 2**20 if sys.platform == "darwin" else 2**10  # ru_maxrss: bytes on macOS, KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / unit
        result["memory_kind"] = "peak RSS (ru_maxrss)"
    result.update(peak_memory_mb=peak, memory_after_setup_mb=setup_mb, peak_above_setup_mb=peak - setup_mb)
    if meter is not None:
        result.update(phase_results(meter, result, cpu_times, warmup))
    if profiler is not None:
        result["profile"] = profiler.result
    return result


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m fasttrain.bench.worker JOB.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as handle:
        job = json.load(handle)
    config, contender = BenchConfig.from_json(job["config"]), Contender(**job["contender"])
    from . import data, models

    try:
        result = run(config, contender, job.get("progress_path"))
    except (data.DatasetError, models.ModelError) as exc:
        # A user error found only once the data/model is opened: one line, and the parent shows it as is.
        dump(job["result_path"], {"error": str(exc)})
        print(f"error: {exc}", file=sys.stderr)
        return 2
    dump(job["result_path"], result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
