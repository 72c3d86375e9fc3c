"""What the GPU run ran on: the GPU, the driver, Python, glibc, every package that matters and where it came
from (preinstalled on the machine, or one of the wheels run.sh installed from .whl/), and whether those wheels'
requirements hold there.

    python benchmarks/gpu/environment.py --out DIR [--site SITE_DIR] [--smoke]

Writes DIR/environment.json and DIR/environment.md. Exits 1 when something the run needs does not import
(fasttrain, its native module and kernels, trl, datasets; liger_kernel too on a GPU): the steps after it
would only fail the same way. A wheel whose requirement the preinstalled packages do not meet is reported, not
fatal.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

PACKAGES = (
    "fasttrain", "torch", "triton", "transformers", "accelerate", "trl", "datasets", "liger-kernel", "peft",
    "tokenizers", "huggingface-hub", "safetensors", "numpy", "pyarrow", "pandas", "fsspec", "dill",
    "multiprocess", "pytest", "matplotlib",
)  # fmt: skip
REQUIRED_IMPORTS = ("fasttrain", "fasttrain._native", "fasttrain.kernels", "trl", "datasets")


def _gpu() -> dict:
    info: dict = {}
    try:
        import torch

        info["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            info.update(
                name=props.name,
                memory_gib=round(props.total_memory / 2**30, 1),
                capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count,
                torch_cuda=torch.version.cuda,
            )
    except Exception as exc:  # report, do not crash: this step's job is to say what is there
        info["error"] = f"{type(exc).__name__}: {exc}"
    try:
        query = "name,driver_version,memory.total,clocks.max.sm"
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        if done.returncode == 0:
            info["nvidia_smi"] = done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


def _requirement_problems(site: Path) -> list[str]:
    """Each installed wheel's requirements (no extras) against what this interpreter sees."""
    from packaging.requirements import Requirement

    problems = []
    for dist in importlib.metadata.distributions(path=[str(site)]):
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue  # an extra's or another platform's requirement
            try:
                have = importlib.metadata.version(req.name)
            except importlib.metadata.PackageNotFoundError:
                problems.append(f"{dist.metadata['Name']} needs {req}: not installed")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{dist.metadata['Name']} needs {req}: have {have}")
    return sorted(set(problems))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--site", type=Path, help="the folder run.sh installed the wheels into")
    parser.add_argument("--smoke", action="store_true", help="CPU run: liger_kernel is not required")
    args = parser.parse_args()

    versions, origins = {}, {}
    site = str(args.site.resolve()) if args.site else None
    for name in PACKAGES:
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        versions[name] = dist.version
        location = str(Path(dist.locate_file("")).resolve())
        origins[name] = "wheel" if site and location.startswith(site) else "preinstalled"
    failed_imports = {}
    for module in (*REQUIRED_IMPORTS, *(() if args.smoke else ("liger_kernel",))):
        try:
            importlib.import_module(module)
        except Exception as exc:
            failed_imports[module] = f"{type(exc).__name__}: {exc}"
    env = {
        "date_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "platform": platform.platform(),
        "glibc": "-".join(platform.libc_ver()),
        "cpu_cores": len(os.sched_getaffinity(0)),
        "gpu": _gpu(),
        "versions": versions,
        "origin": origins,
        "requirement_problems": _requirement_problems(args.site) if args.site and args.site.is_dir() else [],
        "failed_imports": failed_imports,
        "environment_variables": {
            k: os.environ[k] for k in ("PYTHONPATH", "TRITON_INTERPRET", "HF_HUB_OFFLINE") if k in os.environ
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "environment.json").write_text(json.dumps(env, indent=2) + "\n")
    gpu = env["gpu"]
    lines = [
        "# Environment of the GPU run",
        "",
        f"- date (UTC): {env['date_utc']}",
        f"- GPU: {gpu.get('name', 'none')}"
        + (f", {gpu['memory_gib']} GiB, sm_{gpu['capability'].replace('.', '')}, CUDA {gpu['torch_cuda']}" if "name" in gpu else "")
        + (f"; nvidia-smi: {gpu['nvidia_smi']}" if "nvidia_smi" in gpu else ""),
        f"- Python {env['python']} ({env['executable']}), {env['glibc']}, {env['cpu_cores']} cores, {env['platform']}",
        "- packages: " + ", ".join(f"{k} {v}" + (" (wheel)" if origins[k] == "wheel" else "") for k, v in versions.items()),
    ]  # fmt: skip
    for problem in env["requirement_problems"]:
        lines.append(f"- requirement not met: {problem}")
    for module, error in failed_imports.items():
        lines.append(f"- IMPORT FAILED: {module}: {error}")
    text = "\n".join(lines) + "\n"
    (args.out / "environment.md").write_text(text)
    print(text)
    return 1 if failed_imports else 0


if __name__ == "__main__":
    raise SystemExit(main())
