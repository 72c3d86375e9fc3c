"""LLaMA-Factory's own CLI training SFT on CPU, plain and with fasttrain: tokens/s and peak RSS.

LLaMA-Factory only; Axolotl is tested through its own CLI (tests marked client), not benchmarked. How it
measures: docs/method.md, "LLaMA-Factory's CLI".

    python benchmarks/bench_clients.py --client llamafactory --wait-load 0  # -> clients_cpu_llamafactory.*
    python benchmarks/bench_clients.py --client llamafactory --model tiny --repeats 1 --wait-load 0 --out /tmp/c
"""

from __future__ import annotations

import contextlib
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

import numpy as np
from tokenizers import AddedToken

import _common
from fasttrain.bench import corpus

SIDES = ("plain", "fasttrain")
STEP_LINE = re.compile(r"^\{'loss': ")  # the Trainer's PrinterCallback / ProgressCallback line for each step
STATUS = re.compile(r"fasttrain hot paths: (.*)")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
RUN_TIMEOUT_S = 1800
# python/fasttrain/bench's numbers (data.py, tokenizer.py, models.py), copied: the scripts do not import the
# bench command's internals. Log-normal lengths like instruction data; the BPE's vocabulary and corpus size.
LOGNORMAL_MEDIAN, LOGNORMAL_SIGMA, MIN_TOKENS = 180, 0.8, 16
TOKENIZER_VOCAB, TOKENIZER_TRAIN_BYTES, QWEN3_VOCAB = 8192, 4_000_000, 151_936
# hidden, layers, attention heads, KV heads, head dim, MLP
SHAPES = {"qwen3-0.6b": (1024, 28, 16, 8, 128, 3072), "tiny": (32, 1, 2, 1, 16, 64)}
# Qwen3's pad token and ChatML markers (LLaMA-Factory's qwen3 template writes them; <|im_end|> is the EOS, as in
# Qwen3's tokenizer), and the empty thought that template puts before each answer (added tokens, not special).
PAD, IM_START, IM_END, THINK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", ("<think>", "</think>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PROMPT_SHARE = 0.2  # of a row's own tokens, in the instruction; the rest is the output
# what LLaMA-Factory's qwen3 template wraps around a row
TEMPLATE = f"{IM_START}user\n{IM_END}\n{IM_START}assistant\n<think>\n\n</think>\n\n{IM_END}\n"


def env_bin(client: str) -> Path:
    """The client environment's bin folder (`bash .ci/env-<client>` builds it): its python and its CLIs."""
    return _common.ROOT / ".ci-envs" / client / "bin"


def alpaca_rows(tok, lengths: list[int]) -> list[dict]:
    """One alpaca row (instruction, output) per drawn length: the corpus read as one token stream, each row the
    next ``length - template`` tokens, decoded, its first fifth the instruction. Decoding and re-tokenizing moves
    a row's length by a token or two at the cut."""
    overhead = len(tok.encode(TEMPLATE).ids)
    wanted = [max(length - overhead, 2) for length in lengths]
    stream: list[int] = []
    for text in corpus.iter_documents():
        stream += tok.encode(text).ids
        if len(stream) >= sum(wanted):
            break
    rows, start = [], 0
    for n in wanted:
        ids, start, cut = stream[start : start + n], start + n, max(1, round(n * PROMPT_SHARE))
        rows.append({"instruction": tok.decode(ids[:cut]), "input": "", "output": tok.decode(ids[cut:])})
    return rows


def config(work: Path, a, run_dir: Path, **extra) -> dict:
    """LLaMA-Factory's YAML (as JSON, which is YAML) for the run's model and rows, in prepared order; its output in
    run_dir/out."""
    (work / "data").mkdir(exist_ok=True)
    columns = {"prompt": "instruction", "query": "input", "response": "output"}
    info = {"bench_sft": {"file_name": str(work / "rows.jsonl"), "columns": columns}}
    (work / "data" / "dataset_info.json").write_text(json.dumps(info))
    return {"model_name_or_path": str(work / "model"), "stage": "sft", "do_train": True,
            "finetuning_type": "full", "dataset": "bench_sft", "dataset_dir": str(work / "data"),
            "tokenized_path": str(work / "prepared"), "template": "qwen3", "cutoff_len": 1024,
            "disable_shuffling": True, "data_seed": a.seed, "use_cpu": True, "plot_loss": False,
            "report_to": "none", "dataloader_num_workers": 0, "disable_tqdm": True, "overwrite_output_dir": True,
            "per_device_train_batch_size": a.batch_size, "max_steps": a.steps, "seed": a.seed, "learning_rate": 1e-3,
            "optim": "adamw_torch_fused", "lr_scheduler_type": "linear", "gradient_accumulation_steps": 1,
            "warmup_steps": 0, "max_grad_norm": 1.0, "logging_steps": 1, "bf16": False, "save_strategy": "no",
            "output_dir": str(run_dir / "out"), **extra}  # fmt: skip


