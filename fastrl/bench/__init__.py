"""Benchmark harness: timing, the copy-bandwidth floor, results table and JSON.

Every measured row carries the minimum bytes its op must move (each input read
once, each output written once), the achieved GB/s, and that as a percentage of
the device-to-device copy bandwidth measured in the same run; peers run on the
same inputs in the same run and are reported as a time ratio to fastrl.
Op families describe their cases in sibling modules (``fastrl.bench.logprobs``).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import torch


@dataclasses.dataclass
class Impl:
    """One way to run a case: fastrl or a peer. ``make(inputs)`` returns the
    callable to time (set-up such as compilation happens there, untimed);
    ``unavailable`` says why a peer cannot run here (never silently dropped)."""

    name: str
    make: Callable[[dict], Callable[[], object]] | None
    unavailable: str | None = None


@dataclasses.dataclass
class Case:
    op: str  # e.g. "logprobs+entropy fwd+bwd"
    shape: tuple[int, ...]
    dtype: torch.dtype
    bytes_formula: str  # the minimum-traffic model, stated
    min_bytes: int
    make_inputs: Callable[[torch.device], dict]
    impls: list[Impl]
    check: Callable[[dict], float] | None = None  # max error of fastrl vs the reference


@dataclasses.dataclass
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    peak_extra_bytes: int | None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:  # the CPU model, which platform.processor() does not give on Linux
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_slug(device: torch.device) -> str:
    name = device_name(device) if device.type == "cuda" else f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, *, reps: int, warmup: int = 2) -> Timing:
    """Median and p20 / p80 over ``reps`` runs after ``warmup``: CUDA events on
    GPU, perf_counter on CPU. Peak extra memory is measured on GPU only."""
    for _ in range(warmup):
        fn()
    _sync(device)
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
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
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - base
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], peak)


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_fn(lambda: dst.copy_(src), device, reps=reps)
    return 2 * nbytes / t.median_s


def _git_commit() -> str | None:
    try:
        root = Path(__file__).resolve().parents[2]
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import fastrl

    return {
        "device": device_name(device),
        "device_type": device.type,
        "fastrl": fastrl.__version__,
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def run_cases(cases: list[Case], device: torch.device, *, reps: int, progress=None) -> list[dict]:
    """Times every implementation of every case; rows in the order measured."""
    rows = []
    for case in cases:
        inputs = case.make_inputs(device)
        max_err = case.check(inputs) if case.check else None
        fastrl_time = None
        for impl in case.impls:
            row = {
                "op": case.op, "shape": list(case.shape), "dtype": str(case.dtype).replace("torch.", ""),
                "impl": impl.name, "min_bytes": case.min_bytes, "bytes_formula": case.bytes_formula,
            }  # fmt: skip
            if impl.unavailable is not None:
                row["unavailable"] = impl.unavailable
            else:
                try:
                    fn = impl.make(inputs)
                    t = time_fn(fn, device, reps=reps)
                except (RuntimeError, MemoryError) as exc:  # e.g. a peer running out of memory
                    row["unavailable"] = f"failed: {str(exc).splitlines()[0][:120]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                else:
                    row.update(
                        median_ms=t.median_s * 1e3, p20_ms=t.p20_s * 1e3, p80_ms=t.p80_s * 1e3,
                        gbps=case.min_bytes / t.median_s / 1e9, peak_extra_bytes=t.peak_extra_bytes,
                    )  # fmt: skip
                    if impl.name == "fastrl":
                        fastrl_time = t.median_s
                        row["max_err_vs_reference"] = max_err
                    elif fastrl_time is not None:
                        row["fastrl_speedup"] = t.median_s / fastrl_time
            rows.append(row)
            if progress is not None:
                progress()
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_table(rows: list[dict], copy_gbps: float) -> str:
    headers = ["op", "shape", "dtype", "impl", "median ms", "p20-p80 ms", "GB/s", "% copy BW", "fastrl x", "extra MiB", "note"]
    lines = []
    for r in rows:
        cells = [r["op"], "x".join(map(str, r["shape"])), r["dtype"], r["impl"]]
        if "unavailable" in r:
            lines.append(cells + ["-"] * 6 + [r["unavailable"]])
            continue
        extra = r.get("peak_extra_bytes")
        lines.append(cells + [
            f"{r['median_ms']:.3f}", f"{r['p20_ms']:.3f}-{r['p80_ms']:.3f}", f"{r['gbps']:.1f}",
            f"{100 * r['gbps'] / copy_gbps:.1f}%", f"{r['fastrl_speedup']:.2f}x" if "fastrl_speedup" in r else "",
            f"{extra / 2**20:.0f}" if extra is not None else "", "",
        ])  # fmt: skip
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *(fmt(line) for line in lines)])


def write_json(path: Path, env: dict, copy_gbps: float, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**env, "copy_bandwidth_gbps": copy_gbps, "rows": rows}
    path.write_text(json.dumps(payload, indent=1) + "\n")



def _pytest_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_params(family) -> list:
    """One pytest-benchmark parameter per (case, implementation) of an op family
    module (``fastrl.bench.logprobs``, ...), for bench/bench_*.py: quick shapes
    unless FASTRL_BENCH_FULL=1."""
    import pytest

    quick = os.environ.get("FASTRL_BENCH_FULL", "0") in ("", "0")
    return [
        pytest.param(case, impl, id=f"{case.op}-{'x'.join(map(str, case.shape))}-{str(case.dtype)[6:]}-{impl.name}")
        for case in family.cases(_pytest_device(), quick=quick)
        for impl in case.impls
    ]


def pytest_benchmark_run(benchmark, case: Case, impl: Impl) -> None:
    """Times one implementation of one case under pytest-benchmark (skipped, with
    the reason, when the peer cannot run here)."""
    import pytest

    if impl.unavailable is not None:
        pytest.skip(impl.unavailable)
    device = _pytest_device()
    fn = impl.make(case.make_inputs(device))
    benchmark.extra_info.update(min_bytes=case.min_bytes, bytes_formula=case.bytes_formula)
    if device.type == "cuda":
        benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
    else:
        benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
