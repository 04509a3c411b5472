"""Benchmark harness: timing, the copy-bandwidth floor, results table and JSON.

Every measured row carries the minimum bytes its op must move (each input read
once, each output written once), the achieved GB/s, and that as a percentage of
the device-to-device copy bandwidth measured in the same run; peers run on the
same inputs in the same run and are reported as a time ratio to fastrl.
Op families describe their cases in sibling modules (``bench.logprobs``).

Run from the repository root (``python -m bench``): the harness is part of the
source tree, not of the installed package, and times the installed ``fastrl``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import datetime
import importlib
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
    check: Callable[[dict], float]  # largest error of fastrl's result against the float64 reference
    sweep: bool = False  # a point of a size sweep (plotted; not in the README table or the speed check)
    # In --check-speed-compiled's gate (not the LM head's cases: both sides run
    # torch's own GEMM for most of their time, so the ratio measures that GEMM).
    compiled_gate: bool = True

    def key(self) -> tuple:
        """What identifies the case in its result rows: see :func:`row_key`."""
        return self.op, tuple(self.shape), dtype_name(self.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for torch.bfloat16, as result rows name dtypes."""
    return str(dtype).replace("torch.", "")


def row_key(row: dict) -> tuple:
    """(op, shape, dtype) of a result row: the rows of one case share it."""
    return row["op"], tuple(row["shape"]), row["dtype"]


@dataclasses.dataclass
class Timing:
    median_s: float
    p20_s: float
    p80_s: float
    peak_extra_bytes: int | None


def import_peer(module: str):
    """(the module, None), or (None, why) when a peer is not importable here."""
    try:
        return importlib.import_module(module), None
    except Exception as exc:  # noqa: BLE001 - any import failure means the peer is absent here
        return None, f"not installed ({module}: {type(exc).__name__})"


def verl_vocab_parallel_entropy(group):
    """veRL's ``verl.utils.megatron.tensor_parallel.vocab_parallel_entropy`` (its
    own code) on ``group``, the world's ranks: it asks Megatron's ``parallel_state``
    for the tensor-parallel group, which is made over the world here where
    megatron-core is installed and not yet initialised; where it is not installed, a
    stand-in module answers with ``group`` (the only thing veRL asks of it there).
    None without veRL."""
    import sys
    import types

    try:
        from megatron.core import parallel_state
    except ImportError:
        stand_in = types.ModuleType("megatron.core.parallel_state")
        stand_in.get_tensor_model_parallel_group = lambda: group
        core = types.ModuleType("megatron.core")
        core.parallel_state = stand_in
        sys.modules.update({"megatron": types.ModuleType("megatron"), "megatron.core": core,
                            "megatron.core.parallel_state": stand_in})  # fmt: skip
    else:
        if not parallel_state.model_parallel_is_initialized():
            import torch.distributed as dist

            parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size(group))
    module, _ = import_peer("verl.utils.megatron.tensor_parallel")
    return None if module is None else module.vocab_parallel_entropy


# Whether --quick runs also time torch.compile of the reference: compiling takes
# longer than the quick cases themselves, so only a speed check against it
# (``--check-speed-compiled``) turns it on.
COMPILED_IN_QUICK = False
COMPILED = "torch.compile(reference)"


def compiled_reference(wrap: Callable[[Callable], Callable[[dict], Callable[[], object]]], fn: Callable, quick: bool) -> Impl:
    """The ``torch.compile(reference)`` peer of a case (``wrap`` turns ``fn`` into
    an Impl.make), skipped in --quick (compile time) unless COMPILED_IN_QUICK."""
    if quick and not COMPILED_IN_QUICK:
        return Impl(COMPILED, None, "skipped in --quick (compile time)")
    return Impl(COMPILED, wrap(torch.compile(fn, dynamic=False)))


def generator(device: torch.device, seed: int) -> torch.Generator:
    """A seeded generator on ``device``, so that a case draws its inputs where it
    uses them: a GPU draws the [16384, 151936] logits in milliseconds where the host
    took seconds a tensor (and a minute over a GPU plan's cases). On a CPU the draws
    are those of ``torch.Generator("cpu").manual_seed(seed)``."""
    return torch.Generator(device=device).manual_seed(seed)


