"""``python -m tools.sass``: the static sm_90 performance model of every
kernel, *predicted* from the compiled code, never measured.

    python -m tools.sass                 model, table, bench/results/sm90-predicted-triton-<installed>.json
    python -m tools.sass --arch 90       sm_90 only (default: sm_90 and sm_80)
    bash tools/sass/tritons.sh           one predictions file for each Triton our users run

What it compiles. Every Triton kernel variant the API launches, at the canonical
shapes of DESIGN.md (``tools.sass.cases``: the launchers called with meta
tensors, which have shapes and strides but no storage), through the same JIT
argument binder a real launch uses (``tools.sass.capture``), so the
cubins carry the ``tt.divisibility`` specialisation of a GPU launch.

What it reads (``tools.sass.parse``), per kernel: registers, spills (the
local memory ptxas gives the kernel, which is what Triton reports as n_spills
on a GPU, and any LDL / STL on a loop's hot path; the few bytes of call stack
an fp64 division's slow path saves a register in are reported apart), shared
memory, warps; then CTAs per SM and occupancy on an H100 (132 SMs, 64K
registers allocated per warp in units of 256, 228 KB shared memory with 1 KB
reserved per CTA, 2048 threads, 32 CTAs); grid and waves at the canonical
shape. Loops come from the SASS control-flow graph (natural loops of its back
edges, by dominators), each matched to its TTGIR ``scf.for`` for its bound and
step (elements per iteration), and to the runtime ``if`` s around it. Per loop,
on the *hot path* of one iteration (of the paths that do the most work, global
loads and stores, MUFU.EX2 and shared-memory atomics, the one of fewest
instructions: data-dependent branches that skip the work, such as a block of
only -inf, or add a fix-up, such as the rescale when a block raises the running
max, take their common side; the dearest path is recorded too): SASS
instructions per row element per thread, global load / store widths, barriers,
MUFU, fp64 and 64-bit integer (address) operations. A *row loop* is one bounded by the length of a row it
loads; its executions are the passes over the row.

How it predicts one launch (``tools.sass.model.predict``), on an H100
(and an H200: the same SMs with 4.3 TB/s):
- Memory time T_mem = DRAM bytes / copy bandwidth (3.0 TB/s H100, 4.3 TB/s H200:
  the device-to-device copy the benchmarks measure, so mixed reads and writes
  are priced as a copy) + L2 bytes / 7 TB/s. The bytes are a loop's SASS loads
  and stores times the threads and iterations, plus what the TTGIR loads and
  stores outside loops; a repeat pass over a row is an L2 hit for the share of
  the resident CTAs' rows that fits in 3/4 of the 50 MB L2. The predicated
  stores of a compaction (the sampler's candidate list: a case's ``compaction``)
  write at most the list's capacity a row, not one entry per element.
- Issue time T_issue = warp instructions / (4 schedulers x 132 SMs x 1.755 GHz),
  the warp instructions being each loop's hot-path SASS x warps x iterations x
  CTAs plus the straight-line code; a stretch whose quarter-rate instructions
  (MUFU, POPC, FLO, BREV: 16 lanes a cycle an SM) need more counts 8 cycles
  each instead. 1.755 GHz is the clock an H100 sustains under
  a long streaming load (its maximum boost is 1.98 GHz). issue / memory =
  T_issue / T_mem is the headroom figure the budgets gate: a kernel meant to be
  memory-bound needs it well below 1.
- max(T_mem, T_issue) is the bound a kernel approaches only when enough loads
  are in flight; what it reaches is taken from an exact mean-value analysis of a
  closed queueing network per SM: the customers are the CTAs when an iteration
  has a barrier (its warps move in lock step) and the warps otherwise; each
  iteration of a customer passes a delay (DRAM latency 800 cycles, L2 270, plus
  30 cycles per barrier, and what a warp's own dependent chain adds: at least 4
  cycles a SASS, the sm_90 ALU / FMA latency, which costs time only when few
  warps share a scheduler), the SM's issue server (its SASS times its warps over 4
  schedulers; a customer of fewer than 4 warps leaves the rest as delay) and the
  memory server (its bytes over the SM's share of the bandwidth, at most 64 B
  per cycle per SM). This is where latency, occupancy and barriers cost time:
  with few customers, or lock-stepped CTAs, loads are not in flight while the
  schedulers work. CTAs run in waves of the CTAs that fit per SM on the busiest
  SM (so a grid smaller than the GPU uses fewer SMs, each with more of the
  bandwidth, but pays the latency of every iteration); the straight-line code
  around the loops is one more phase with one (loop-free kernels) or two DRAM
  latencies; 2 us of launch and ramp-up per kernel.
- Predicted time = launch + sum over phases; predicted % of copy bandwidth =
  the op's minimum bytes (each input read once, each output written once, as the
  benchmarks count them) / predicted time / copy bandwidth.

Calibration: the first GPU run (an H100 with triton 3.6, sampler only,
bench/gpu/sampler_profile.py) gave the per-warp latency floor and the
quarter-rate unit: with them the model, run with triton 3.6 installed, puts
the split launches of B = 1 and 64 at 0.63-1.67x their measured times (model /
measured: tiles 21.5 / 32.8 us and 457 / 727 us, rows 8.3 / 6.2 and 9.0 / 7.3,
compaction 5.0 / 3.0 and 18.6 / 20.3), where it had put the tiles at 0.23x. Still unmodelled: local-memory
traffic (triton 3.6's spilling histograms ran 3-16x their prediction), and
whatever a run with triton >= 3.8 shows. The clock, the latencies, the L2
bandwidth and per-SM cap and the hot-path rule stay to check. Everything this
module writes is labelled *predicted*.

The CI gate (tests/test_triton_compile.py) holds every kernel to ``gate.BUDGETS``;
``gate.KNOWN_FAILURES`` lists what today's kernels miss, each with the change that
fixes it (issue 14: the sampler).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import model as sm

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "bench" / "results"


def results_path(triton_version: str, directory: Path = RESULTS_DIR) -> Path:
    """The predictions file of a Triton version in ``directory``: one per version
    (tools/sass/tritons.sh), since the versions lower the kernels differently."""
    return directory / f"sm90-predicted-triton-{triton_version}.json"


LABEL = "predicted by the static sm_90 model (tools.sass), not measured"
# What the predictions are a function of (besides the Triton that compiles): the kernels' code and
# what they import from fastrl, and the model's own. ``source_hash`` digests them.
PREDICTION_SOURCES = ("kernels", "fastrl/_rows.py", "tools/sass")
# What the CI gate holds the predictions to, not what they are: left out of ``source_hash``.
GATE_SOURCE = "tools/sass/gate.py"


def _code_shape(node) -> str:
    """A syntax tree as text, the same under every Python from 3.11 on: fields holding None or
    nothing are left out (3.13's ast.dump leaves them out, 3.11's shows them), and so are
    3.12's type_params; no line numbers."""
    if isinstance(node, ast.AST):
        fields = ",".join(f"{name}={_code_shape(value)}" for name, value in ast.iter_fields(node)
                          if value is not None and value != [] and name != "type_params")  # fmt: skip
        return f"{type(node).__name__}({fields})"
    if isinstance(node, list):
        return "[" + ",".join(_code_shape(item) for item in node) + "]"
    return repr(node)


