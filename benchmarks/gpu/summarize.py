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
    """`fasttrain bench --json`: each contender's tokens/s and peak memory against the reference."""
    data = json.loads(path.read_text())
    parts = []
    for key, vs in data["comparison"].items():
        if not key.endswith("_vs_reference"):
            continue
        name = key.removesuffix("_vs_reference")
        part = f"{name} {vs['tokens_per_s_ratio']:.2f}x tokens/s, {vs['peak_memory_ratio']:.2f}x peak memory"
        worst = vs.get("largest_metric_difference") or {}
        if worst.get("metric"):
            part += f", max metric diff {worst['max_rel']:.1e} ({worst['metric']})"
        parts.append(part)
    return "; ".join(parts)


def _last_line(path: Path) -> str:
    lines = path.read_text().strip().splitlines()
    return lines[-1] if lines else ""


# step -> (result file, reader); the first file that exists is read
HEADLINES = {
    "install": [("logs/install.log", _last_line)],
    "kernels": [("kernels.xml", _junit)],
    "parity": [("parity_gpu.json", _parity), ("parity_gpu_smoke.json", _parity)],
    "e2e": [("bench_e2e_gpu.json", _bench), ("bench_e2e_gpu_smoke.json", _bench)],
    "trl-sft": [("bench_sft_gpu.json", _bench), ("bench_sft_gpu_smoke.json", _bench)],
    "trl-dpo": [("bench_dpo_gpu.json", _bench), ("bench_dpo_gpu_smoke.json", _bench)],
    "adamw": [("adamw_gpu.md", None), ("adamw_gpu_smoke.md", None)],
    "loss": [("loss_gpu.md", None), ("loss_gpu_smoke.md", None)],
    "loss-trl": [("loss_trl_gpu.md", None), ("loss_trl_gpu_smoke.md", None)],
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