def no_grad_step(run: Callable[[dict], object]) -> Callable[[dict], Callable[[], object]]:
    """An Impl.make that times ``run(inputs)`` under torch.no_grad."""

    def make(inputs):
        def step():
            with torch.no_grad():
                return run(inputs)

        return step

    return make


def grad_step(run: Callable[[torch.Tensor, dict], object], wrt: str) -> Callable[[dict], Callable[[], object]]:
    """An Impl.make that times forward + backward: the gradient w.r.t.
    ``inputs[wrt]`` of the sum of what ``run(x, inputs)`` returns (a tensor or a tuple)."""

    def make(inputs):
        x = inputs[wrt].detach().requires_grad_(True)

        def step():
            out = run(x, inputs)
            outs = out if isinstance(out, tuple) else (out,)
            return torch.autograd.grad(sum(o.sum() for o in outs), x)

        return step

    return make


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


# The x86-64 levels of the native CPU kernels (fastrl._C's names), with the
# torch CPU capability (ATEN_CPU_CAPABILITY) and Inductor vector width
# (torch._inductor.config.cpp.simdlen) that run torch at the same level.
CPU_LEVELS = {"x86-64-v4": ("avx512", 512), "x86-64-v3": ("avx2", 256), "x86-64": ("default", 1)}


def native_cpu_isa() -> dict:
    """The native kernels' active level and the CPU's best ({} without fastrl._C)."""
    from fastrl._backend import native_module

    native = native_module()
    if native is None:
        return {}
    info = native.build_info()
    return {"cpu_isa": info["cpu_isa"], "cpu_isa_best": info["cpu_isa_best"]}


def device_slug(device: torch.device) -> str:
    """The results file's name: the GPU's name, or on a CPU its architecture and
    the level the native kernels run at (cpu-x86-64-v4, cpu-x86-64-v3, ...), so
    that the runs of each level sit side by side."""
    if device.type == "cuda":
        name = device_name(device)
    else:
        level = native_cpu_isa().get("cpu_isa", "").split(" ")[0]
        name = f"cpu-{level}" if level.startswith("x86-64") else f"cpu-{platform.machine()}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def results_label(payload: dict) -> str:
    """What ran a results file, for headings and plot names: the device, and on a
    CPU the level its native kernels ran at, marked when forced below the CPU's
    best (``FASTRL_CPU_ISA``)."""
    label = payload["device"]
    isa, best = payload.get("cpu_isa"), payload.get("cpu_isa_best")
    if payload.get("device_type") == "cpu" and isa:
        label += f", native kernels at {isa}"
        if best and best != isa:
            label += f" (forced; the CPU has {best.split(' ')[0]})"
        if payload.get("aten_cpu_capability"):
            label += f", torch at {payload['aten_cpu_capability']}"
    return label


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _PeakMemory:
    """Peak memory a run adds above what was allocated when it started: the CUDA
    caching allocator's peak on GPU; on Linux CPUs the process's peak resident
    set (VmHWM), reset through /proc/self/clear_refs; None where neither exists."""

    def __init__(self, device: torch.device):
        self.device = device
        self.base: int | None = None

    @staticmethod
    def _proc_status(field: str) -> int | None:
        try:
            match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
        except OSError:
            return None
        return int(match.group(1)) * 1024 if match else None

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        try:
            # Hand memory freed by earlier runs back to the OS first: a run that
            # reuses it would not raise the resident set, and would look free.
            ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        except (OSError, AttributeError, TypeError):
            return
        self.base = self._proc_status("VmRSS")

    def extra_bytes(self) -> int | None:
        if self.base is None:
            return None
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        peak = self._proc_status("VmHWM")
        return None if peak is None else max(peak - self.base, 0)


def time_fn(fns: list[Callable[[], object]], device: torch.device, *, reps: int, warmup: int = 2) -> Timing:
    """Median and p20 / p80 over ``reps`` runs after ``warmup``, cycling through
    ``fns`` (the same op on different copies of its inputs, so that a GPU run
    does not find them in L2): CUDA events on GPU, perf_counter on CPU; and the
    peak extra memory of one further run."""
    for i in range(warmup):
        fns[i % len(fns)]()
    _sync(device)
    times = []
    for i in range(reps):
        fn = fns[i % len(fns)]
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
    # Memory is measured on one more run, untimed: returning freed pages to the
    # OS first (CPU) would otherwise add page faults to the timed runs.
    memory = _PeakMemory(device)
    memory.start()
    fns[0]()
    _sync(device)
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
    return Timing(statistics.median(times), q[0], q[3], memory.extra_bytes())


