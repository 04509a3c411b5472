"""``python -m bench``: run the benchmark suite on the local device.

Prints a table and writes ``bench/results/<device>.json`` (or ``--results-dir DIR``'s, or ``--json PATH``;
with ``--merge``, keeping that file's rows of the cases not run now), and with
``--plot DIR`` one PNG per op.
``--plan quick`` times the quick GPU plan's cases instead (bench/quick.py; with
``--dry-run``, its plumbing on the CPU at tiny shapes). On an H100 or H200 (and
in the dry run) each measured fastrl row carries the static sm_90 model's
prediction of its case for the installed Triton, labelled as a prediction. The
results file is rewritten after every case, so that a run cut short leaves the
rows it measured (marked incomplete).

Exits non-zero if fastrl's result on a benchmark input is off the reference, or,
with ``--check-speed`` / ``--check-speed-compiled``, if fastrl is slower than
the torch reference / ``torch.compile`` of it in the same run (a ratio, with a
margin; a ratio that falls short is measured again before it fails the run).

On a CPU, ``--cpu-isa x86-64-v3`` (or ``x86-64``) runs the whole suite as on a
CPU of that level: fastrl's native kernels (``FASTRL_CPU_ISA``), torch's own
kernels (``ATEN_CPU_CAPABILITY``) and Inductor's generated code
(``torch._inductor.config.cpp.simdlen``) all at that vector width. The results
file is named by the level (``bench/results/cpu-x86-64-v3.json``) and records it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import bench

from . import (
    COMPILED,
    CPU_LEVELS,
    copy_bandwidth,
    device_slug,
    environment,
    merge_refusal,
    merge_rows,
    print_table,
    quick,
    remeasure_ratio,
    row_key,
    run_cases,
    write_json,
)
from . import kl as kl_cases
from . import linear as linear_cases
from . import logprobs as logprobs_cases
from . import policy as policy_cases
from . import sampling as sampling_cases

OPS = {"logprobs": logprobs_cases, "sampling": sampling_cases, "policy": policy_cases, "kl": kl_cases,
       "linear": linear_cases}  # fmt: skip
MAX_REFERENCE_ERROR = 1e-4


def _parse_shape(text: str) -> tuple[int, int, torch.dtype]:
    """``N,V,dtype`` such as ``2048,32000,float32``."""
    n, v, dtype = text.split(",")
    return int(n), int(v), getattr(torch, dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=sorted(OPS), action="append", help="op family (default: all)")
    parser.add_argument("--shape", type=_parse_shape, action="append", help="N,V,dtype (repeatable; N = rows or batch)")
    parser.add_argument("--quick", action="store_true", help="small shapes, few repetitions (CI)")
    parser.add_argument("--plan", choices=("quick",), default=None,
                        help="the quick GPU plan's cases (bench/quick.py) instead of --op / --shape")
    parser.add_argument("--dry-run", action="store_true",
                        help="with --plan: its plumbing on the CPU at tiny shapes (tests/test_gpu_plan.py)")  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per row")
    parser.add_argument("--json", type=Path, default=None, help="results file (default RESULTS_DIR/<device>.json)")
    parser.add_argument("--results-dir", type=Path, default=Path("bench/results"),
                        help="where the results file goes when --json is not given (default bench/results, the "
                             "committed results: `make bench` passes build/bench)")  # fmt: skip
    parser.add_argument("--plot", type=Path, default=None, metavar="DIR", help="write one PNG per op into DIR")
    parser.add_argument("--merge", action="store_true",
                        help="keep the results file's rows of the cases (op, shape, dtype) not run now (same device, "
                        "commit and torch)")  # fmt: skip
    parser.add_argument("--check-speed", type=float, default=None, metavar="MARGIN",
                        help="fail if fastrl is not faster than the torch reference by this factor")
    parser.add_argument("--check-speed-compiled", type=float, default=None, metavar="MARGIN",
                        help="fail if fastrl is not faster than torch.compile of the reference by this factor "
                             "(compiles the reference in --quick runs too)")  # fmt: skip
    parser.add_argument("--cpu-isa", choices=sorted(CPU_LEVELS), default=None,
                        help="run fastrl's native kernels, torch's kernels and Inductor's code at this x86-64 level "
                             "(restarts the run with FASTRL_CPU_ISA and ATEN_CPU_CAPABILITY set)")  # fmt: skip
    parser.add_argument("--check-speed-avx2", type=float, default=None, metavar="MARGIN",
                        help="the --check-speed margin on a CPU whose native kernels run their AVX2 (x86-64-v3) "
                             "clone, where its lead over torch is still slim (issue 18); default: --check-speed")  # fmt: skip
    args = parser.parse_args(argv)
    if args.dry_run and args.plan is None:
        parser.error("--dry-run runs a --plan")
    if args.cpu_isa is not None:
        _run_at_cpu_level(args.cpu_isa, sys.argv[1:] if argv is None else argv)
    _inductor_at_native_level()

    device = torch.device("cpu" if args.dry_run else args.device)
    reps = args.reps or (2 if args.dry_run else quick.REPS if args.plan else 5 if args.quick or device.type == "cpu" else 20)
    # Whether --merge can merge, before any case is made: making them imports the peers (25 s on a GPU machine)
    env = environment(device)
    out = args.json or args.results_dir / f"{device_slug(device)}.json"
    previous = json.loads(out.read_text()) if args.merge and out.exists() else None
    if previous is not None and (why := merge_refusal(previous, env)) is not None:
        print(f"--merge: cannot merge into {out}: {why}", file=sys.stderr)
        return 2
    canonical = {}  # a case's key -> the key of the case whose prediction it carries (the dry run's stand-ins)
    if args.plan is not None:
        planned = quick.cases(device, dry=args.dry_run)
        cases = [case for case, _ in planned]
        canonical = {case.key(): key for case, key in planned}
    else:
        bench.COMPILED_IN_QUICK = args.check_speed_compiled is not None  # read as the cases are made
        try:
            cases = [c for op in (args.op or OPS) for c in OPS[op].cases(device, quick=args.quick, shapes=args.shape)]
        finally:
            bench.COMPILED_IN_QUICK = False
    if args.plan is not None:
        env["plan"] = args.plan + (" (dry run: tiny stand-ins on the CPU for the plan's GPU cases)" if args.dry_run else "")
        env["plan_cases"] = [[op, list(shape), dtype] for _, (op, shape, dtype) in planned]
        # beside the stages' times in the session's log, to correct the estimate by
        print(quick.format_estimate(quick.estimate("H100"), "H100"), flush=True)
    gpu = "H100" if args.dry_run else quick.model_of(env["device"]) if device.type == "cuda" else None
    predicted = quick.predictions(env["triton"]) if gpu else None
    copy_bps = copy_bandwidth(device)
    print(f"fastrl bench on {env['device']} (torch {env['torch']}, triton {env['triton']}); "
          f"copy bandwidth {copy_bps / 1e9:.1f} GB/s", flush=True)  # fmt: skip

    total = sum(len(c.impls) for c in cases)
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="benchmarking", unit="row", file=sys.stderr)
        progress, close = (lambda: bar.update(1)), bar.close
    except ImportError:
        done = [0]

        def progress():
            done[0] += 1
            print(f"\r{done[0]}/{total} rows", end="", file=sys.stderr, flush=True)

        close = lambda: print(file=sys.stderr)  # noqa: E731
    copy_gbps = copy_bps / 1e9
    measured_rows = []
    for done, case in enumerate(cases, 1):
        measured_rows += run_cases([case], device, reps=reps, progress=progress)
        if predicted is not None:
            quick.attach_predictions(measured_rows, predicted, gpu, canonical)
        rows = measured_rows if previous is None else merge_rows(previous, measured_rows)
        progress_note = {} if done == len(cases) else {"incomplete": f"{done} of {len(cases)} cases measured"}
        payload = write_json(out, {**env, **progress_note}, copy_gbps, rows)
    close()

    print_table(measured_rows, copy_gbps)
    print(f"wrote {out}")
    if args.plot is not None:
        from .plots import write_plots

        for path in write_plots(payload, args.plot):
            print(f"wrote {path}")

    failures = []
    for r in measured_rows:
        err = r.get("max_err_vs_reference")
        if err is not None and not err <= MAX_REFERENCE_ERROR:
            failures.append(f"{r['op']} {r['shape']}: fastrl differs from the reference by {err:.3g}")
    case_of = {c.key(): c for c in cases if not c.sweep}
    gates = []  # (whether a row is checked, margin)
    if args.check_speed is not None:
        gates.append((lambda r: r["impl"].startswith("torch eager"), _speed_margin(args, device)))
    if args.check_speed_compiled is not None:
        gates.append((lambda r: r["impl"] == COMPILED and case_of[row_key(r)].compiled_gate, args.check_speed_compiled))
    for gated, margin in gates:
        for r in measured_rows:
            checked = not r.get("sweep") and "fastrl_speedup" in r and gated(r)
            if not checked or r["fastrl_speedup"] >= margin:
                continue
            what = f"{r['op']} {r['shape']} {r['dtype']} against {r['impl']}"
            ratio = remeasure_ratio(case_of[row_key(r)], r["impl"], device, reps=reps)
            print(f"re-measured {what}: {r['fastrl_speedup']:.2f}x, then {ratio:.2f}x", file=sys.stderr)
            if ratio < margin:
                failures.append(f"{what}: fastrl is {ratio:.2f}x {r['impl']}, below the required {margin:.2f}x")
    if args.plan is not None:
        print(quick.summary(measured_rows, copy_gbps, on_the_gpu=not args.dry_run))
    for f in failures:
        print(f"FAIL: {f}", file=sys.stderr)
    return 1 if failures else 0


def _run_at_cpu_level(level: str, argv: list[str]) -> None:
    """Restarts this run with the native kernels and torch's kernels at ``level``
    (both read their setting when they load); returns where they already are."""
    aten, _ = CPU_LEVELS[level]
    want = {"FASTRL_CPU_ISA": level, "ATEN_CPU_CAPABILITY": aten}
    if all(os.environ.get(k) == v for k, v in want.items()):
        return
    env = {**os.environ, **want}
    os.execve(sys.executable, [sys.executable, "-m", "bench", *argv], env)


def _inductor_at_native_level() -> None:
    """Inductor's vector width to the native kernels' level when FASTRL_CPU_ISA
    forces one (else Inductor picks the CPU's best). Set alone, ATEN_CPU_CAPABILITY
    does not reach Inductor, whose code then mixes both levels: torch 2.13 gave a
    wrong policy loss that way (0.0 and a gradient of 1e28)."""
    level = os.environ.get("FASTRL_CPU_ISA")
    if level in CPU_LEVELS:
        from torch._inductor import config

        config.cpp.simdlen = CPU_LEVELS[level][1]


def _speed_margin(args, device: torch.device) -> float:
    """The speed-up --check-speed requires here: --check-speed-avx2 on a CPU whose
    native kernels run their AVX2 (x86-64-v3) clone, whose lead over torch is
    still slim there (issue 18; the Makefile says how slim), --check-speed
    everywhere else."""
    from fastrl._backend import native_module

    native = native_module()
    isa = native.build_info()["cpu_isa"] if native is not None else ""
    if device.type == "cpu" and args.check_speed_avx2 is not None and isa.startswith("x86-64-v3"):
        print(f"speed check: native kernels run {isa}; requiring {args.check_speed_avx2:.2f}x (issue 18)",
              file=sys.stderr)  # fmt: skip
        return args.check_speed_avx2
    return args.check_speed


if __name__ == "__main__":
    sys.exit(main())
