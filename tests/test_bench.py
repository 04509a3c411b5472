"""The benchmark harness: its measurements, its families' cases, the plots, and
the README performance section generated from the recorded results."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import bench
from bench import __main__ as bench_main
from bench import report
from bench.plots import write_plots

ROOT = Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


def test_readme_performance_section_is_generated_from_the_recorded_results():
    readme = (ROOT / "README.md").read_text()
    assert readme == report.updated(readme, report.render(ROOT / "bench" / "results")), (
        "README's performance section is out of date: run python -m bench.report"
    )


def test_the_committed_predictions_are_of_the_code_in_the_tree():
    """Each committed predictions file records the source_hash of the code it predicts (tools.sass:
    the kernels' and the model's code, comments and docstrings aside): a kernel or model change
    committed without new predictions fails here, under CI's own Python and without a Triton run."""
    from tools import sass

    predicted = sorted((ROOT / "bench" / "results").glob("sm90-predicted*.json"))
    # one file for each Triton tools/sass/tritons.sh runs, and no other
    versions = re.search(r"ALL_VERSIONS=\(([^)]*)\)", (ROOT / "tools" / "sass" / "tritons.sh").read_text()).group(1)
    assert [p.name for p in predicted] == sorted(f"sm90-predicted-triton-{v}.json" for v in versions.split())
    for path in predicted:
        payload = json.loads(path.read_text())
        assert path == sass.results_path(payload["triton"])
        assert payload.get("source_hash") == sass.source_hash(), (
            f"{path.name} predicts other code than the tree's: run bash tools/sass/tritons.sh {payload.get('triton')} "
            "and commit the file it writes"
        )


@pytest.mark.parametrize("family", sorted(bench_main.OPS))
def test_every_case_states_its_bytes_checks_its_result_and_times_fastrl(family):
    for case in bench_main.OPS[family].cases(torch.device("cpu"), quick=True):
        assert case.min_bytes > 0 and case.bytes_formula
        assert callable(case.check)
        assert case.impls[0].name == "fastrl" and case.impls[0].unavailable is None
        assert all((impl.make is None) == (impl.unavailable is not None) for impl in case.impls), case.op


def test_run_cases_times_fastrl_and_peers_and_lists_missing_ones():
    x = torch.randn(64, 1000)
    case = bench.Case(
        op="toy", shape=(64, 1000), dtype=torch.float32, bytes_formula="N*V*4", min_bytes=x.numel() * 4,
        make_inputs=lambda device: {"x": x.to(device)}, check=lambda inputs: 0.0,
        impls=[
            bench.Impl("fastrl", bench.no_grad_step(lambda inputs: inputs["x"].sum())),
            bench.Impl("peer", bench.grad_step(lambda t, inputs: t.exp(), "x")),
            bench.Impl("absent peer", None, "not installed (absent: ImportError)"),
        ],
    )  # fmt: skip
    rows = bench.run_cases([case], torch.device("cpu"), reps=3)
    ours, peer, absent = rows
    assert ours["max_err_vs_reference"] == 0.0 and ours["median_ms"] > 0 and ours["gbps"] > 0
    assert peer["fastrl_speedup"] == pytest.approx(peer["median_ms"] / ours["median_ms"])
    assert absent["unavailable"].startswith("not installed")
    assert "absent peer" in bench.format_table(rows, copy_gbps=10.0)


def _sleeping_case(fastrl_sleeps):
    """A toy case whose fastrl call sleeps for ``next(fastrl_sleeps)`` seconds and
    whose torch peer sleeps 2 ms."""
    sleeper = lambda seconds: bench.no_grad_step(lambda inputs: time.sleep(seconds()))  # noqa: E731
    return bench.Case(
        op="toy", shape=(1, 1), dtype=torch.float32, bytes_formula="4", min_bytes=4,
        make_inputs=lambda device: {}, check=lambda inputs: 0.0,
        impls=[bench.Impl("fastrl", sleeper(lambda: next(fastrl_sleeps))),
               bench.Impl("torch eager toy", sleeper(lambda: 2e-3))],
    )  # fmt: skip


