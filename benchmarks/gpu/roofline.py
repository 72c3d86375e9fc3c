"""The roofline beside each GPU figure: how far a kernel is from what the hardware can do, not only from torch.

For each kernel the bytes it must move and the FLOPs it must do follow from the shapes alone (``adamw_cost``,
``linear_loss_cost``); divided by the machine's limits (``Limits``: copy bandwidth counting bytes read and
written, dense bf16 matmul throughput) they give the least time the hardware allows, and ``percent_of_limit``
puts that against the measured time (100% = at the roofline).

The limits are measured at the start of the GPU run (``python benchmarks/gpu/roofline.py --out DIR``: a
device-to-device copy and a matmul, a few seconds; ``DIR/hardware.json``). Only when measuring fails on a GPU
do the H200's datasheet peaks (``QUOTED_H200``, quoted from NVIDIA, never measured by fasttrain) stand in;
every result says which was used. On CPU (``--smoke``) the same code measures the CPU's copy and matmul, so
the path is exercised in CI.

    python benchmarks/gpu/roofline.py --out DIR [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import statistics
import sys
import time
from pathlib import Path

# The fallback when the run's own measurement fails: NVIDIA's published peaks for the H200 SXM (NVIDIA H200
# Tensor Core GPU datasheet, https://www.nvidia.com/en-us/data-center/h200/): 4.8 TB/s GPU memory bandwidth
# and 1,979 TFLOP/s BF16 Tensor Core "with sparsity", i.e. 989 TFLOP/s dense. Spec peaks, not measurements:
# a real copy or matmul reaches less, so a % of the roofline against them reads lower than against the
# measured limits; and they are an H200's even on another GPU.
QUOTED_H200 = {"copy_bytes_per_s": 4.8e12, "matmul_flops_per_s": 989e12}
QUOTED_H200_SOURCE = "NVIDIA H200 SXM datasheet peaks (nvidia.com/en-us/data-center/h200)"


@dataclasses.dataclass(frozen=True)
class Limits:
    copy_bytes_per_s: float  # bytes read + written per second by a large copy
    matmul_flops_per_s: float  # dense matmul (bf16 on GPU, fp32 on CPU)
    source: str  # "measured on <device> ..." or "quoted NVIDIA H200 SXM datasheet peaks, not measured (...)"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Cost:
    bytes: float  # the least the kernel must read + write in device memory
    flops: float  # the least arithmetic it must do (0 where bandwidth is the only limit that applies)

    def __add__(self, other: Cost) -> Cost:
        return Cost(self.bytes + other.bytes, self.flops + other.flops)


def bound_s(cost: Cost, limits: Limits) -> float:
    """The least time the hardware allows for ``cost``: the slower of moving its bytes and doing its FLOPs."""
    return max(cost.bytes / limits.copy_bytes_per_s, cost.flops / limits.matmul_flops_per_s)


def percent_of_limit(measured_s: float | None, cost: Cost, limits: Limits) -> float | None:
    """100 * (least time) / (measured time): 100% is the roofline, 25% is four times slower than it."""
    if not measured_s or measured_s <= 0:
        return None
    return 100.0 * bound_s(cost, limits) / measured_s


def roofline_entry(measured_s: float | None, cost: Cost, limits: Limits) -> dict:
    """The fields a result row carries: cost, which limit binds, the least time and the % of it reached."""
    memory_s = cost.bytes / limits.copy_bytes_per_s
    compute_s = cost.flops / limits.matmul_flops_per_s
    return {
        "bytes": cost.bytes,
        "flops": cost.flops,
        "bound": "compute" if compute_s > memory_s else "memory",
        "limit_ms": 1e3 * max(memory_s, compute_s),
        "percent_of_limit": percent_of_limit(measured_s, cost, limits),
    }


def adamw_cost(n_params: int, param_bytes: float, grad_bytes: float, state_bytes: float, clip: bool) -> Cost:
    """One AdamW step over ``n_params``: reads param, grad and the state (exp_avg, exp_avg_sq: ``state_bytes``
    per parameter for both together, 8-bit codes and absmax included) and writes param and the state.
    ``clip``: the norm pass reads every gradient once more (the clip coefficient itself is applied in the step).
    Elementwise work: bandwidth is the only limit that applies."""
    per_param = 2 * param_bytes + grad_bytes + 2 * state_bytes + (grad_bytes if clip else 0)
    return Cost(bytes=n_params * per_param, flops=0.0)


def linear_loss_cost(
    tokens: int, hidden: int, vocab: int, dtype_bytes: int = 2, backward: bool = True
) -> Cost:
    """``hidden [tokens, H] @ weight [V, H].T`` then a per-token loss, without the logits ever stored.

    Forward: 2 N H V FLOPs (the logits); backward adds 2 N H V for the hidden gradient and 2 N H V for the weight
    gradient. Bytes: read hidden, weight and labels (int64), write the per-token loss (fp32); backward also writes
    both gradients. The logits are not counted: a fused kernel need never move them."""
    n, h, v = tokens, hidden, vocab
    moved = (n * h + v * h) * dtype_bytes + n * 8 + n * 4
    flops = 2.0 * n * h * v
    if backward:
        moved += (n * h + v * h) * dtype_bytes
        flops *= 3
    return Cost(bytes=float(moved), flops=flops)


def fmt_percent(value: float | None) -> str:
    """Whole percents, two significant digits below 10% (a CPU smoke run is far below 1%)."""
    if value is None:
        return "n/a"
    return f"{value:.0f}%" if value >= 10 else f"{value:.2g}%"


# ------------------------------------------------------------------------------------------------
# measuring the limits
# ------------------------------------------------------------------------------------------------


def _median_s(fn, reps: int, cuda: bool) -> float:
    import torch

    fn()  # warm-up (allocation, cuBLAS heuristics)
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_s(device: str, n: int, cuda: bool) -> float:
    import torch

    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    return _median_s(lambda: dst.copy_(src), 10 if cuda else 5, cuda)


def _matmul_s(device: str, size: int, dtype, cuda: bool) -> float:
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return _median_s(lambda: a @ b, 10 if cuda else 5, cuda)


def measure(device: str, smoke: bool) -> Limits:
    """Copy bandwidth and matmul throughput of ``device``, measured now (a few seconds on a GPU)."""
    import torch

    cuda = device == "cuda"
    copy_elems = 2**28 if cuda else 2**24  # 1 GiB of fp32 on the GPU; 64 MiB (beyond the caches) on CPU
    copy_s = _copy_s(device, copy_elems, cuda)
    size = 8192 if cuda else (512 if smoke else 1024)
    dtype = torch.bfloat16 if cuda else torch.float32  # CPU bf16 matmul is no fair limit on most CPUs
    mm_s = _matmul_s(device, size, dtype, cuda)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    return Limits(
        copy_bytes_per_s=2 * copy_elems * 4 / copy_s,
        matmul_flops_per_s=2.0 * size**3 / mm_s,
        source=f"measured on {name} at the start of this run ({copy_elems * 4 >> 20} MiB copy, "
        f"{str(dtype).replace('torch.', '')} {size}^3 matmul)",
    )


def quoted(reason: str) -> Limits:
    return Limits(**QUOTED_H200, source=f"quoted {QUOTED_H200_SOURCE}, not measured ({reason})")


def _path(out: Path, smoke: bool) -> Path:
    return out / ("hardware_smoke.json" if smoke else "hardware.json")


def load(out: Path, device: str, smoke: bool) -> Limits:
    """The limits the run measured (``out/hardware.json``); measured now if absent (a script run on its own);
    on a GPU the H200's datasheet peaks if measuring fails, on CPU the error (there is nothing to fall back on)."""
    path = _path(out, smoke)
    if path.exists():
        data = json.loads(path.read_text())
        if data.get("device_type") == device:
            return Limits(**data["limits"])
    try:
        return measure(device, smoke)
    except Exception as exc:
        if device != "cuda":
            raise
        return quoted(f"measuring failed: {type(exc).__name__}: {str(exc)[:200]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="measure the CPU (no GPU needed)")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cpu" and not args.smoke:
        print("no CUDA device: run with --smoke to measure the CPU", file=sys.stderr)
        return 2
    try:
        limits = measure(device, args.smoke)
    except Exception as exc:  # on the GPU: still write the fallback, saying why
        if device != "cuda":
            raise
        limits = quoted(f"measuring failed: {type(exc).__name__}: {str(exc)[:200]}")
    record = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "device_type": device,
        "limits": limits.to_json(),
        "quoted_h200": {**QUOTED_H200, "source": QUOTED_H200_SOURCE},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    _path(args.out, args.smoke).write_text(json.dumps(record, indent=2) + "\n")
    print(
        f"copy {limits.copy_bytes_per_s / 1e9:,.1f} GB/s, matmul {limits.matmul_flops_per_s / 1e9:,.0f} GFLOP/s: "
        f"{limits.source}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