def _input_bytes(inputs: dict) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))


def input_copies(make_inputs: Callable[[torch.device], dict], device: torch.device) -> list[dict]:
    """The case's inputs, and on GPU enough further copies that cycling through
    them moves at least twice the L2 cache between two uses of one copy (at most 16)."""
    first = make_inputs(device)
    if device.type != "cuda":
        return [first]
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    copies = min(16, -(-2 * l2 // max(_input_bytes(first), 1)))
    clone = lambda v: v.clone() if isinstance(v, torch.Tensor) else v  # noqa: E731
    return [first] + [{k: clone(v) for k, v in first.items()} for _ in range(copies - 1)]


def copy_bandwidth(device: torch.device, nbytes: int | None = None, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    nbytes = nbytes or (1 << 30 if device.type == "cuda" else 1 << 28)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    t = time_fn([lambda: dst.copy_(src)], device, reps=reps)
    return 2 * nbytes / t.median_s


def _git_commit() -> str | None:
    """HEAD of the checkout, or FASTRL_BENCH_COMMIT where the tree was copied
    without its .git (a GPU machine's copy of the working tree)."""
    try:
        root = Path(__file__).resolve().parents[1]
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("FASTRL_BENCH_COMMIT")


def environment(device: torch.device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    import fastrl

    env = {
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
    if device.type == "cpu":
        # The code paths that ran: the native kernels' x86-64 level, torch's own
        # CPU kernels' and Inductor's vector width, and torch's huge-page setting.
        env.update(native_cpu_isa())
        env["aten_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        env["inductor_simdlen"] = _inductor_simdlen()
        env["THP_MEM_ALLOC_ENABLE"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
    return env


def _inductor_simdlen() -> int | None:
    try:
        from torch._inductor import config
    except ImportError:
        return None
    return config.cpp.simdlen


def run_cases(cases: list[Case], device: torch.device, *, reps: int, progress=None) -> list[dict]:
    """Times every implementation of every case; rows in the order measured."""
    rows = []
    for case in cases:
        copies = input_copies(case.make_inputs, device)
        max_err = case.check(copies[0])
        fastrl_time = None
        for impl in case.impls:
            row = {
                "op": case.op, "shape": list(case.shape), "dtype": dtype_name(case.dtype),
                "impl": impl.name, "min_bytes": case.min_bytes, "bytes_formula": case.bytes_formula,
                "sweep": case.sweep,
            }  # fmt: skip
            if impl.unavailable is not None:
                row["unavailable"] = impl.unavailable
            else:
                try:
                    t = time_fn([impl.make(inputs) for inputs in copies], device, reps=reps)
                except Exception as exc:  # noqa: BLE001 - a peer that fails (out of memory, another API) is recorded
                    if impl.name == "fastrl":
                        raise
                    row["unavailable"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
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
        del copies
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def remeasure_ratio(case: Case, peer: str, device: torch.device, *, reps: int, rounds: int = 3) -> float:
    """Peer time over fastrl time on ``case``, measured again: ``rounds`` rounds
    that time fastrl and then the peer, each impl keeping its fastest round's
    median. A speed check re-measures a ratio that fell short before failing
    on it: a burst of load from another process on a small shared machine slows
    whichever impl it lands on, while a real regression slows fastrl in every round."""
    impls = {impl.name: impl for impl in case.impls}
    copies = input_copies(case.make_inputs, device)
    calls = {name: [impls[name].make(inputs) for inputs in copies] for name in ("fastrl", peer)}
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, fns in calls.items():
            best[name] = min(best[name], time_fn(fns, device, reps=reps).median_s)
    return best[peer] / best["fastrl"]


TABLE_HEADERS = ["op", "shape", "dtype", "impl", "median ms", "p20-p80 ms", "GB/s", "% copy BW", "fastrl x", "extra MiB", "note"]


def table_cells(rows: list[dict], copy_gbps: float) -> list[list[str]]:
    """One list of cells (TABLE_HEADERS) per measured or unavailable row."""
    lines = []
    for r in rows:
        cells = [r["op"], "x".join(map(str, r["shape"])), r["dtype"], r["impl"]]
        if "unavailable" in r:
            lines.append(cells + ["-"] * 6 + [r["unavailable"]])
            continue
        extra = r.get("peak_extra_bytes")
        lines.append(cells + [
            f"{r['median_ms']:.3f}", f"{r['p20_ms']:.3f}-{r['p80_ms']:.3f}", f"{r['gbps']:.1f}",
            f"{percent_of_copy(r, copy_gbps):.1f}%", f"{r['fastrl_speedup']:.2f}x" if "fastrl_speedup" in r else "",
            f"{extra / 2**20:.0f}" if extra is not None else "", "",
        ])  # fmt: skip
    return lines


def format_table(rows: list[dict], copy_gbps: float) -> str:
    """The results as a plain-text table."""
    lines = table_cells(rows, copy_gbps)
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(TABLE_HEADERS)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(TABLE_HEADERS), fmt(["-" * w for w in widths]), *(fmt(line) for line in lines)])


def print_table(rows: list[dict], copy_gbps: float) -> None:
    """Prints the results with rich when it is installed (and stdout is a
    terminal), as plain text otherwise."""
    try:
        import rich.console
        import rich.table
    except ImportError:
        print(format_table(rows, copy_gbps))
        return
    console = rich.console.Console()
    if not console.is_terminal:
        print(format_table(rows, copy_gbps))
        return
    table = rich.table.Table(*TABLE_HEADERS, title=f"fastrl bench (copy bandwidth {copy_gbps:.1f} GB/s)")
    for cells, row in zip(table_cells(rows, copy_gbps), rows):
        table.add_row(*cells, style="bold" if row["impl"] == "fastrl" else ("dim" if "unavailable" in row else None))
    console.print(table)


def percent_of_copy(row: dict, copy_gbps: float) -> float:
    """A measured row's GB/s as a percentage of the copy bandwidth of the run that
    measured it (``copy_gbps`` for rows that do not record theirs)."""
    return 100 * row["gbps"] / row.get("copy_gbps", copy_gbps)


def copy_bandwidth_label(payload: dict, rows: list[dict] | None = None) -> str:
    """The copy bandwidth behind ``rows`` (default: all) of a results file, for a
    heading: one figure, or the range over the runs they come from (see ``merge_rows``)."""
    rows = payload["rows"] if rows is None else rows
    values = sorted({r.get("copy_gbps", payload["copy_bandwidth_gbps"]) for r in rows}) or [payload["copy_bandwidth_gbps"]]
    return f"{values[0]:.1f} GB/s" if len(values) == 1 else f"{values[0]:.1f}-{values[-1]:.1f} GB/s"


def merge_refusal(previous: dict, env: dict) -> str | None:
    """Why the rows of ``previous`` (a results file's contents) cannot be merged
    with a run in ``env``: another device, commit or torch; None when they can."""
    for key in ("device", "commit", "torch"):
        if previous.get(key) != env.get(key):
            return f"the results file has {key} {previous.get(key)!r}, this run {env.get(key)!r}"
    return None


def merge_rows(previous: dict, rows: list[dict]) -> list[dict]:
    """``rows`` after the rows of ``previous`` whose case (op, shape, dtype) was not
    measured now, so that a suite run op family by op family, or shape by shape
    (a GPU lease allows ten minutes a command; one log-prob shape with its peers
    took three on an H100), adds up to one file; each row keeps the copy
    bandwidth of its own run. Check :func:`merge_refusal` first."""
    measured = {row_key(r) for r in rows}
    kept = [{"copy_gbps": previous["copy_bandwidth_gbps"], **r} for r in previous["rows"] if row_key(r) not in measured]
    return kept + rows


def write_json(path: Path, env: dict, copy_gbps: float, rows: list[dict]) -> dict:
    """Writes the results file and returns what it holds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {**env, "copy_bandwidth_gbps": copy_gbps, "rows": rows}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return payload



def _pytest_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_params(family) -> list:
    """One pytest-benchmark parameter per (case, implementation) of an op family
    module (``bench.logprobs``, ...), for bench/bench_*.py: quick shapes
    unless FASTRL_BENCH_FULL=1."""
    import pytest

    quick = os.environ.get("FASTRL_BENCH_FULL", "0") in ("", "0")
    return [
        pytest.param(case, impl, id=f"{case.op}-{'x'.join(map(str, case.shape))}-{dtype_name(case.dtype)}-{impl.name}")
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
