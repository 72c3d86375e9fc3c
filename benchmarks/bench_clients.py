"""Axolotl's and LLaMA-Factory's own CLIs training SFT on CPU, plain and with fasttrain: tokens/s and peak RSS.

Each run is the framework's unmodified CLI (``axolotl train cfg.yml``, ``llamafactory-cli train cfg.yaml``) in a
fresh process tree, in that framework's own environment (``bash .ci/env-axolotl``, ``bash .ci/env-llamafactory``:
its pinned torch, transformers and TRL, fasttrain's wheel beside them). fasttrain goes in as a user would put it
in: ``fasttrain: true`` in Axolotl's YAML (fasttrain's plugin), ``FASTTRAIN_PATCH=1`` for LLaMA-Factory. Runs
alternate plain / fasttrain, ``--repeats`` each; the tables show medians.

Model and data (``fasttrain bench``'s default, see _clients.py): a Qwen3 of Qwen3-0.6B's shape at random
initialisation (seed), fp32, tied embeddings, vocabulary 151,936; alpaca rows cut from the Python standard
library's sources, one per length drawn log-normal (median 180 tokens, 16..512, the bench's draws for the seed),
tokenized once by the framework's own preprocessing and loaded by every run; batches of 2, no gradient
accumulation, max_grad_norm 1.0, learning rate 1e-3 (linear decay, no warmup), adamw_torch_fused (what
``fasttrain bench``'s reference runs), ``--steps`` optimizer steps, the rows in order (Axolotl's
``curriculum_sampling``, LLaMA-Factory's ``disable_shuffling``), so that each step's tokens are known.

Measured per run, from outside the process (the same way for both sides):

- each step's end: the moment the Trainer's per-step log line reaches this process (stdout unbuffered); steps
  2..N are the differences. All steps: the Trainer's own ``train_runtime``. Tokens are real (non-padding) tokens,
  from the prepared dataset's rows in the order the steps take them;
- peak RSS while training: the largest ``VmHWM`` (a process's peak resident set) in the CLI's process tree when
  the last step's line arrives (both CLIs save the model after training; that is left out); and the whole run's
  (``ru_maxrss`` from ``wait4``: the largest process of the tree, saving included);
- the per-step losses at full precision (LLaMA-Factory's trainer_state.json; for Axolotl, whose console rounds
  them, a small plugin that writes the Trainer's log history after training), and fasttrain's status line.

    python benchmarks/bench_clients.py --client axolotl    # -> benchmarks/results/clients_cpu_axolotl.{json,md}
    python benchmarks/bench_clients.py --client llamafactory --model tiny --repeats 1 --wait-load 0 --out /tmp/c
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _clients
import _common

ROOT = _common.ROOT
SIDES = ("plain", "fasttrain")
STEP_LINE = re.compile(r"^\{'loss': ")  # the Trainer's PrinterCallback / ProgressCallback line for each step
STATUS = re.compile(r"fasttrain hot paths: (.*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RUN_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class Client:
    name: str
    package: str  # its distribution's name, for the versions
    cli: str  # the console script in the environment's bin/
    python_variable: str  # overrides the environment's interpreter, as the client tests do

    def python(self) -> Path:
        return Path(os.environ.get(self.python_variable) or ROOT / ".ci-envs" / self.name / "bin" / "python")


CLIENTS = {
    "axolotl": Client("axolotl", "axolotl", "axolotl", "FASTTRAIN_AXOLOTL_PYTHON"),
    "llamafactory": Client(
        "llamafactory", "llamafactory", "llamafactory-cli", "FASTTRAIN_LLAMAFACTORY_PYTHON"
    ),
}

# Axolotl's console rounds the logged values (PrinterCallback: 4 significant digits) and Axolotl writes no
# trainer_state.json without a checkpoint, which would be saved inside the timed training: this plugin writes the
# Trainer's log history when training ends instead. Loaded in both sides' runs.
LOG_HISTORY_PLUGIN = """\
import json
import os

from axolotl.integrations.base import BasePlugin
from transformers import TrainerCallback


class _Dump(TrainerCallback):
    def on_train_end(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, "log_history.json"), "w") as handle:
            json.dump(state.log_history, handle)


