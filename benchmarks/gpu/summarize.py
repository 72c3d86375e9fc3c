"""The last step of benchmarks/gpu/run.sh: one table of every step (status, time against its cap, headline).

    python benchmarks/gpu/summarize.py DIR

Reads DIR/steps.tsv (written by run.sh, one line per step) and the results the steps wrote, writes
DIR/summary.md and prints it. Headlines come from the files this project's scripts write; a file that is
missing or has another shape gives "see <file>", never a crash: the summary must come out whatever failed.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import roofline  # beside this script (torch is imported only to measure, never here)


def _junit(path: Path) -> str:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    return f"{passed} passed, {count['failures'] + count['errors']} failed, {count['skipped']} skipped"


def _parity(path: Path) -> str:
    data = json.loads(path.read_text())
    parts = []
    for case in data["cases"]:
        m = case["measured"]
        parts.append(
            f"{case['precision']} {'pass' if case['passed'] else 'FAIL'}: loss {m['loss']:.1e}, "
            f"grad_norm {m['grad_norm']:.1e}, params {m['params']:.1e}"
        )
    return "; ".join(parts)


def _bench(path: Path) -> str:
    """`fasttrain bench --json`: each contender's tokens/s and peak memory against the reference; a contender
    that crashed, with its error; a file the bench wrote before it was cut short says so."""
    data = json.loads(path.read_text())
    parts = []
    if data.get("complete") is False:
        parts.append(f"PARTIAL ({data.get('runs_done')} of {data.get('runs_planned')} runs)")
    for key, vs in data["comparison"].items():
        if not key.endswith("_vs_reference"):
            continue
        name = key.removesuffix("_vs_reference")
        if "training_phase_time_s_ratio" in vs:  # GRPO/RLOO: the training phase's figures (generation apart)
            part = (
                f"{name} training phase {vs['tokens_per_s_ratio']:.2f}x tokens/s, "
                f"{vs['training_peak_memory_mb_ratio']:.2f}x its peak memory"
            )
        else:
            part = (
                f"{name} {vs['tokens_per_s_ratio']:.2f}x tokens/s, {vs['peak_memory_ratio']:.2f}x peak memory"
            )
        worst = vs.get("largest_metric_difference") or {}
        if worst.get("metric"):
            part += f", max metric diff {worst['max_rel']:.1e} ({worst['metric']})"
        parts.append(part)
    for path_name, share in (data.get("shares") or {}).items():
        status = ((data.get("fasttrain") or {}).get("hot_paths") or {}).get(path_name, "?")
        parts.append(
            f"{path_name} ({status}) {share['speedup']:.2f}x tokens/s and {share['peak_memory_ratio']:.2f}x peak memory "
            "of fasttrain without it"
        )
    for name, error in data.get("failed", {}).items():
        last = [line for line in error.splitlines() if line.strip()][-1:] or [""]
        parts.append(f"{name} FAILED: {last[0].strip()[:120]}")
    utilisation = _model_flops(data, path.parent)
    if utilisation:
        parts.append(utilisation)
    return "; ".join(parts)


def _model_flops(data: dict, out: Path) -> str:
    """The training step's roofline: tokens/s x the model FLOPs a token costs (``train_flops_per_token``, from
    the shapes) as a % of the matmul throughput the hardware step measured."""
    limits_file = next(
        (out / n for n in ("hardware.json", "hardware_smoke.json") if (out / n).exists()), None
    )
    if limits_file is None:
        return ""
    peak = json.loads(limits_file.read_text())["limits"]["matmul_flops_per_s"]
    cells = []
    for name in ("reference", "liger", "fasttrain"):
        side = data.get(name) or {}
        flops, tokens_per_s = side.get("train_flops_per_token"), side.get("tokens_per_s")
        if flops and tokens_per_s:
            cells.append(f"{name} {roofline.fmt_percent(100 * tokens_per_s * flops / peak)}")
    return "model FLOPs " + ", ".join(cells) + " of the matmul limit" if cells else ""


def _hardware(path: Path) -> str:
    limits = json.loads(path.read_text())["limits"]
    return (
        f"copy {limits['copy_bytes_per_s'] / 1e9:,.0f} GB/s, matmul {limits['matmul_flops_per_s'] / 1e12:,.3g} "
        f"TFLOP/s: {limits['source']}"
    )


def _pct(entry: dict | None) -> str:
    return roofline.fmt_percent((entry or {}).get("percent_of_limit"))


def _adamw(path: Path) -> str:
    """Clip + step of Triton's default mode and of torch's fused AdamW, each with its % of the roofline."""
    data = json.loads(path.read_text())
    parts = []
    for r in data["results"]:
        ours = next(
            (v for v in r["variants"] if v["variant"] == "default (triton)" and "median_ms" in v), None
        )
        part = f"{r['model']} {r['dtype']} clip+step: torch {r['reference_ms']['ref_clip_step']:.2f} ms "
        part += f"({_pct(r['reference_roofline']['clip_step'])} lim)"
        if ours is not None:
            part += f", triton {ours['median_ms']['clip_step']:.2f} ms ({_pct(ours['roofline']['clip_step'])} lim)"
        parts.append(part)
    return "; ".join(parts) + f"; backend verdict {data['default_backend_decision']['verdict']}"


def _loss(path: Path) -> str:
    """Per case and shape: each implementation's time with its % of the roofline."""
    data = json.loads(path.read_text())
    parts = []
    for r in data["results"]:
        cells = []
        for impl, x in (r["impls"] if isinstance(r["impls"], dict) else {}).items():
            if isinstance(x, dict) and x.get("time_ms") is not None:
                cells.append(f"{impl} {x['time_ms']:.1f} ms ({_pct(x.get('roofline'))})")
        parts.append(f"{r.get('case', '')} {r['tokens']}x{r['vocab']}: " + (", ".join(cells) or "no timing"))
    return "; ".join(parts) + " (% of the roofline)"


