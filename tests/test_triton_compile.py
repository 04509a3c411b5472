"""Every Triton kernel compiles for sm_90 (H100 / H200), and every kernel is held
to its budgets in the static sm_90 performance model, checked without a GPU.

CI runs the kernels through the Triton interpreter, which executes Python and
does not apply the compiler's rules. ``python -m tools.sass`` (run once
here, in a fresh process, for the whole module) captures every launch of every
launcher at the canonical shapes, binds it with Triton's own JIT binder (so the
cubin has a real launch's divisibility specialisation), compiles it with
Triton's ptxas, reads the SASS and predicts each launch's time
(tools/sass/__init__.py states the model). The tests then check, per kernel and
case, the budgets of ``tools.sass.gate.BUDGETS`` / ``OP_BUDGETS``: no spills,
128-bit loads on every pass over a bf16 / fp32 row, a predicted issue / memory
ratio within budget for memory-bound kernels, a grid that occupies at least
half the SMs, passes over the row, and the predicted share of the copy
bandwidth of the log-prob and KL ops. What today's kernels miss is listed in
``tools.sass.gate.KNOWN_FAILURES`` with the change that fixes it (a kernel
that spills today: ``tools.sass.gate.KNOWN_SPILLS``), and marked
xfail(strict=True) here: fixing the kernel makes that test XPASS, which fails
until its entry is removed. On a machine with a GPU the kernels are compiled
for real by the other tests and this module is skipped. Triton's cache makes a
second run of the model take seconds.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from tools import sass  # noqa: E402
from tools.sass import gate as budgets  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile every kernel for this GPU")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> dict:
    """The model's results for this checkout (sm_90), computed once a test run:
    pytest-xdist's workers (make test) each run this module's fixture, and the
    first to take the lock computes the model (6 minutes from a cold Triton
    cache) into the run's shared temporary folder while the others wait and
    read it. (--dist loadgroup would keep the module on one worker, but
    pytest-xdist 3.8 under pytest 9.2 ignores xdist_group: pytest-xdist#1386.)"""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this run's, never an older run's
    out = shared / "sm90-predicted.json"
    with open(shared / "sm90-predicted.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            partial = shared / "sm90-predicted.partial.json"
            result = subprocess.run(
                [sys.executable, "-m", "tools.sass", "--arch", "90", "--json", str(partial)],
                capture_output=True, text=True, env=env, timeout=1800, cwd=ROOT,
            )  # fmt: skip
            assert partial.exists(), result.stdout[-4000:] + result.stderr[-4000:]
            partial.rename(out)
    return json.loads(out.read_text())


def test_every_triton_kernel_compiles_for_the_target_gpus(model):
    assert not model["compile_failures"], "\n".join(model["compile_failures"])
    assert "_policy_fwd_kernel" in model["launched"]
    missed = set(model["triton_kernels"]) - set(model["launched"])
    assert not missed, f"never launched by tools.sass.cases: {sorted(missed)}"
    assert not model["fusion_unnamed"], f"launched without enable_fp_fusion: {model['fusion_unnamed']}"


def test_the_capture_specialises_like_a_real_launch(model):
    """A 16-byte aligned bf16 row read through the JIT binder loads 128 bits at a
    time (without the divisibility attributes it would load 16); the loop over
    the whole tiles of its eight segments of 18992 (tiles of 2 x 16 lanes x 8,
    two an iteration: 18992 // 256 = 74 of them, an even count) runs 37 times
    (each segment's partial tile after it)."""
    row = next(r for r in model["launches"] if r["case"] == "logprobs fwd [16384x151936 bfloat16]")
    assert row["main_loop"]["ldg"] == {"128": 4}, row["main_loop"]
    assert row["grid"] == 16384 and row["main_loop"]["trips"] == 37


def test_the_model_counts_every_loop(model):
    """Each SASS loop of a canonical Triton launch is matched to its TTGIR loop, so
    its trip count and elements per iteration are known, not guessed."""
    unmapped = [f"{r['case']} {r['kernel']} loop at {loop['source']}" for r in model["launches"]
                for loop in r["loops"] if not loop["mapped"]]  # fmt: skip
    assert not unmapped, "\n".join(unmapped)


def test_every_figure_is_labelled_a_prediction(model):
    assert model["kind"] == "predicted" and "not measured" in model["label"]
    assert not model["rows"], "a predictions file holds no measured rows"
    for op in model["ops"]:
        for dev, p in op["predicted"].items():
            assert p["time_s"] > 0 and 0 < p["copy_pct"] < 100 * 1.05, (op["case"], dev, p)


@pytest.mark.parametrize("kernel", [
    pytest.param(name, marks=[pytest.mark.xfail(strict=True, reason=budgets.KNOWN_SPILLS[name])]
                 if name in budgets.KNOWN_SPILLS else [])
    for name in sass.triton_kernel_names()
])  # fmt: skip
def test_no_kernel_spills(model, kernel):
    spilled = sass.spills(model).get(kernel)
    assert spilled is not None, f"{kernel}: not compiled"
    assert not spilled, "\n".join(spilled)


def _gate_params() -> list:
    params = []
    for case, role, gate in budgets.gate_items():
        reason = budgets.known_failure(case, role, gate)
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        name = f"{case} {role if role != '*' else 'op'} {gate}"
        params.append(pytest.param(case, role, gate, marks=marks, id=name))
    return params


@pytest.mark.parametrize("case, role, gate", _gate_params())
def test_budget(model, case, role, gate):
    ok, found = budgets.check(model, case, role, gate)
    assert ok, f"{found} ({budgets.BUDGETS.get(role, budgets.Budget()).why or 'issue 13'})"