def source_hash() -> str:
    """sha256 of PREDICTION_SOURCES' code: each module's syntax tree without its docstrings, so
    that a comment, a docstring or a moved line leaves it unchanged and a code change does not.
    A committed predictions file records it; tests/test_bench.py fails when it is stale."""
    digest = hashlib.sha256()
    paths = sorted(p for name in PREDICTION_SOURCES for p in ((ROOT / name).rglob("*.py") if (ROOT / name).is_dir()
                                                              else [ROOT / name]) if p != ROOT / GATE_SOURCE)  # fmt: skip
    for path in paths:
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                    and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):  # fmt: skip
                node.body = body[1:]
        digest.update(f"{path.relative_to(ROOT).as_posix()}\n{_code_shape(tree)}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Running the model


@dataclasses.dataclass
class Launch:
    """A canonical launch: which kernel analysis, its grid and loop runs."""

    case: str
    op: str
    shape: tuple
    dtype: str
    role: str
    kernel: sm.KernelAnalysis
    variant: str
    grid: int
    runs: list[sm.LoopRun]
    min_bytes: int


def _tensor_bytes(value) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return 0


def _guarded_by(fragment: str, guard: str) -> bool:
    """Whether a loop guard (LoopInfo.guards) is the branch a case's fragment
    names: "if p_on" the then-branch of the if on that line, "else: ..." the
    else-branch of one."""
    return fragment in guard and guard.startswith(sm.ELSE) == fragment.startswith(sm.ELSE)


def _loop_runs(k: sm.KernelAnalysis, bound: dict, untaken: tuple[str, ...], grid: int,
               compaction: tuple[str, str] | None = None) -> list[sm.LoopRun]:  # fmt: skip
    import torch

    runs, seen_args = [], set()
    resident = min(grid, sm.H100.sms * max(sm.occupancy(k, sm.H100)["ctas_per_sm"], 1))
    for loop in k.loops:
        executed = not any(_guarded_by(frag, guard) for guard in loop.guards for frag in untaken)
        upper = bound.get(loop.upper) if loop.upper else loop.upper_const
        if not isinstance(upper, int) or loop.step is None:
            # A bound computed in the kernel (the sampler's candidate list): one
            # trip, not a pass over a row.
            runs.append(sm.LoopRun(loop, 1, 1.0, False, 0.0, executed))
            continue
        span = upper - (loop.lower or 0)
        if loop.whole_tiles:  # over the whole tiles of loop.tile, loop.step / loop.tile of them an iteration
            tile = loop.tile or loop.step
            trips = max(0, -(-(upper - upper % tile - (loop.lower or 0)) // loop.step))
        else:
            trips = max(0, math.ceil(span / loop.step))
        rows = [bound[a] for a in loop.load_args if isinstance(bound.get(a), torch.Tensor)]
        row = any(t.dim() >= 1 and t.shape[-1] == upper for t in rows)
        cached = 0.0
        if row and executed and set(loop.load_args) <= seen_args:
            row_bytes = sum(t.shape[-1] * t.element_size() for t in rows)
            cached = min(1.0, 0.75 * sm.H100.l2_bytes / max(resident * row_bytes, 1))
        if row and executed:
            seen_args |= set(loop.load_args)
        store_share = 1.0
        if compaction and span and any(_guarded_by(compaction[0], guard) for guard in loop.guards):
            store_share = min(1.0, bound[compaction[1]] / span)
        runs.append(sm.LoopRun(loop, trips, loop.step / k.threads, row, cached, executed, span, store_share))
    return runs


def main_loop(runs: list[sm.LoopRun]) -> sm.LoopRun | None:
    """The executed row loop that handles the most elements (the first such)."""
    rows = [r for r in runs if r.executed and r.row and r.trips > 0]
    if not rows:
        rows = [r for r in runs if r.executed and r.trips > 0]
    return max(rows, key=lambda r: (r.trips * r.elements_per_thread, r.loop.hot["sass"]), default=None)


def launch_row(launch: Launch) -> dict:
    """Everything the table and the gates need about one launch (all predicted)."""
    k = launch.kernel
    main = main_loop(launch.runs)
    hot = main.loop.hot if main else k.straight
    # per element of the data its main loop streams; none for a loop of less than
    # an element a thread a trip (a program's walk over per-row or per-tile records)
    per_elem = hot["sass"] / main.elements_per_thread if main and main.elements_per_thread >= 1 else None
    row_runs = [r for r in launch.runs if r.executed and r.row and r.trips > 0]
    passes = len(row_runs)
    if row_runs:  # every pass over a row (the gate wants 128 bits on each)
        float_bits = [b for r in row_runs for b in r.loop.float_load_bits]
        per_elem_max = max(r.loop.hot["sass"] / r.elements_per_thread for r in row_runs)
    else:  # a loop-free kernel (elementwise): its body is its one pass
        float_bits = main.loop.float_load_bits if main else k.straight_float_load_bits
        per_elem_max = per_elem
    straight_latencies = 2 if any(r.executed and r.trips > 0 for r in launch.runs) else 1
    predicted = {}
    for name, dev in sm.DEVICES.items():
        p = sm.predict(_with_edges(k, launch.runs), launch.runs, launch.grid, dev, straight_latencies)
        p["copy_pct"] = 100 * launch.min_bytes / p["time_s"] / dev.copy_bw
        predicted[name] = p
    h = predicted["H100"]
    return {
        "case": launch.case, "op": launch.op, "shape": list(launch.shape), "dtype": launch.dtype, "role": launch.role,
        "kernel": k.name, "variant": launch.variant, "registers": k.regs,
        "spill_bytes": k.local, "spill_instructions": k.spill_instrs, "stack_bytes": k.stack, "shared_bytes": k.shared,
        "warps": k.num_warps,
        "ctas_per_sm": h["ctas_per_sm"], "occupancy": h["occupancy"], "occupancy_limiter": h["occupancy_limiter"],
        "grid": launch.grid, "active_sms": h["active_sms"], "waves": h["waves"], "passes": passes,
        "main_loop": None if main is None else {
            "source": f"{Path(main.loop.source[0]).name}:{main.loop.source[1]}" if main.loop.source else None,
            "text": main.loop.text, "trips": main.trips, "elements_per_thread": main.elements_per_thread,
            "sass": hot["sass"], "sass_longest_path": main.loop.longest_sass, "ldg": hot["ldg"], "stg": hot["stg"],
            "barriers": hot["barriers"], "mufu": hot["mufu"], "fp64": hot["fp64"], "int64": hot["int64"],
        },
        "float_load_bits": sorted(set(float_bits)), "sass_per_element": per_elem, "sass_per_element_max": per_elem_max,
        "loops": [{
            "source": f"{Path(r.loop.source[0]).name}:{r.loop.source[1]}" if r.loop.source else None,
            "trips": r.trips, "executed": r.executed, "row": r.row, "l2_share": round(r.cached, 3),
            "sass": r.loop.hot["sass"], "elements_per_thread": r.elements_per_thread,
            "barriers": r.loop.hot["barriers"], "ldg": r.loop.hot["ldg"], "mapped": r.loop.mapped,
            **({"store_share": round(r.store_share, 4)} if r.store_share < 1 else {}),
        } for r in launch.runs],
        "min_bytes": launch.min_bytes, "notes": k.notes,
        "predicted": {n: _rounded(p) for n, p in predicted.items()},
    }  # fmt: skip


def _with_edges(k: sm.KernelAnalysis, runs: list[sm.LoopRun]) -> sm.KernelAnalysis:
    """k with its edge tiles' bytes in its straight-line bytes: each row argument's
    remainder after the whole tiles, V % step elements (the loop's trips times its
    step are the rest)."""
    if not k.edge_bytes_per_element:
        return k
    tiled = [r for r in runs if r.loop.whole_tiles and r.loop.step and r.executed]
    if not tiled:
        return k
    run = max(tiled, key=lambda r: r.trips)
    remainder = run.span - run.trips * run.loop.step
    edge = sum(remainder * b for b in k.edge_bytes_per_element.values())
    return dataclasses.replace(k, straight_bytes=k.straight_bytes + edge)


def _rounded(p: dict) -> dict:
    out = {}
    for key, value in p.items():
        if isinstance(value, float):
            out[key] = float(f"{value:.4g}")
        else:
            out[key] = value
    return out


def capture_triton(progress: Callable[[str], None]) -> tuple[list, list]:
    """(canonical launches with their case, coverage launches), captured."""
    from . import capture as cap
    from . import cases

    canonical = []
    with cap.recording() as sink:
        for case in cases.cases():
            start = len(sink)
            case.run()
            made = sink[start:]
            if len(made) != len(case.roles):
                raise RuntimeError(f"{case.id}: {len(made)} launches, declared {case.roles}")
            canonical += [(case, r, launch) for r, launch in zip(case.roles, made)]
        start = len(sink)
        cases.coverage()
        coverage = sink[start:]
    progress(f"captured {len(canonical)} canonical launches and {len(coverage)} coverage launches")
    return canonical, coverage


def run_model(archs: tuple[int, ...] = (90, 80), workers: int | None = None,
              progress: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Compiles, analyses and predicts everything; the results file's payload."""
    from . import capture as cap

    os.environ.pop("TRITON_INTERPRET", None)
    t0 = time.time()
    canonical, coverage = capture_triton(progress)
    variants: dict[tuple[str, int], cap.Variant] = {}
    launches = []
    for case, role, launch in canonical:
        v = cap.bind(launch, 90)
        variants.setdefault((v.key(), 90), v)
        launches.append((case, role, launch, v))
    for launch in coverage:
        v = cap.bind(launch, 90)
        variants.setdefault((v.key(), 90), v)
    for arch in archs:
        if arch == 90:
            continue
        for launch in [*(c[2] for c in canonical), *coverage]:
            v = cap.bind(launch, arch)
            variants.setdefault((v.key(), arch), v)
    jobs = [(v, arch) for (key, arch), v in variants.items()]
    progress(f"compiling {len(jobs)} kernel variants ({len({v.key() for v, a in jobs if a == 90})} for sm_90)")
    compiled = cap.compile_all(jobs, workers or cap.default_workers(), progress)
    failures = [f"{v.name} [{v.describe()}] sm_{a}: {r}" for (v, a), r in zip(jobs, compiled) if isinstance(r, str)]
    by_key = {(v.key(), a): r for (v, a), r in zip(jobs, compiled)}

    analyses: dict[str, sm.KernelAnalysis] = {}
    rows = []
    for case, role, launch, v in launches:
        result = by_key[(v.key(), 90)]
        if isinstance(result, str):
            continue
        if v.key() not in analyses:
            params = [n for n in v.fn.arg_names if v.signature.get(n) != "constexpr"]
            analyses[v.key()] = sm.analyse_triton(result, 90, params)
        k = analyses[v.key()]
        grid = math.prod(launch.grid)
        runs = _loop_runs(k, v.bound, case.untaken, grid, case.compaction)
        reads = {id(v.bound[a]): _tensor_bytes(v.bound[a]) for a in k.loads if _tensor_bytes(v.bound.get(a))}
        writes = {id(v.bound[a]): _tensor_bytes(v.bound[a]) for a in k.stores if _tensor_bytes(v.bound.get(a))}
        dtype = str(case.dtype).replace("torch.", "")
        row = launch_row(Launch(case.id, case.op, case.shape, dtype, role, k, v.describe(), grid, runs,
                                sum(reads.values()) + sum(writes.values())))  # fmt: skip
        row["_reads"], row["_writes"] = reads, writes
        rows.append(row)
    variants_out = []
    from . import parse as sp

    for (v, arch), result in zip(jobs, compiled):
        if isinstance(result, str):
            variants_out.append({"kernel": v.name, "variant": v.describe(), "arch": f"sm_{arch}",
                                 "error": result[-2000:]})  # fmt: skip
            continue
        usage = next(iter(sp.resource_usage(result["cubin"]).values()))
        variants_out.append({
            "kernel": v.name, "variant": v.describe(), "row_dtype": _row_dtype(v), "arch": f"sm_{arch}",
            "registers": usage.get("REG", 0), "spill_bytes": usage.get("LOCAL", 0),
            "stack_bytes": usage.get("STACK", 0), "shared_bytes": result["shared"],
            "warps": result["num_warps"],
        })  # fmt: skip
    payload = {
        "kind": "predicted",
        "label": LABEL,
        "device": "H100 SXM / H200 SXM (sm_90)",
        "device_type": "predicted",
        # The measured files' fields, so tools that read every results file read this
        # one too: no measured rows, the H100 copy bandwidth the model assumes.
        "rows": [],
        "copy_bandwidth_gbps": sm.H100.copy_bw / 1e9,
        "model": {name: dataclasses.asdict(dev) for name, dev in sm.DEVICES.items()},
        "triton": _version("triton"),
        "source_hash": source_hash(),
        "commit": _commit(),
        "date": datetime.date.today().isoformat(),
        "ops": op_rows(rows),
        "launches": [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows],
        "variants": sorted(variants_out, key=lambda r: (r["kernel"], r["arch"], r["variant"])),
        "compile_failures": failures,
        "triton_kernels": triton_kernel_names(),
        "launched": sorted({v.name for v, _ in jobs}),
        # Triton 3.9 warns at a launch that leaves the contraction to its default,
        # which 3.10 turns off: every launcher names it (_launch.CONTRACTED).
        "fusion_unnamed": sorted({launch.fn.__name__ for launch in [*(c[2] for c in canonical), *coverage]
                                  if "enable_fp_fusion" not in launch.kwargs}),  # fmt: skip
    }
    progress(f"model done in {time.time() - t0:.0f} s")
    return payload


def _row_dtype(v) -> str:
    first = next((t for n, t in v.signature.items() if isinstance(t, str) and t.startswith("*")), "")
    return first.lstrip("*")


def bench_min_bytes(op: str, shape: list[int], dtype: str) -> int | None:
    """The minimum bytes the benchmark harness (``bench``) counts for the ops it
    measures (so that a predicted and a measured share of the copy bandwidth
    have one basis)."""
    import torch

    from bench.logprobs import _min_bytes

    e = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    if op.startswith("logprobs") and len(shape) == 2:
        return _min_bytes(op, shape[0], shape[1], getattr(torch, dtype))
    if op == "full_kl fwd":  # bench.kl: 2*N*V*e + 4N
        return 2 * shape[0] * shape[1] * e + 4 * shape[0]
    if op == "full_kl fwd+bwd":  # 5*N*V*e + 8N
        return 5 * shape[0] * shape[1] * e + 8 * shape[0]
    if op.startswith("sample "):  # bench.sampling: B*V*e + 16B
        return shape[0] * shape[1] * e + 16 * shape[0]
    if op == "policy_loss fwd+bwd":  # bench.policy: T*(4*4+1) + 4T
        return 21 * shape[0] * shape[1]
    return None


def op_rows(rows: list[dict]) -> list[dict]:
    """Per case (op, shape, dtype): the sum of its launches. Its
    minimum bytes are the benchmark's for the ops it measures, else each input
    of the op read once and each output written once (a tensor one launch
    writes and a later one reads is not an input)."""
    out: dict[tuple, dict] = {}
    seen: dict[tuple, tuple[dict, dict]] = {}
    for r in rows:
        key = r["case"]
        op = out.setdefault(key, {"case": r["case"], "op": r["op"], "shape": r["shape"], "dtype": r["dtype"],
                                  "kernels": [], "min_bytes": 0, "predicted": {}})  # fmt: skip
        op["kernels"].append(r["role"])
        inputs, outputs = seen.setdefault(key, ({}, {}))
        for t, b in r.get("_reads", {}).items():
            if t not in outputs:
                inputs[t] = b
        outputs.update(r.get("_writes", {}))
        if "_reads" not in r:
            op["min_bytes"] += r["min_bytes"]
        for dev, p in r["predicted"].items():
            acc = op["predicted"].setdefault(dev, {"time_s": 0.0, "bounds": []})
            acc["time_s"] += p["time_s"]
            acc["bounds"].append(p["bound"])
    for key, op in out.items():
        inputs, outputs = seen[key]
        op["min_bytes"] += sum(inputs.values()) + sum(outputs.values())
        op["min_bytes"] = bench_min_bytes(op["op"], op["shape"], op["dtype"]) or op["min_bytes"]
        for dev, acc in op["predicted"].items():
            bw = sm.DEVICES[dev].copy_bw
            acc["copy_pct"] = float(f"{100 * op['min_bytes'] / acc['time_s'] / bw:.4g}")
            acc["time_s"] = float(f"{acc['time_s']:.4g}")
    return list(out.values())


def triton_kernel_names() -> list[str]:
    """Every kernel of fastrl.kernels (a @triton.jit function named *_kernel)."""
    import importlib
    import pkgutil

    import fastrl.kernels
    from triton.runtime.jit import JITFunction

    kinds: tuple[type, ...] = (JITFunction,)
    try:  # what @triton.jit makes under TRITON_INTERPRET=1
        from triton.runtime.interpreter import InterpretedFunction

        kinds += (InterpretedFunction,)
    except ImportError:
        pass
    names = set()
    for info in pkgutil.iter_modules(fastrl.kernels.__path__):
        module = importlib.import_module(f"fastrl.kernels.{info.name}")
        names |= {n for n, obj in vars(module).items() if isinstance(obj, kinds) and n.endswith("_kernel")}
    return sorted(names)


def spills(payload: dict) -> dict[str, list[str]]:
    """Per kernel: what spills, in any compiled variant and arch: local memory
    (Triton's n_spills), or local memory traffic on a loop's hot path."""
    out: dict[str, list[str]] = {}
    for v in payload["variants"]:
        found = out.setdefault(v["kernel"], [])
        if v.get("spill_bytes"):
            found.append(f"{v['kernel']} {v['arch']} [{v['variant']}]: {v['spill_bytes']} bytes of local memory")
    for r in payload["launches"]:
        if r["spill_instructions"]:
            out.setdefault(r["kernel"], []).append(f"{r['case']}: {r['spill_instructions']} LDL/STL per loop iteration")
    return out


# ---------------------------------------------------------------------------
# Output


def dumps(payload: dict) -> str:
    """The results file: one line per launch, op and variant, so that a kernel
    change shows as a readable diff."""
    parts = []
    for key, value in payload.items():
        if isinstance(value, list) and value and isinstance(value[0], dict):
            body = ",\n".join(f"  {json.dumps(item)}" for item in value)
            parts.append(f" {json.dumps(key)}: [\n{body}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=ROOT).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sass", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="90,80", help="comma-separated SM versions to compile for (default 90,80)")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: up to 4)")
    parser.add_argument(
        "--json", type=Path, default=None,
        help=f"results file (default {results_path('<installed triton>').relative_to(ROOT)})",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    archs = tuple(int(a) for a in args.arch.split(","))
    if 90 not in archs:
        parser.error("the model is of sm_90: --arch must include 90")
    progress = (lambda msg: None) if args.quiet else (lambda msg: print(msg, flush=True))
    payload = run_model(archs, args.jobs, progress)
    args.json = args.json or results_path(payload["triton"])
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(dumps(payload))
    if not args.quiet:
        print(f"\nAll figures {LABEL}.\n")
        from bench.report import launch_table

        print(launch_table(payload))
        print(f"\nwrote {args.json}")
    for failure in payload["compile_failures"]:
        print(f"FAILED to compile: {failure}", file=sys.stderr)
    return 1 if payload["compile_failures"] else 0