@pytest.mark.parametrize(
    "fastrl_sleeps, fails",
    [
        (itertools.chain([20e-3] * 10, itertools.repeat(0.5e-3)), False),  # a burst of load during the first timing
        (itertools.repeat(4e-3), True),  # fastrl really is slower
    ],
    ids=["burst", "regression"],
)
def test_speed_check_measures_a_short_ratio_again_before_failing(fastrl_sleeps, fails, monkeypatch, tmp_path, capsys):
    family = types.SimpleNamespace(cases=lambda device, quick, shapes: [_sleeping_case(fastrl_sleeps)])
    monkeypatch.setitem(bench_main.OPS, "toy", family)
    status = bench_main.main(["--op", "toy", "--reps", "3", "--check-speed", "1.0", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert "re-measured toy [1, 1] float32 against torch eager toy" in err
    assert status == int(fails) and ("FAIL" in err) == fails


def test_merge_adds_one_op_familys_rows_to_the_results_file_of_the_same_commit(monkeypatch, tmp_path):
    def family(op):
        case = dataclasses.replace(_sleeping_case(itertools.repeat(0.1e-3)), op=op)
        return types.SimpleNamespace(
            cases=lambda device, quick, shapes: [dataclasses.replace(case, shape=tuple(s[:2])) for s in shapes or [(1, 1)]]
        )

    monkeypatch.setitem(bench_main.OPS, "toy_a", family("toy a"))
    monkeypatch.setitem(bench_main.OPS, "toy_b", family("toy b"))
    out = tmp_path / "results.json"
    run = lambda *args: bench_main.main(["--reps", "2", "--json", str(out), *args])  # noqa: E731
    assert run("--op", "toy_a") == 0 and run("--op", "toy_b", "--merge") == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == ["toy a", "toy a", "toy b", "toy b"]
    assert rows[0]["copy_gbps"] > 0 and "copy_gbps" not in rows[2]  # each row's % uses its own run's bandwidth
    assert run("--op", "toy_b", "--merge") == 0  # a family run again replaces its rows
    assert [r["op"] for r in json.loads(out.read_text())["rows"]] == ["toy a", "toy a", "toy b", "toy b"]
    assert run("--op", "toy_b", "--merge", "--shape", "3,5,float32") == 0  # another shape adds its rows
    rows = json.loads(out.read_text())["rows"]
    assert [(r["op"], r["shape"]) for r in rows][2:] == [("toy b", [1, 1])] * 2 + [("toy b", [3, 5])] * 2

    monkeypatch.setattr(bench, "_git_commit", lambda: "another")
    assert run("--op", "toy_b", "--merge") == 2  # refused before anything is timed
    assert run("--op", "toy_b") == 0  # without --merge the file is replaced
    assert [r["op"] for r in json.loads(out.read_text())["rows"]] == ["toy b", "toy b"]


def test_the_commit_comes_from_the_environment_where_the_tree_has_no_git(monkeypatch):
    def no_git(*args, **kwargs):
        raise subprocess.CalledProcessError(128, args[0])

    monkeypatch.setattr(bench.subprocess, "run", no_git)
    monkeypatch.setenv("FASTRL_BENCH_COMMIT", "0123abcd")
    assert bench._git_commit() == "0123abcd"


def test_peak_extra_memory_is_measured_on_the_cpu():
    memory = bench._PeakMemory(torch.device("cpu"))
    memory.start()
    if memory.base is None:
        pytest.skip("no /proc/self/clear_refs here (not Linux)")
    buffer = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB, touched
    del buffer
    assert memory.extra_bytes() >= 60 << 20


@pytest.mark.parametrize("results", RESULTS, ids=[p.stem for p in RESULTS])
def test_plots_are_written_for_every_op_of_a_results_file(results, tmp_path):
    pytest.importorskip("matplotlib")
    payload = json.loads(results.read_text())
    paths = write_plots(payload, tmp_path)
    ops = {r["op"] for r in payload["rows"] if "median_ms" in r}
    assert len(paths) == len(ops)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths)


@pytest.mark.parametrize("isa, device, expected", [
    ("x86-64-v3 (AVX2)", "cpu", 0.25), ("x86-64-v4 (AVX-512)", "cpu", 1.0), ("x86-64-v3 (AVX2)", "cuda", 1.0),
])  # fmt: skip
def test_speed_gate_margin_follows_the_native_isa(monkeypatch, isa, device, expected):
    """--check-speed-avx2 applies only where the native kernels run their AVX2 clone on the CPU (issue 18)."""
    import argparse

    from fastrl import _backend

    native = types.SimpleNamespace(build_info=lambda: {"cpu_isa": isa})
    monkeypatch.setattr(_backend, "native_module", lambda: native)
    args = argparse.Namespace(check_speed=1.0, check_speed_avx2=0.25)
    assert bench_main._speed_margin(args, torch.device(device)) == expected


@pytest.mark.parametrize(
    ("has", "filters", "called"),
    [
        # FlashInfer releases without top_k_sampling_from_logits: the fused logits
        # entry point with the other filter off, else the one from probabilities.
        (("top_k_top_p_sampling_from_logits", "top_p_sampling_from_probs"), {"top_k": 50},
         ("top_k_top_p_sampling_from_logits", 50, 1.0)),
        (("top_k_top_p_sampling_from_logits", "top_p_sampling_from_probs"), {"top_p": 0.9},
         ("top_k_top_p_sampling_from_logits", 8, 0.9)),
        (("top_k_sampling_from_probs",), {"top_k": 50}, ("top_k_sampling_from_probs", 50)),
        (("top_k_sampling_from_logits", "top_k_sampling_from_probs"), {"top_k": 50},
         ("top_k_sampling_from_logits", 50)),
    ],
)  # fmt: skip
def test_the_flashinfer_peer_uses_the_entry_point_the_install_has(monkeypatch, has, filters, called):
    from bench import sampling

    calls = []
    module = types.ModuleType("flashinfer.sampling")
    for name in has:
        setattr(module, name, lambda *args, name=name: calls.append((name, *args[1:])))
    monkeypatch.setitem(sys.modules, "flashinfer.sampling", module)
    run, why = sampling._flashinfer(filters, torch.device("cuda"))
    assert why is None
    run(torch.zeros(2, 8))
    assert calls == [called]


def test_the_flashinfer_peer_says_why_it_is_absent(monkeypatch):
    from bench import sampling

    monkeypatch.setitem(sys.modules, "flashinfer.sampling", types.ModuleType("flashinfer.sampling"))
    run, why = sampling._flashinfer({"top_k": 50}, torch.device("cuda"))
    assert run is None and "top_k_top_p_sampling_from_logits" in why
    assert sampling._flashinfer({"top_k": 50}, torch.device("cpu")) == (None, "GPU only")


def _compiled_case(fastrl_seconds, gated=True):
    """A toy case whose fastrl call sleeps ``fastrl_seconds`` and whose
    torch.compile peer sleeps 2 ms."""
    sleeper = lambda seconds: bench.no_grad_step(lambda inputs: time.sleep(seconds))  # noqa: E731
    return bench.Case(
        op="toy", shape=(1, 1), dtype=torch.float32, bytes_formula="4", min_bytes=4,
        make_inputs=lambda device: {}, check=lambda inputs: 0.0, compiled_gate=gated,
        impls=[bench.Impl("fastrl", sleeper(fastrl_seconds)), bench.Impl(bench.COMPILED, sleeper(2e-3))],
    )  # fmt: skip


@pytest.mark.parametrize("fastrl_seconds, gated, fails", [(0.5e-3, True, False), (4e-3, True, True), (4e-3, False, False)],
                         ids=["faster", "slower", "slower-not-gated"])  # fmt: skip
def test_the_compiled_speed_check_compares_with_torch_compile(fastrl_seconds, gated, fails, monkeypatch, tmp_path,
                                                              capsys):  # fmt: skip
    family = types.SimpleNamespace(cases=lambda device, quick, shapes: [_compiled_case(fastrl_seconds, gated)])
    monkeypatch.setitem(bench_main.OPS, "toy", family)
    args = ["--op", "toy", "--reps", "3", "--check-speed-compiled", "1.0", "--json", str(tmp_path / "r.json")]
    status = bench_main.main(args)
    err = capsys.readouterr().err
    assert status == int(fails) and ("FAIL" in err) == fails
    assert ("re-measured toy [1, 1] float32 against torch.compile(reference)" in err) == fails


def test_a_quick_run_compiles_the_reference_only_for_the_compiled_speed_check():
    from bench import kl

    compiled = lambda: next(i for i in kl.cases(torch.device("cpu"), quick=True)[0].impls if i.name == bench.COMPILED)  # noqa: E731
    assert compiled().unavailable == "skipped in --quick (compile time)"
    try:
        bench.COMPILED_IN_QUICK = True
        assert compiled().unavailable is None
    finally:
        bench.COMPILED_IN_QUICK = False


def test_cpu_results_name_the_level_their_kernels_ran_at(monkeypatch):
    payload = {"device": "Xeon (2 cores)", "device_type": "cpu", "cpu_isa": "x86-64-v3 (AVX2)",
               "cpu_isa_best": "x86-64-v4 (AVX-512)", "aten_cpu_capability": "AVX2"}  # fmt: skip
    assert bench.results_label(payload) == (
        "Xeon (2 cores), native kernels at x86-64-v3 (AVX2) (forced; the CPU has x86-64-v4), torch at AVX2"
    )
    assert bench.results_label({**payload, "cpu_isa_best": "x86-64-v3 (AVX2)"}).endswith("at x86-64-v3 (AVX2), torch at AVX2")
    assert bench.results_label({"device": "H100", "device_type": "cuda"}) == "H100"
    env = bench.environment(torch.device("cpu"))
    assert {"cpu_isa", "cpu_isa_best", "aten_cpu_capability", "inductor_simdlen"} <= set(env)
    level = env["cpu_isa"].split(" ")[0]
    assert bench.device_slug(torch.device("cpu")) == f"cpu-{level}"


def test_cpu_isa_restarts_the_run_at_that_level(monkeypatch):
    """--cpu-isa sets the native kernels' and torch's levels and restarts the
    run (both read them when they load); Inductor follows FASTRL_CPU_ISA."""
    calls = []
    monkeypatch.setattr(bench_main.os, "execve", lambda path, argv, env: calls.append((argv, env)))
    monkeypatch.delenv("FASTRL_CPU_ISA", raising=False)
    bench_main._run_at_cpu_level("x86-64-v3", ["--quick", "--cpu-isa", "x86-64-v3"])
    (argv, env), = calls
    assert argv[1:] == ["-m", "bench", "--quick", "--cpu-isa", "x86-64-v3"]
    assert env["FASTRL_CPU_ISA"] == "x86-64-v3" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    from torch._inductor import config

    monkeypatch.setenv("FASTRL_CPU_ISA", "x86-64-v3")
    # config.patch, not monkeypatch.setattr: torch's config attributes live outside
    # the module's __dict__, and pytest 9.2's monkeypatch deletes such an
    # attribute on undo (every later torch.compile then fails)
    with config.patch({"cpp.simdlen": None}):
        bench_main._inductor_at_native_level()
        assert config.cpp.simdlen == 256
    assert hasattr(config.cpp, "simdlen")


@pytest.mark.skipif(torch.cuda.is_available(), reason="measures the host path on CPU tensors")
def test_the_host_time_harness_launches_through_triton_on_a_null_driver():
    """python -m bench.host: a case runs through Triton's compiled launch path
    (kernels compiled for sm_90 at the first call, a launcher that does
    nothing) and again with its kernels stubbed; a process of its own, as a
    Triton under TRITON_INTERPRET has no compiled launch path to time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "bench.host", "--only", "policy_loss", "--calls", "2", "--rounds", "1"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    row = [line for line in result.stdout.splitlines() if line.startswith("policy_loss fwd+bwd")]
    assert len(row) == 1, result.stdout
    total, own, launches = (float(v) for v in row[0].split()[-3:])
    assert total > 0 and own > 0 and abs(total - own - launches) < 0.2
    interpreted = subprocess.run(
        [sys.executable, "-m", "bench.host", "--only", "policy_loss"],
        capture_output=True, text=True, env=env | {"TRITON_INTERPRET": "1"}, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert interpreted.returncode != 0 and "without TRITON_INTERPRET" in interpreted.stderr


def test_the_predicted_tables_measured_column_takes_the_newest_gpu_run():
    """A case two GPU runs measured shows the newer one's time, whatever order
    the results files come in: an older run may predate a fix."""
    def run(device, date, ms):
        row = {"op": "sample top-k 50", "shape": [1, 151936], "dtype": "bfloat16", "impl": "fastrl", "median_ms": ms}
        return {"device": device, "device_type": "cuda", "date": date, "rows": [row]}

    old, new = run("NVIDIA H100", "2026-11-24T08:35:12+00:00", 78.6), run("NVIDIA H200", "2026-11-27T18:16:18+00:00", 0.9)
    for runs in ([old, new], [new, old]):
        assert list(report._measured_gpu_times(runs).values()) == [("NVIDIA H200", 0.9)]