def environment(client: str, run_dir: Path, side: str) -> dict[str, str]:
    """The CLI's environment: offline, its caches in the run's folder, stdout unbuffered (the step lines are
    timed as they arrive), the environment's bin first on PATH, and fasttrain switched on only where ``side`` says
    so."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("FASTTRAIN_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}  # fmt: skip
    env.update(PATH=f"{env_bin(client)}{os.pathsep}{env.get('PATH', '')}", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_HOME=str(run_dir / "hf"), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
               CUDA_VISIBLE_DEVICES="")  # LLaMA-Factory launches torchrun when it sees more than one device  # fmt: skip
    if side == "fasttrain":
        env["FASTTRAIN_PATCH"] = "1"
    return env


def in_client(client: str, *args: str) -> str:
    """``python benchmarks/_clients.py ARGS`` in the client's environment; its stdout."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [str(env_bin(client) / "python"), str(Path(__file__).with_name("_clients.py")), *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"_clients.py {args[0]} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return done.stdout


def largest_hwm_kib(root: int) -> int:
    """The largest VmHWM (peak resident set) over the process tree under ``root``, in KiB."""
    parents, hwm = {}, 0
    for entry in os.scandir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            parents[int(entry.name)] = int(Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[1])
    tree = [root]
    for pid in tree:  # grows as it goes: each process's children join the walk
        tree += [child for child, parent in parents.items() if parent == pid]
        with contextlib.suppress(OSError, StopIteration):
            status = Path("/proc", str(pid), "status").read_text().splitlines()
            hwm = max(hwm, int(next(line for line in status if line.startswith("VmHWM:")).split()[1]))
    return hwm