class LogHistory(BasePlugin):
    def add_callbacks_post_trainer(self, cfg, trainer):
        return [_Dump()]
"""


# ------------------------------------------------------------------------------------------ configurations


def axolotl_config(work: Path, a) -> dict:
    return {
        "base_model": str(work / "model"),
        "datasets": [{"path": str(work / "rows.jsonl"), "ds_type": "json", "type": "alpaca"}],
        "dataset_prepared_path": str(work / "prepared"),
        "shuffle_merged_datasets": False,
        "curriculum_sampling": True,  # a SequentialSampler: step k trains rows 2k, 2k+1 of the prepared data
        "sequence_len": 1024,  # above every row: none is dropped or cut
        "sample_packing": False,
        "val_set_size": 0,
        "micro_batch_size": a.batch_size,
        "gradient_accumulation_steps": 1,
        "max_steps": a.steps,
        "num_epochs": 1,
        "optimizer": "adamw_torch_fused",
        "learning_rate": 1e-3,
        "lr_scheduler": "linear",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "seed": a.seed,
        "bf16": False,
        "fp16": False,
        "tf32": False,
        "save_strategy": "no",
        "plugins": ["_bench_log_history.LogHistory"],
    }


def llamafactory_config(work: Path, a) -> dict:
    (work / "data").mkdir(exist_ok=True)
    info = {
        "bench_sft": {
            "file_name": str(work / "rows.jsonl"),
            "columns": {"prompt": "instruction", "query": "input", "response": "output"},
        }
    }
    (work / "data" / "dataset_info.json").write_text(json.dumps(info, indent=1))
    return {
        "model_name_or_path": str(work / "model"),
        "stage": "sft",
        "do_train": True,
        "finetuning_type": "full",
        "dataset": "bench_sft",
        "dataset_dir": str(work / "data"),
        "tokenized_path": str(work / "prepared"),
        "template": "qwen3",
        "cutoff_len": 1024,  # above every row: none is cut
        "disable_shuffling": True,  # a SequentialSampler: step k trains rows 2k, 2k+1 of the tokenized data
        "per_device_train_batch_size": a.batch_size,
        "gradient_accumulation_steps": 1,
        "max_steps": a.steps,
        "optim": "adamw_torch_fused",
        "learning_rate": 1e-3,
        "lr_scheduler_type": "linear",
        "warmup_steps": 0,
        "max_grad_norm": 1.0,
        "logging_steps": 1,
        "seed": a.seed,
        "data_seed": a.seed,
        "bf16": False,
        "use_cpu": True,
        "save_strategy": "no",
        "plot_loss": False,
        "report_to": "none",
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
    }


def environment(client: Client, run_dir: Path, side: str) -> dict[str, str]:
    """The CLI's environment: offline, its caches in the run's folder, stdout unbuffered (the step lines are
    timed as they arrive), the environment's bin first on PATH (Axolotl re-launches itself through `accelerate
    launch`), and fasttrain switched on only where ``side`` says so."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("FASTTRAIN_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
    }
    env.update(
        PATH=f"{client.python().parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(run_dir / "hf"),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        CUDA_VISIBLE_DEVICES="",  # LLaMA-Factory launches torchrun when it sees more than one device
        AXOLOTL_DO_NOT_TRACK="1",
        WANDB_MODE="disabled",
    )
    if client.name == "axolotl":
        site = run_dir / "site"
        site.mkdir(parents=True, exist_ok=True)
        (site / "_bench_log_history.py").write_text(LOG_HISTORY_PLUGIN)
        env["PYTHONPATH"] = str(site)
    elif side == "fasttrain":
        env["FASTTRAIN_PATCH"] = "1"
    return env


# ------------------------------------------------------------------------------------------------ running


def in_client(client: Client, *args: str, timeout: float = 1200) -> str:
    """``python benchmarks/_clients.py ARGS`` in the client's environment; its stdout."""
    done = subprocess.run(
        [str(client.python()), str(Path(__file__).with_name("_clients.py")), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )
    if done.returncode != 0:
        raise RuntimeError(f"_clients.py {' '.join(args)} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout


def _process_tree(root: int) -> list[int]:
    parents = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path("/proc", entry.name, "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += [child for child, parent in parents.items() if parent == pid]
    return tree


def _tree_memory_kib(root: int) -> tuple[int, int]:
    """(largest VmHWM, sum of VmRSS) over the process tree under ``root``, in KiB."""
    hwm, rss = 0, 0
    for pid in _process_tree(root):
        try:
            fields = dict(
                line.split(":", 1) for line in Path("/proc", str(pid), "status").read_text().splitlines()
            )
        except OSError:
            continue
        hwm = max(hwm, int(fields.get("VmHWM", "0 kB").split()[0]))
        rss += int(fields.get("VmRSS", "0 kB").split()[0])
    return hwm, rss


def launch(command: list[str], cwd: Path, env: dict[str, str], steps: int) -> dict:
    """Runs ``command``; stamps every output line (written to cwd/output.log) and, at each step's line, the
    tree's memory; returns the stamps, the status lines, the exit status and ``wait4``'s peak RSS."""
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    marks, statuses = [], []

    def read() -> None:
        with open(cwd / "output.log", "w") as log:
            for line in proc.stdout:  # text mode: tqdm's carriage returns end lines too
                now = time.perf_counter() - start
                log.write(f"{now:10.3f}  {line}")
                if STEP_LINE.match(line) and len(marks) < steps:
                    marks.append((now, *_tree_memory_kib(proc.pid)))
                if found := STATUS.search(ANSI.sub("", line)):
                    statuses.append(found.group(1).strip())

    reader = threading.Thread(target=read)
    reader.start()
    timer = threading.Timer(
        RUN_TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL)
    )  # its own session: only its tree
    timer.start()
    _, status, usage = os.wait4(
        proc.pid, 0
    )  # wait4: this child's rusage alone, its waited-for descendants in it
    timer.cancel()
    reader.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = (cwd / "output.log").read_text()[-6000:]
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode} (in {cwd}):\n{tail}")
    return {
        "wall_s": time.perf_counter() - start,
        "step_end_s": [m[0] for m in marks],
        "largest_hwm_mib": [m[1] / 1024 for m in marks],
        "tree_rss_mib": [m[2] / 1024 for m in marks],
        "ru_maxrss_mib": usage.ru_maxrss / 1024,
        "user_cpu_s": usage.ru_utime,
        "system_cpu_s": usage.ru_stime,
        "statuses": statuses,
    }


def prepare(client: Client, work: Path, a) -> list[dict]:
    """Model, tokenizer, rows, and the framework's own tokenization of them; the prepared rows' token counts."""
    tokenizer = work / "tokenizer.json"
    _clients.train_tokenizer(tokenizer)
    lengths = _clients.lognormal_lengths(a.steps * a.batch_size, a.seq_len, a.seed)
    rows = _clients.alpaca_rows(tokenizer, client.name, lengths)
    (work / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    in_client(client, "write-model", str(work / "model"), str(tokenizer), a.model, str(a.seed))
    config = (axolotl_config if client.name == "axolotl" else llamafactory_config)(work, a)
    (work / "prepare").mkdir()
    path = work / "prepare" / "cfg.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    if client.name == "axolotl":
        env = environment(client, work / "prepare", "plain")
        done = subprocess.run(
            [str(client.python().parent / "axolotl"), "preprocess", str(path)],
            cwd=work / "prepare",
            env=env,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"axolotl preprocess exited {done.returncode}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
            )
    else:
        config["output_dir"] = str(work / "prepare" / "out")
        path.write_text(json.dumps(config))
        in_client(client, "llamafactory-tokenize", str(path))
    counts = json.loads(in_client(client, "token-counts", str(work / "prepared")))
    for count, target in zip(counts, lengths, strict=True):
        count["target"] = target
    return counts


def train(client: Client, work: Path, a, side: str, index: int) -> dict:
    run_dir = work / f"run{index}-{side}"
    run_dir.mkdir()
    out = run_dir / "out"
    if client.name == "axolotl":
        config = dict(axolotl_config(work, a), output_dir=str(out))
        if side == "fasttrain":
            config["fasttrain"] = True
    else:
        config = dict(llamafactory_config(work, a), output_dir=str(out), overwrite_output_dir=True)
    (run_dir / "cfg.yaml").write_text(json.dumps(config, indent=1))
    load_before = os.getloadavg()[0]
    record = launch(
        [str(client.python().parent / client.cli), "train", "cfg.yaml"],
        run_dir,
        environment(client, run_dir, side),
        a.steps,
    )
    history_file = out / ("log_history.json" if client.name == "axolotl" else "trainer_state.json")
    history = json.loads(history_file.read_text())
    history = history if isinstance(history, list) else history["log_history"]
    for weights in [
        *out.glob("*.safetensors"),
        *out.glob("checkpoint-*"),
    ]:  # 2.4 GB a run at Qwen3-0.6B's shape
        shutil.rmtree(weights) if weights.is_dir() else weights.unlink()
    steps = [entry for entry in history if "loss" in entry]
    (final,) = [entry for entry in history if "train_runtime" in entry]
    return {
        "side": side,
        "index": index,
        **record,
        "load_1min_before": load_before,
        "load_1min_after": os.getloadavg()[0],
        "train_runtime_s": final["train_runtime"],
        "steps": steps,
        "dir": str(run_dir),
    }


# ---------------------------------------------------------------------------------------------- measuring


def figures(run: dict, tokens_per_step: list[int]) -> dict:
    """One run's figures. Step 1 carries the warm-up (first allocations, the optimizer's state): it is in the
    all-steps figure (the Trainer's train_runtime) and out of the steps-2..N ones (the step lines' stamps)."""
    ends = run["step_end_s"]
    if len(ends) != len(tokens_per_step):
        raise RuntimeError(f"{run['dir']}: {len(ends)} step lines seen, {len(tokens_per_step)} steps run")
    later = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "tokens_per_s_all": sum(tokens_per_step) / run["train_runtime_s"],
        "tokens_per_s_after_first": sum(tokens_per_step[1:]) / (ends[-1] - ends[0]) if later else None,
        "step_s_all_mean": run["train_runtime_s"] / len(ends),
        "step_s_after_first_median": statistics.median(later) if later else None,
        "first_step_s": run["train_runtime_s"] - (ends[-1] - ends[0]),
        "peak_rss_training_mib": run["largest_hwm_mib"][-1],
        "peak_rss_run_mib": run["ru_maxrss_mib"],
        "cli_wall_s": run["wall_s"],
        # Axolotl's own per-step figure: scored (label) tokens over the time between two log calls
        "axolotl_scored_tokens_per_s": statistics.median(axolotl)
        if (axolotl := _logged(run, "tokens/train_per_sec_per_gpu"))
        else None,
    }


def _logged(run: dict, key: str) -> list[float]:
    return [step[key] for step in run["steps"] if key in step]


ROWS = (  # (figure, label, better)
    ("tokens_per_s_all", "tokens/s, all steps, over the Trainer's train_runtime", "higher"),
    ("tokens_per_s_after_first", "tokens/s, steps 2..N", "higher"),
    ("step_s_after_first_median", "step time, steps 2..N, median, s", "lower"),
    ("step_s_all_mean", "step time, all steps, mean, s", "lower"),
    ("first_step_s", "step 1, warm-up included, s", "lower"),
    ("peak_rss_training_mib", "peak RSS while training, largest process, MiB", "lower"),
    ("peak_rss_run_mib", "peak RSS of the whole run, saving included, MiB", "lower"),
    ("cli_wall_s", "CLI wall time: imports, loading, training, saving, s", "lower"),
    (
        "axolotl_scored_tokens_per_s",
        "Axolotl's own `tokens/train_per_sec_per_gpu` (scored tokens/s), steps 2..N, median",
        "higher",
    ),
)


def per_step(counts: list[dict], batch: int, key: str = "tokens") -> list[int]:
    """Each step's tokens (or scored tokens): the steps take the prepared rows in order, ``batch`` at a time."""
    return [sum(c[key] for c in counts[i : i + batch]) for i in range(0, len(counts), batch)]


def summarize(runs: list[dict], counts: list[dict], batch: int) -> dict:
    tokens, scored = per_step(counts, batch), per_step(counts, batch, "scored")
    medians = {
        side: {
            key: statistics.median(r["figures"][key] for r in runs if r["side"] == side)
            for key, _, _ in ROWS
            if all(r["figures"][key] is not None for r in runs)
        }
        for side in SIDES
    }
    ratios = {key: medians["fasttrain"][key] / medians["plain"][key] for key in medians["plain"]}
    first = {side: next(r for r in runs if r["side"] == side) for side in SIDES}
    losses = {side: [s["loss"] for s in first[side]["steps"]] for side in SIDES}
    rel = [abs(f - p) / abs(p) for p, f in zip(losses["plain"], losses["fasttrain"], strict=True)]
    own = {
        side: max(
            abs(x - y)
            for r in runs
            if r["side"] == side
            for x, y in zip(losses[side], [s["loss"] for s in r["steps"]], strict=True)
        )
        for side in SIDES
    }
    # Axolotl counts the scored tokens it trained on (tokens/trainable): the steps took the rows in prepared order
    logged = [s.get("tokens/trainable") for s in first["plain"]["steps"]]
    order_check = None if None in logged else logged == [sum(scored[: k + 1]) for k in range(len(scored))]
    # and every token it computed, padding included (tokens/total: its collator pads to a multiple of 64)
    computed = _logged(first["plain"], "tokens/total")
    return {
        "tokens_per_step": tokens,
        "scored_tokens_per_step": scored,
        "medians": medians,
        "ratios": ratios,
        "losses": losses,
        "loss_rel_diff_per_step": rel,
        "largest_loss_rel_diff": max(rel),
        "largest_loss_abs_diff_between_own_repeats": own,
        "statuses": sorted({line for r in runs if r["side"] == "fasttrain" for line in r["statuses"]}),
        "plain_statuses": sorted({line for r in runs if r["side"] == "plain" for line in r["statuses"]}),
        "axolotl_order_check": order_check,
        "axolotl_padded_tokens_per_step": [b - a for a, b in itertools.pairwise([0, *computed])] or None,
    }


def fasttrain_bench(work: Path, repeats: int, extra: tuple[str, ...] = ()) -> dict:
    """``fasttrain bench`` (its default: the Qwen3-0.6B shape, the same lengths) on this machine, for its ratio;
    a failure is recorded, not raised: the clients' runs are done by then."""
    path = work / "fasttrain_bench.json"
    args = ["bench", "--repeats", str(repeats), *extra]
    start = time.perf_counter()
    done = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "fasttrain"), *args, "--json", str(path), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    record = {"command": " ".join(["fasttrain", *args]), "wall_s": time.perf_counter() - start}
    try:
        result = json.loads(path.read_text())
        ratio = result["comparison"]["fasttrain_vs_reference"]
        return {
            **record,
            "tokens_per_s": {side: result[side]["tokens_per_s"] for side in ("reference", "fasttrain")},
            "tokens_per_s_ratio": ratio["tokens_per_s_ratio"],
            "peak_memory_ratio": ratio["peak_memory_ratio"],
            "hot_paths": result["fasttrain"]["hot_paths"],
            "tokens_per_step": result["fasttrain"]["tokens_per_step"],
        }
    except (OSError, KeyError, ValueError) as exc:
        return {
            **record,
            "error": f"{type(exc).__name__}: {exc}; exit {done.returncode}: {done.stderr[-2000:]}",
        }


# --------------------------------------------------------------------------------------------- provenance


def pytest_running() -> bool:
    return subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0


def quiet_enough(threshold: float) -> str | None:
    """Why the machine is not quiet enough to start (None: it is)."""
    if pytest_running():
        return "a pytest process runs"
    load = os.getloadavg()[0]
    return f"1-minute load average {load:.2f} >= {threshold}" if load >= threshold else None


def wait_until_quiet(threshold: float, interval: int = 60) -> float:
    start = time.perf_counter()
    while reason := quiet_enough(threshold):
        print(f"[bench_clients] waiting: {reason}", flush=True)
        time.sleep(interval)
    return time.perf_counter() - start


def fasttrain_provenance(client: Client) -> dict:
    """The repository's commit, and whether the client environment's fasttrain is that commit's Python (git blob
    hashes of its installed files against HEAD's python/fasttrain and kernels/)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout

    installed = in_client(client, "fasttrain-dir").strip()
    tree = {}
    for line in git("ls-tree", "-r", "HEAD", "python/fasttrain", "kernels").splitlines():
        meta, path = line.split("\t")
        rel = (
            path.removeprefix("python/fasttrain/")
            if path.startswith("python/")
            else "kernels/" + path.removeprefix("kernels/")
        )
        tree[rel] = meta.split()[2]
    differ = []
    for path in sorted(Path(installed).rglob("*.py")):
        data = path.read_bytes()
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        rel = str(path.relative_to(installed))
        if tree.get(rel) != blob:
            differ.append(rel)
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "installed_at": installed,
        "installed_python_files_differing_from_head": differ,
    }


def client_versions(client: Client) -> dict:
    code = (
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import _common; "
        f"print(json.dumps(_common.versions('torch', 'transformers', 'trl', 'accelerate', 'datasets', "
        f"{client.package!r}, 'fasttrain')))"
    )
    return json.loads(
        subprocess.run([str(client.python()), "-c", code], capture_output=True, text=True, check=True).stdout
    )


def memory_gib() -> float:
    with open("/proc/meminfo") as handle:
        return int(handle.readline().split()[1]) / 2**20


# ------------------------------------------------------------------------------------------------ report

TITLES = {
    "axolotl": (
        "Axolotl's own CLI (`axolotl train`)",
        "`fasttrain: true` in the YAML (fasttrain's Axolotl plugin)",
    ),
    "llamafactory": (
        "LLaMA-Factory's own CLI (`llamafactory-cli train`)",
        "`FASTTRAIN_PATCH=1` in the environment",
    ),
}


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def shape_text(model: str) -> str:
    hidden, layers, heads, kv_heads, head_dim, intermediate = _clients.SHAPES[model]
    params = _clients.parameters(model)
    name = "Qwen3-0.6B shape" if model == "qwen3-0.6b" else f"`{model}` shape"
    return (
        f"{name}: hidden {hidden:,}, {layers} layer{'s' * (layers > 1)}, {heads} attention heads, {kv_heads} KV "
        f"head{'s' * (kv_heads > 1)}, head dim "
        f"{head_dim}, MLP {intermediate:,}, vocab {_clients.QWEN3_VOCAB:,}, tied embeddings, {params / 1e6:,.1f}M "
        f"parameters (LM head {_clients.QWEN3_VOCAB * hidden / params:.0%} of the matmul FLOPs), random init, fp32"
    )


def markdown(result: dict) -> str:
    a, s, env = result["settings"], result["summary"], result["environment"]
    title, how = TITLES[a["client"]]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    prov = env["fasttrain"]
    differ = prov["installed_python_files_differing_from_head"]
    wheel = (
        "its Python files are HEAD's"
        if not differ
        else f"installed files differing from HEAD: {', '.join(differ)}"
    )
    counts = result["token_counts"]
    lengths = sorted(c["tokens"] for c in counts)
    padded = s["axolotl_padded_tokens_per_step"]
    padding = (
        f"Axolotl's collator pads each batch to a multiple of 64: {', '.join(map(str, padded))} tokens computed"
        if padded
        else "LLaMA-Factory's collator pads each batch to a multiple of 8"
    )
    loads = ", ".join(f"{r['load_1min_before']:.1f}->{r['load_1min_after']:.1f}" for r in result["runs"])
    lines = [
        f"# {title}, SFT on CPU: plain vs with fasttrain",
        "",
        f"- date (UTC): {result['date']}",
        f"- machine: {env['cpu']}, {env['cores']} cores, {env['memory_gib']:.1f} GiB",
        f"- versions (the {a['client']} environment): {versions}",
        f"- fasttrain: commit {prov['commit']} (the environment's wheel: {wheel}); it goes in by {how}",
        f"- command: `{result['command']}`",
        f"- total wall time: {result['wall_s'] / 60:.1f} min; "
        + (
            f"it started after waiting {result['waited_s']:.0f} s for the 1-minute load average to fall below "
            f"{a['wait_load']} with no pytest running"
            if a["wait_load"] > 0
            else "it started without waiting for a quiet machine (`--wait-load 0`)"
        ),
        f"- load average (1 min) before / after: {result['load_before']:.2f} / {result['load_after']:.2f}; "
        f"each run's start -> end: {loads}",
        f"- data: {len(counts)} alpaca rows cut from the Python standard library's sources, aimed at `fasttrain "
        f"bench`'s log-normal lengths for seed {a['seed']} (median 180, 16..{a['seq_len']}): targets "
        f"{', '.join(str(c['target']) for c in counts)}; as the framework tokenized them "
        f"{', '.join(str(c['tokens']) for c in counts)} (median {statistics.median(lengths):g})",
        f"- {a['steps']} optimizer steps x batch {a['batch_size']}, gradient accumulation 1, max_grad_norm 1.0, "
        "lr 1e-3 linear, adamw_torch_fused, rows in order; real (non-padding) tokens per step: "
        f"{', '.join(map(str, s['tokens_per_step']))} ({padding})",
        f"- {a['repeats']} repetition{'s' * (a['repeats'] > 1)} per side, alternating (plain first), each a fresh "
        "CLI process tree; medians; ratios are fasttrain / plain",
        "",
        f"Model: {shape_text(a['model'])}.",
        "",
        "|  | plain | fasttrain | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]
    for key, label, better in ROWS:
        if key in s["ratios"]:
            digits = 3 if "step_s" in key else 0 if key.endswith("mib") else 1
            plain, fast = (_num(s["medians"][side][key], digits) for side in SIDES)
            lines.append(f"| {label} ({better} is better) | {plain} | {fast} | {s['ratios'][key]:.2f}x |")
    lines += [
        f"| largest per-step loss difference, relative | | {s['largest_loss_rel_diff']:.2e} | |",
        "",
        "fasttrain's status line (every fasttrain run):",
        "",
        *[f"    fasttrain hot paths: {line}" for line in s["statuses"]],
        "",
        f"Plain runs' status lines: {'none' if not s['plain_statuses'] else s['plain_statuses']}.",
        "",
        "- tokens/s, all steps: the real tokens of the N steps over the Trainer's `train_runtime` (step 1's "
        "warm-up included: first allocations, the optimizer's state); steps 2..N: their tokens over the time from "
        "step 1's log line to step N's, as the lines reached this process; step 1: `train_runtime` minus that",
        "- peak RSS while training: the largest process's VmHWM when step N's log line arrived (the training "
        "process; the model is saved after that); whole run: `ru_maxrss` of the tree from wait4 (the largest "
        "process, the final save included)",
    ]
    if s["axolotl_order_check"] is not None:
        verdict = "matches" if s["axolotl_order_check"] else "does NOT match"
        lines.append(
            f"- Axolotl's own count of scored tokens (`tokens/trainable`, plain run) {verdict} the prepared rows "
            "taken in order, the order the token counts above assume"
        )
    lines += [
        "",
        "## Loss per step (first repetition of each side)",
        "",
        "| step | real tokens | plain | fasttrain | relative difference |",
        "| ---: | ---: | ---: | ---: | ---: |",
    ]
    losses = zip(s["losses"]["plain"], s["losses"]["fasttrain"], s["loss_rel_diff_per_step"], strict=True)
    for k, (plain, fast, rel) in enumerate(losses):
        lines.append(f"| {k + 1} | {s['tokens_per_step'][k]} | {plain:.6f} | {fast:.6f} | {rel:.2e} |")
    own = s["largest_loss_abs_diff_between_own_repeats"]
    lines += [
        "",
        f"Largest loss difference between a side's own repetitions: plain {own['plain']:.2e}, fasttrain "
        f"{own['fasttrain']:.2e}.",
        "",
        "## Against `fasttrain bench` at the same shape",
        "",
        "[bench_cpu_default.md](bench_cpu_default.md): transformers.Trainer vs fasttrain.Trainer at the same shape "
        "and lengths (steps 3..4 timed), 1.38x tokens/s on a 2-core Intel Xeon.",
    ]
    bench = result.get("fasttrain_bench")
    if bench and "error" in bench:
        lines.append(f"`{bench['command']}` on this machine failed: {bench['error']}")
    elif bench:
        tps = bench["tokens_per_s"]
        lines.append(
            f"On this machine, `{bench['command']}` ({bench['wall_s'] / 60:.1f} min): {tps['reference']:.1f} -> "
            f"{tps['fasttrain']:.1f} tokens/s, **{bench['tokens_per_s_ratio']:.2f}x**; peak memory "
            f"{bench['peak_memory_ratio']:.2f}x."
        )
    else:
        lines.append("`fasttrain bench` was not run on this machine by this command (`--bench-repeats 0`).")
    lines += [
        "",
        "## Every run",
        "",
        "| run | side | tokens/s all | tokens/s 2..N | step 2..N median, s | step 1, s | peak RSS training, MiB "
        "| ru_maxrss, MiB | CLI wall, s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["runs"]:
        f = r["figures"]
        cells = [
            _num(f["tokens_per_s_all"]),
            _num(f["tokens_per_s_after_first"]),
            _num(f["step_s_after_first_median"], 3),
            _num(f["first_step_s"], 3),
            _num(f["peak_rss_training_mib"], 0),
            _num(f["peak_rss_run_mib"], 0),
            _num(f["cli_wall_s"]),
        ]
        lines.append(f"| {r['index']} | {r['side']} | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--client", required=True, choices=sorted(CLIENTS))
    p.add_argument(
        "--model",
        default="qwen3-0.6b",
        choices=sorted(_clients.SHAPES),
        help="default: qwen3-0.6b; tiny for checking the script",
    )
    p.add_argument("--steps", type=int, default=4, help="optimizer steps a run (default: 4)")
    p.add_argument("--repeats", type=int, default=2, help="runs per side, alternating (default: 2)")
    p.add_argument("--batch-size", type=int, default=2, help="default: 2")
    p.add_argument("--seq-len", type=int, default=512, help="longest drawn example length (default: 512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--out",
        type=Path,
        default=ROOT / "benchmarks" / "results",
        help="where clients_cpu_<client>[_<model>].{json,md} go",
    )
    p.add_argument(
        "--workdir", type=Path, help="model, data and runs (default: a temporary folder, removed after)"
    )
    p.add_argument(
        "--wait-load",
        type=float,
        default=0.5,
        help="before starting, wait until the 1-minute load average is below this and no pytest runs, checking "
        "every 60 s; before each run, until no pytest runs (default: 0.5; 0: do not wait)",
    )
    p.add_argument(
        "--bench-repeats",
        type=int,
        default=0,
        help="also run `fasttrain bench --repeats N` for its ratio on this machine (default: 0, not run)",
    )
    a = p.parse_args()
    client = CLIENTS[a.client]
    if not client.python().is_file():
        sys.exit(f"no {client.python()}: build the environment with `bash .ci/env-{client.name}`")
    start = time.perf_counter()
    waited = wait_until_quiet(a.wait_load) if a.wait_load > 0 else 0.0
    load_before = os.getloadavg()[0]
    work = a.workdir or Path(tempfile.mkdtemp(prefix=f"bench_clients_{client.name}_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        environment_info = {
            "cpu": _common.cpu_model(),
            "cores": os.cpu_count(),
            "memory_gib": memory_gib(),
            "versions": client_versions(client),
            "fasttrain": fasttrain_provenance(client),
        }
        print(f"[bench_clients] preparing model and data in {work}", flush=True)
        counts = prepare(client, work, a)
        runs = []
        for index in range(1, a.repeats + 1):
            for side in SIDES:
                while a.wait_load > 0 and pytest_running():  # a CI job would share the 2 cores with the run
                    print("[bench_clients] waiting: a pytest process runs", flush=True)
                    time.sleep(60)
                run = train(client, work, a, side, index)
                run["figures"] = f = figures(run, per_step(counts, a.batch_size))
                runs.append(run)
                print(
                    f"[bench_clients] run {index} {side}: {f['tokens_per_s_all']:.1f} tokens/s, "
                    f"peak RSS {f['peak_rss_training_mib']:,.0f} MiB, {run['wall_s']:.0f} s",
                    flush=True,
                )
        bench = fasttrain_bench(work, a.bench_repeats) if a.bench_repeats > 0 else None
        result = {
            "date": _common.utc_now(),
            "command": _common.command(),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "environment": environment_info,
            "wall_s": time.perf_counter() - start,
            "waited_s": waited,
            "load_before": load_before,
            "load_after": os.getloadavg()[0],
            "token_counts": counts,
            "summary": summarize(runs, counts, a.batch_size),
            "fasttrain_bench": bench,
            "runs": runs,
        }
    finally:
        if a.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    stem = f"clients_cpu_{client.name}" + ("" if a.model == "qwen3-0.6b" else f"_{a.model}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (a.out / f"{stem}.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