def _speculation(path: Path) -> str:
    """Per case and dtype: the exact recompute's time over the speculation's (> 1: the speculation wins)."""
    rows = json.loads(path.read_text())["rows"]
    cells = [
        f"{r['case']} {r['dtype']} {r['recompute_over_speculation']:.2f}x"
        + (" (bitwise equal)" if r["hidden_grad_bitwise_equal"] else "")
        for r in rows
    ]
    return "recompute / speculation: " + ", ".join(cells)


def _compile(path: Path) -> str:
    done = json.loads(_last_line(path))
    return f"{done['done'] - done['failed']} of {done['done']} kernel variants compiled for sm_90"


def _collected(path: Path) -> str:
    """The kernels step without its junit file: pytest's last line (the smoke run's --collect-only says how many
    tests it collected)."""
    last = _last_line(path)
    return f"collected only: {last}" if " collected" in last and " passed" not in last else last


def _last_line(path: Path) -> str:
    lines = path.read_text().strip().splitlines()
    return lines[-1] if lines else ""


# step -> (result file, reader); the first file that exists is read
HEADLINES = {
    "install": [("logs/install.log", _last_line)],
    "kernels": [("kernels.xml", _junit), ("logs/kernels.log", _collected)],
    "parity": [("parity_gpu.json", _parity), ("parity_gpu_smoke.json", _parity)],
    "e2e": [("bench_e2e_gpu.json", _bench), ("bench_e2e_gpu_smoke.json", _bench)],
    "packing": [("bench_packing_gpu.json", _bench), ("bench_packing_gpu_smoke.json", _bench)],
    "loss-speculation": [
        ("loss_speculation_gpu.json", _speculation),
        ("loss_speculation_smoke.json", _speculation),
    ],
    "trl-sft": [("bench_sft_gpu.json", _bench), ("bench_sft_gpu_smoke.json", _bench)],
    "trl-dpo": [("bench_dpo_gpu.json", _bench), ("bench_dpo_gpu_smoke.json", _bench)],
    "grpo": [("bench_grpo_gpu.json", _bench), ("bench_grpo_gpu_smoke.json", _bench)],
    "hardware": [("hardware.json", _hardware), ("hardware_smoke.json", _hardware)],
    "compile": [("logs/compile.log", _compile)],
    "adamw": [("adamw_gpu.json", _adamw), ("adamw_gpu_smoke.json", _adamw)],
    "loss": [("loss_gpu.json", _loss), ("loss_gpu_smoke.json", _loss)],
    "loss-trl": [("loss_trl_gpu.json", _loss), ("loss_trl_gpu_smoke.json", _loss)],
    "environment": [("environment.md", None)],
}


def headline(out: Path, step: str) -> str:
    for name, reader in HEADLINES.get(step, []):
        path = out / name
        if not path.exists():
            continue
        if reader is None:
            return f"see {name}"
        try:
            return reader(path)
        except Exception as exc:  # a result of another shape must not cost the summary
            return f"see {name} ({type(exc).__name__})"
    return "no result file"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python benchmarks/gpu/summarize.py DIR", file=sys.stderr)
        return 2
    out = Path(argv[0])
    rows = []
    for line in (out / "steps.tsv").read_text().splitlines():
        step, status, wall, cap = line.split("\t")[:4]
        rows.append((step, status, int(wall), int(cap)))
    env = {}
    if (out / "environment.json").exists():
        env = json.loads((out / "environment.json").read_text())
    gpu = env.get("gpu", {}).get("name", "no GPU")
    total, budget = sum(r[2] for r in rows), sum(r[3] for r in rows)
    lines = [
        "# GPU run summary",
        "",
        f"- {gpu}; Python {env.get('python', '?')}; "
        + ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if k in ("torch", "triton", "transformers", "trl", "fasttrain")),
        f"- steps took {total} s of their {budget} s of caps",
        "",
        "| step | status | time (s) / cap | headline |",
        "| --- | --- | ---: | --- |",
    ]  # fmt: skip
    lines += [f"| {s} | {st} | {w} / {c} | {headline(out, s)} |" for s, st, w, c in rows]
    failed = [s for s, st, _, _ in rows if st != "ok"]
    lines += ["", f"steps: {len(rows) - len(failed)} passed, {len(failed)} failed", ""]
    text = "\n".join(lines)
    (out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