def launch(client: str, run_dir: Path, cfg: dict, verb: str, side: str, steps: int) -> dict:
    """The framework's CLI ``verb`` on ``cfg`` (run_dir/cfg.yaml, run_dir new), in its own session; stamps every
    output line (written to run_dir/output.log) and, at each of the first ``steps`` step lines, the tree's memory;
    the stamps, the status lines and ``wait4``'s peak RSS."""
    run_dir.mkdir()
    (run_dir / "cfg.yaml").write_text(json.dumps(cfg))
    log_path = run_dir / "output.log"
    start, command = time.perf_counter(), [str(env_bin(client) / "llamafactory-cli"), verb, "cfg.yaml"]
    proc = subprocess.Popen(command, cwd=run_dir, env=environment(client, run_dir, side), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    timer = threading.Timer(RUN_TIMEOUT_S, os.killpg, (proc.pid, signal.SIGKILL))  # its session: its tree
    timer.start()
    marks, statuses = [], []
    with open(log_path, "w") as log:
        for line in proc.stdout:  # text mode: tqdm's carriage returns end lines too
            now = time.perf_counter() - start
            log.write(f"{now:10.3f}  {line}")
            if STEP_LINE.match(line) and len(marks) < steps:
                marks.append((now, largest_hwm_kib(proc.pid)))
            if found := STATUS.search(ANSI.sub("", line)):
                statuses.append(found.group(1).strip())
    _, status, usage = os.wait4(proc.pid, 0)  # this child's rusage, its waited-for descendants in it
    timer.cancel()
    if code := os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{command} exited {code} (in {run_dir}):\n{log_path.read_text()[-6000:]}")
    return {"wall_s": time.perf_counter() - start, "step_end_s": [m[0] for m in marks],
            "largest_hwm_mib": [m[1] / 1024 for m in marks], "ru_maxrss_mib": usage.ru_maxrss / 1024,
            "statuses": statuses}  # fmt: skip


def prepare(client: str, work: Path, a) -> list[dict]:
    """Model, tokenizer, rows, and the framework's own tokenization of them; the prepared rows' token counts."""
    tok = _common.stdlib_bpe(TOKENIZER_VOCAB, TOKENIZER_TRAIN_BYTES, [PAD, IM_START, IM_END])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    tokenizer = work / "tokenizer.json"
    tok.save(str(tokenizer))
    rng = np.random.default_rng(a.seed)  # bench/data.py's draws
    drawn = rng.lognormal(np.log(LOGNORMAL_MEDIAN), LOGNORMAL_SIGMA, a.steps * a.batch_size)
    lengths = np.clip(np.rint(drawn), MIN_TOKENS, a.seq_len).astype(np.int64).tolist()
    rows = alpaca_rows(tok, lengths)
    (work / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    names = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size")  # fmt: skip
    qwen3 = {**dict(zip(names, SHAPES[a.model], strict=True)), "vocab_size": QWEN3_VOCAB, "tie_word_embeddings": True,
             "max_position_embeddings": 40_960, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "bos_token_id": None,
             "eos_token": IM_END, "pad_token": PAD, "chat_template": CHAT_TEMPLATE}  # fmt: skip
    in_client(client, "write-model", str(work / "model"), str(tokenizer), json.dumps(qwen3), str(a.seed))
    # the framework tokenizes the rows once, every run then loads those tokens. No preprocess command: `train`
    # tokenizes first (saving at tokenized_path), then, with do_train false, only loads the model
    prepared = config(work, a, work / "prepare", do_train=False)
    launch(client, work / "prepare", prepared, "train", "plain", 0)
    counts = json.loads(in_client(client, "token-counts", str(work / "prepared")))
    return [{**count, "target": target} for count, target in zip(counts, lengths, strict=True)]


def train(client: str, work: Path, a, side: str, index: int) -> dict:
    run_dir = work / f"run{index}-{side}"
    out = run_dir / "out"
    load_before = os.getloadavg()[0]
    record = launch(client, run_dir, config(work, a, run_dir), "train", side, a.steps)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    for weights in (*out.glob("*.safetensors"), *out.glob("checkpoint-*")):  # 2.4 GB a run at Qwen3-0.6B's
        shutil.rmtree(weights) if weights.is_dir() else weights.unlink()
    (final,) = [entry for entry in history if "train_runtime" in entry]
    return {"side": side, "index": index, **record, "load_1min_before": load_before,
            "load_1min_after": os.getloadavg()[0], "train_runtime_s": final["train_runtime"],
            "steps": [entry for entry in history if "loss" in entry], "dir": str(run_dir)}  # fmt: skip


ROWS = (  # (figure, label, better, digits shown)
    ("tokens_per_s_all", "tokens/s, all steps, over the Trainer's train_runtime", "higher", 1),
    ("tokens_per_s_after_first", "tokens/s, steps 2..N", "higher", 1),
    ("step_s_after_first_median", "step time, steps 2..N, median, s", "lower", 3),
    ("step_s_all_mean", "step time, all steps, mean, s", "lower", 3),
    ("first_step_s", "step 1, warm-up included, s", "lower", 3),
    ("peak_rss_training_mib", "peak RSS while training, largest process, MiB", "lower", 0),
    ("peak_rss_run_mib", "peak RSS of the whole run, saving included, MiB", "lower", 0),
    ("cli_wall_s", "CLI wall time: imports, loading, training, saving, s", "lower", 1),
)  # fmt: skip


def figures(run: dict, tokens_per_step: list[int]) -> dict:
    """One run's figures. Step 1 carries the warm-up (first allocations, the optimizer's state): it is in the
    all-steps figure (the Trainer's train_runtime) and out of the steps-2..N ones (the step lines' stamps)."""
    ends, runtime = run["step_end_s"], run["train_runtime_s"]
    if len(ends) != len(tokens_per_step):
        raise RuntimeError(f"{run['dir']}: {len(ends)} step lines seen, {len(tokens_per_step)} steps run")
    later = [b - a for a, b in itertools.pairwise(ends)]
    return {
        "tokens_per_s_all": sum(tokens_per_step) / runtime,
        "tokens_per_s_after_first": sum(tokens_per_step[1:]) / (ends[-1] - ends[0]) if later else None,
        "step_s_all_mean": runtime / len(ends),
        "step_s_after_first_median": statistics.median(later) if later else None,
        "first_step_s": runtime - (ends[-1] - ends[0]),
        "peak_rss_training_mib": run["largest_hwm_mib"][-1],
        "peak_rss_run_mib": run["ru_maxrss_mib"],
        "cli_wall_s": run["wall_s"],
    }  # fmt: skip


def summarize(runs: list[dict], tokens_per_step: list[int]) -> dict:
    """Medians and ratios of the figures every run has (steps 2..N need two steps); losses of each side's first
    run, and how far the runs of a side stray from it."""
    by_side = {side: [r for r in runs if r["side"] == side] for side in SIDES}
    keys = [key for key, *_ in ROWS if all(r["figures"][key] is not None for r in runs)]
    medians = {side: {key: statistics.median(r["figures"][key] for r in by_side[side]) for key in keys}
               for side in SIDES}  # fmt: skip
    losses = {side: [s["loss"] for s in by_side[side][0]["steps"]] for side in SIDES}
    rel = [abs(f - p) / abs(p) for p, f in zip(losses["plain"], losses["fasttrain"], strict=True)]
    own = {side: max(abs(x - s["loss"]) for r in by_side[side] for x, s in zip(losses[side], r["steps"], strict=True))
           for side in SIDES}  # fmt: skip
    return {"tokens_per_step": tokens_per_step, "medians": medians,
            "ratios": {key: medians["fasttrain"][key] / medians["plain"][key] for key in keys}, "losses": losses,
            "loss_rel_diff_per_step": rel, "largest_loss_rel_diff": max(rel),
            "largest_loss_abs_diff_between_own_repeats": own,
            "statuses": {side: sorted({line for r in by_side[side] for line in r["statuses"]}) for side in SIDES}}  # fmt: skip


def wait_until_quiet(threshold: float) -> float:
    """Seconds waited (checking every 60 s) until no pytest runs and the 1-minute load average is below
    ``threshold`` (0: no wait): a CI job would share the cores with the runs."""
    start = time.perf_counter()
    while threshold > 0 and (
        os.getloadavg()[0] >= threshold
        or subprocess.run(["pgrep", "-f", "pytest"], capture_output=True).returncode == 0
    ):
        print(f"[bench_clients] waiting: pytest or load {os.getloadavg()[0]:.2f} >= {threshold}", flush=True)
        time.sleep(60)
    return time.perf_counter() - start


def wheel_vs_head(installed: Path) -> dict:
    """Where the client environment's fasttrain is, and which of its Python files differ from HEAD's (git blob
    hashes): whether the wheel measured is the commit recorded."""
    git = ["git", "ls-tree", "-r", "HEAD", "python/fasttrain"]
    listing = subprocess.run(git, cwd=_common.ROOT, capture_output=True, text=True, check=True).stdout
    head = {path.removeprefix("python/fasttrain/"): meta.split()[2]
            for meta, path in (x.split("\t") for x in listing.splitlines())}  # fmt: skip
    files = {str(path.relative_to(installed)): path.read_bytes() for path in sorted(installed.rglob("*.py"))}
    differ = [name for name, data in files.items()
              if head.get(name) != hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()]  # fmt: skip
    return {"installed_at": str(installed), "installed_python_files_differing_from_head": differ}


def markdown(result: dict) -> list[str]:
    a, s, counts = result["settings"], result["summary"], result["token_counts"]
    hidden, layers, heads, kv_heads, head_dim, mlp = SHAPES[a["model"]]
    layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 2 * head_dim + 2 * hidden + 3 * hidden * mlp
    params = QWEN3_VOCAB * hidden + hidden + layers * layer
    differ = ", ".join(result["fasttrain_wheel"]["installed_python_files_differing_from_head"])
    wheel = f"installed files differing from HEAD: {differ}" if differ else "its Python files are HEAD's"
    loads = ", ".join(f"{r['load_1min_before']:.1f}->{r['load_1min_after']:.1f}" for r in result["runs"])
    versions = ", ".join(f"{k} {v}" for k, v in result["client_versions"].items())
    tokens = ", ".join(str(c["tokens"]) for c in counts)
    lines = [
        f"- versions in the {a['client']} environment: {versions}",
        f"- fasttrain: the environment's wheel ({wheel}); it goes in by `FASTTRAIN_PATCH=1` in the environment",
        f"- wall time {result['wall_s'] / 60:.1f} min; waited {result['waited_s']:.0f} s for a quiet machine "
        f"(`--wait-load {a['wait_load']}`); load average (1 min) after: "
        f"{result['load_after']:.2f}; each run's start -> end: {loads}",
        f"- data: {len(counts)} alpaca rows from the standard library's sources at `fasttrain bench`'s log-normal "
        f"lengths for seed {a['seed']} (median 180, 16..{a['seq_len']}): targets "
        f"{', '.join(str(c['target']) for c in counts)}; as the framework tokenized them {tokens}",
        f"- {a['steps']} optimizer steps x batch {a['batch_size']}, rows in order; real tokens per step: "
        f"{', '.join(map(str, s['tokens_per_step']))} (LLaMA-Factory's collator pads each batch to a multiple of 8)",
        f"- {a['repeats']} repetition(s) per side, alternating (plain first), each a fresh CLI process tree; medians;"
        " ratios are fasttrain / plain",
        f"- model: {a['model']} shape: hidden {hidden:,}, {layers} layer(s), {heads} attention heads, {kv_heads} KV "
        f"head(s), head dim {head_dim}, MLP {mlp:,}, vocab {QWEN3_VOCAB:,}, tied embeddings, {params / 1e6:,.1f}M "
        f"parameters (LM head {QWEN3_VOCAB * hidden / params:.0%} of the matmul FLOPs), random init, fp32",
        "",
        "|  | plain | fasttrain | ratio |",
        "| --- | ---: | ---: | ---: |",
    ]  # fmt: skip
    for key, label, better, digits in ROWS:
        if key in s["ratios"]:
            plain, fast = (f"{s['medians'][side][key]:,.{digits}f}" for side in SIDES)
            lines.append(f"| {label} ({better} is better) | {plain} | {fast} | {s['ratios'][key]:.2f}x |")
    own = s["largest_loss_abs_diff_between_own_repeats"]
    lines += [
        f"| largest per-step loss difference, relative | | {s['largest_loss_rel_diff']:.2e} | |",
        "",
        "fasttrain's status line (every fasttrain run):",
        "",
        *[f"    fasttrain hot paths: {line}" for line in s["statuses"]["fasttrain"]],
        "",
        f"Plain runs' status lines: {s['statuses']['plain'] or 'none'}. Largest loss difference between a side's "
        f"own repetitions: plain {own['plain']:.2e}, fasttrain {own['fasttrain']:.2e}. `fasttrain bench` at the same "
        "shape and lengths: [bench_cpu_default.md](bench_cpu_default.md).",
        "",
        "## Loss per step (first repetition of each side)",
        "",
        "| step | real tokens | plain | fasttrain | relative difference |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *[f"| {k + 1} | {s['tokens_per_step'][k]} | {p:.6f} | {f:.6f} | {rel:.2e} |" for k, (p, f, rel) in
          enumerate(zip(s["losses"]["plain"], s["losses"]["fasttrain"], s["loss_rel_diff_per_step"], strict=True))],
    ]  # fmt: skip
    return lines


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--client", required=True, choices=("llamafactory",))
    p.add_argument("--model", default="qwen3-0.6b", choices=sorted(SHAPES), help="tiny: to check the script")
    _common.int_options(p, steps=4, repeats=2, batch_size=2, seq_len=512, seed=0)
    p.add_argument("--wait-load", type=float, default=0.5, help="first wait for this load, no pytest; 0: no")
    a = p.parse_args()
    client = a.client
    if not (env_bin(client) / "python").is_file():
        sys.exit(f"no {env_bin(client) / 'python'}: build the environment with `bash .ci/env-{client}`")
    start, waited = time.perf_counter(), wait_until_quiet(a.wait_load)
    result = _common.new_result(f"clients_cpu_{client}")
    packages = ["torch", "transformers", "trl", "accelerate", "datasets", client, "fasttrain"]
    installed = json.loads(in_client(client, "installed", *packages))
    result.update(settings={k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
                  client_versions=installed["versions"],
                  fasttrain_wheel=wheel_vs_head(Path(installed["fasttrain_dir"])), waited_s=waited)  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix=f"bench_clients_{client}_"))  # model, data and runs
    try:
        print(f"[bench_clients] preparing model and data in {work}", flush=True)
        counts, runs, b = prepare(client, work, a), [], a.batch_size
        # each step's tokens: the steps take the prepared rows in order, a batch at a time
        tokens_per_step = [sum(c["tokens"] for c in counts[i : i + b]) for i in range(0, len(counts), b)]
        for index, side in itertools.product(range(1, a.repeats + 1), SIDES):
            run = train(client, work, a, side, index)
            run["figures"] = f = figures(run, tokens_per_step)
            runs.append(run)
            print(f"[bench_clients] run {index} {side}: {f['tokens_per_s_all']:.1f} tokens/s, peak RSS "
                  f"{f['peak_rss_training_mib']:,.0f} MiB, {run['wall_s']:.0f} s", flush=True)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.update(wall_s=time.perf_counter() - start, load_after=os.getloadavg()[0], token_counts=counts,
                  summary=summarize(runs, tokens_per_step), runs=runs)  # fmt: skip
    stem = f"clients_cpu_{client}" + ("" if a.model == "qwen3-0.6b" else f"_{a.model}")
    title = "LLaMA-Factory's own CLI (`llamafactory-cli train`), SFT on CPU: plain vs with fasttrain"
    print(_common.write(a.out, stem, result, title, markdown(result)))


if __name__ == "__main__":
    main()
