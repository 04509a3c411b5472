"""The quick GPU plan (issue 38): everything important measured in one device call
of at most six minutes from a bare H100 / H200, so that a session handed a GPU
spends it measuring. ``bash bench/gpu/session.sh quick`` runs it; this module holds
what it runs:

- ``SMOKE_TESTS``: the GPU correctness smoke, instances of the existing tests (their
  float64 references, their bounds) on the compiled Triton kernels: every kernel
  family in each dtype it takes (float64 through gradcheck or the exact-estimator
  tests), the sampler's split path at small B, CUDA-graph captures and one
  ``torch.compile``. ``--smoke-ids DEVICE`` prints their pytest node ids.
- ``FAMILIES``: the canonical shapes ``python -m bench --plan quick`` times, each
  beside the peers issue 38 names; the peers it does not time are listed in the
  results with the reason (torch.compile takes 20-60 s to compile a case; veRL's
  log-probs take 0.6-2.1 s a call at [16384, 151936]).
- ``predictions``: the static sm_90 model's predictions for the installed Triton,
  which the plan's results carry beside each fastrl row, labelled as predictions.
- ``estimate``: the plan's time per stage on an H100, from the model's predicted
  kernel times and the peers' measured ones (``--estimate`` prints it; the header
  of bench/gpu/session.sh quotes it).

``--dry-run`` (``FASTRL_QUICK_DRY=1 bash bench/gpu/session.sh quick``) runs the
same plumbing on a CPU at tiny shapes; tests/test_gpu_plan.py runs it in CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import types
from pathlib import Path

import torch

from tools.sass import RESULTS_DIR, results_path

from . import COMPILED, Case, kl, linear, logprobs, percent_of_copy, policy, row_key, sampling

# Node ids with {device} for "cuda" (or "cpu" in the dry run, which only collects
# them: a renamed test or parameter fails CI there, not the next GPU session).
SMOKE_TESTS = (
    # log-probs, entropy and their backward in each dtype, at the Qwen vocabulary too
    "tests/test_logprobs.py::test_values_and_gradients_match_float64_reference[{device}-triton-torch.float32-32000-0.3]",
    "tests/test_logprobs.py::test_values_and_gradients_match_float64_reference[{device}-triton-torch.bfloat16-4097-per-row]",
    "tests/test_logprobs.py::test_values_and_gradients_match_float64_reference[{device}-triton-torch.float16-32000-1.7]",
    "tests/test_logprobs.py::test_qwen_vocabulary[{device}-triton-torch.bfloat16]",
    "tests/test_logprobs.py::test_gradcheck_float64[{device}-triton-both]",
    # full KL and the KL penalty
    "tests/test_kl.py::test_full_kl_values_and_gradients[{device}-triton-torch.float32-32000-0.6]",
    "tests/test_kl.py::test_full_kl_values_and_gradients[{device}-triton-torch.bfloat16-4097-per-row]",
    "tests/test_kl.py::test_full_kl_gradcheck[{device}-triton]",
    "tests/test_kl.py::test_kl_penalty_values_and_gradients[{device}-triton-k3-torch.float32]",
    "tests/test_kl.py::test_kl_penalty_values_and_gradients[{device}-triton-k3-torch.bfloat16]",
    "tests/test_kl.py::test_kl_penalty_values_and_gradients[{device}-triton-low_var_kl+-torch.float64]",
    # sampling: top-k, top-p and min-p together (chi-square), truncated_logprobs and
    # its gradient, the split path at small B bitwise against one program a row, the
    # benchmark's full-vocabulary rows (exact and repeatable), a CUDA-graph capture
    "tests/test_sampling.py::test_draws_follow_the_truncated_distribution[{device}-triton-combined-T1.0]",
    "tests/test_sampling.py::test_truncated_logprobs_match_sample_and_reference[{device}-triton-torch.float32]",
    "tests/test_sampling.py::test_truncated_logprobs_match_sample_and_reference[{device}-triton-torch.bfloat16]",
    "tests/test_sampling.py::test_truncated_logprobs_match_sample_and_reference[{device}-triton-torch.float16]",
    "tests/test_sampling.py::test_truncated_logprobs_gradient[{device}-triton]",
    "tests/test_sampling.py::test_split_rows_give_the_bits_of_one_program_a_row[{device}-triton-float32-8704-window]",
    "tests/test_sampling.py::test_split_rows_give_the_bits_of_one_program_a_row[{device}-triton-bfloat16-8693-top-digits]",
    "tests/test_sampling.py::test_split_rows_give_the_bits_of_one_program_a_row[{device}-triton-float64-8200-window]",
    "tests/test_sampling.py::test_full_vocabulary_rows_on_the_gpu_are_exact_and_repeatable",
    "tests/test_sampling.py::test_cuda_graph_capture_with_device_seed_and_offset",
    # policy loss (token and sequence level, dual clip, KL, entropy), rollout
    # correction, from logits, and under CUDA-graph capture
    "tests/test_policy.py::test_policy_loss_matches_reference[{device}-triton-token-token-mean-dual-clip-kl+entropy+weights]",
    "tests/test_policy.py::test_policy_loss_matches_reference[{device}-triton-sequence-seq-mean-token-mean-no-dual-clip-kl+entropy+weights]",
    "tests/test_policy.py::test_policy_loss_in_float64_is_exact_for_every_estimator[{device}-triton-token-k3]",
    "tests/test_policy.py::test_rollout_correction_matches_reference[{device}-triton-sequence-truncate-0.6]",
    "tests/test_policy.py::test_policy_loss_from_logits_matches_reference[{device}-triton-True]",
    "tests/test_policy.py::test_policy_loss_under_cuda_graph_capture",
    # the fused LM head in each dtype, its policy loss from hidden states
    "tests/test_linear.py::test_values_and_gradients_match_float64_reference[{device}-triton-torch.float32-softcap-chunks]",
    "tests/test_linear.py::test_values_and_gradients_match_float64_reference[{device}-triton-torch.bfloat16-nocap-chunks]",
    "tests/test_linear.py::test_values_and_gradients_match_float64_reference[{device}-triton-torch.float16-nocap-one-chunk]",
    "tests/test_linear.py::test_gradcheck_float64[{device}-triton]",
    "tests/test_linear.py::test_policy_loss_from_hidden_matches_reference_in_float64[{device}-triton-ppo]",
    # one torch.compile (fullgraph, no recompilation), and the sharded ops in a CUDA graph
    "tests/test_compile.py::test_compiles_without_graph_breaks_and_matches_eager[{device}-triton-logprobs]",
    "tests/test_vocab_parallel.py::test_sharded_ops_are_captured_in_a_cuda_graph",
)


def smoke_node_ids(device: str) -> list[str]:
    return [test.replace("{device}", device) for test in SMOKE_TESTS]


@dataclasses.dataclass(frozen=True)
class Family:
    module: types.ModuleType  # a family of python -m bench
    shapes: tuple | None  # the canonical (N, V, dtype) as --shape takes them; None: the family's own GPU shapes
    dry_shapes: tuple | None  # tiny ones for the dry run; None: the family's --quick shapes
    skipped: dict  # impl name prefix -> why the quick plan does not time it


COMPILE_TIME = "compiles for 20-60 s a case (the full suite times it)"
V = 151936
BF16 = torch.bfloat16
FAMILIES = (
    Family(logprobs, ((16384, V, BF16),), ((8, 512, BF16),), {
        COMPILED: COMPILE_TIME,
        "veRL logprobs_from_logits": "0.6-2.1 s a call at 16384 x 151936 (H200, 2026-11-27; the full suite times it)",
    }),
    Family(sampling, ((1, V, BF16), (64, V, BF16), (1024, V, BF16)), ((1, 512, BF16), (4, 512, BF16), (16, 512, BF16)), {
        "torch eager (fastrl.reference)": "the specification, 4-270 ms a call; the torch path is the eager peer",
    }),
    Family(kl, ((8192, V, BF16),), ((8, 512, BF16),), {COMPILED: COMPILE_TIME}),
    Family(policy, None, None, {COMPILED: COMPILE_TIME}),
    Family(linear, ((8192, V, BF16),), ((8, 512, BF16),), {
        COMPILED: COMPILE_TIME,
        "torch eager (fastrl.reference)": "the float32 specification; the unfused path is the eager peer",
        "veRL FusedLinearForPPO": "not among the quick plan's peers (the full suite times it)",
    }),
)  # fmt: skip


def _skip(case: Case, skipped: dict) -> Case:
    """``case`` with the impls the plan does not time listed with the reason."""
    impls = []
    for impl in case.impls:
        why = next((w for prefix, w in skipped.items() if impl.name.startswith(prefix)), None)
        impls.append(impl if why is None else dataclasses.replace(impl, make=None, unavailable=f"skipped in the quick plan: {why}"))
    return dataclasses.replace(case, impls=impls)


def cases(device: torch.device, *, dry: bool = False) -> list[tuple[Case, tuple]]:
    """The plan's cases on ``device``, each with the key (op, shape, dtype) of the
    canonical case it stands for: itself, or in the dry run the GPU case its tiny
    one stands in for (so that its prediction can sit beside it)."""
    out = []
    for family in FAMILIES:
        planned = family.module.cases(torch.device("cuda"), shapes=family.shapes)
        if not dry:
            out += [(_skip(c, family.skipped), c.key()) for c in planned]
            continue
        tiny = family.module.cases(device, quick=True, shapes=family.dry_shapes)
        assert len(tiny) == len(planned), family.module.__name__
        out += [(_skip(c, family.skipped), p.key()) for c, p in zip(tiny, planned)]
    return out


def predictions(triton_version: str | None, directory: Path = RESULTS_DIR) -> dict | None:
    """The sm_90 model's predictions made with ``triton_version`` (the predictions file
    tools/sass/tritons.sh writes for it), or None: a prediction for another Triton is of
    other code."""
    path = results_path(str(triton_version), directory)
    return {**json.loads(path.read_text()), "file": path.name} if path.exists() else None


def model_of(device_name: str) -> str | None:
    """The GPU the model predicts for (its ``model`` keys) that ``device_name`` is."""
    return next((gpu for gpu in ("H100", "H200") if gpu in device_name), None)


def attach_predictions(rows: list[dict], predicted: dict, gpu: str, canonical: dict) -> None:
    """Puts beside each measured fastrl row the model's prediction on ``gpu`` of the
    case it stands for (``canonical``: row key -> that case's key), labelled as one."""
    by_key = {(op["op"], tuple(op["shape"]), op["dtype"]): op for op in predicted["ops"]}
    for row in rows:
        op = by_key.get(canonical.get(row_key(row), row_key(row)))
        if row["impl"] != "fastrl" or "median_ms" not in row or op is None:
            continue
        guess = op["predicted"][gpu]
        row["predicted"] = {
            "label": predicted["label"], "gpu": gpu, "triton": predicted["triton"], "file": predicted["file"],
            "shape": op["shape"], "time_ms": guess["time_s"] * 1e3, "copy_pct": guess["copy_pct"],
        }  # fmt: skip


def summary(rows: list[dict], copy_gbps: float, *, on_the_gpu: bool) -> str:
    """One line per case: fastrl's measured time and share of the copy bandwidth,
    the model's prediction beside it (marked as such; their ratio where the run was
    on the predicted GPU, at the predicted shape), and fastrl's speed-up over each peer."""
    lines = ["fastrl measured, beside the sm_90 model's prediction (predicted, not measured):"]
    for row in rows:
        if row["impl"] != "fastrl" or "median_ms" not in row:
            continue
        op, shape, dtype = row_key(row)
        guess = row.get("predicted")
        predicted = "no prediction"
        if guess:
            predicted = f"predicted {guess['time_ms']:.3f} ms ({guess['gpu']}, triton {guess['triton']})"
            if on_the_gpu and guess["shape"] == row["shape"]:
                predicted += f", measured / predicted {row['median_ms'] / guess['time_ms']:.2f}"
            else:  # a dry run's stand-in: the prediction is of the GPU case
                predicted += f" for {'x'.join(map(str, guess['shape']))} on the GPU"
        peers = ", ".join(
            f"{r['impl']} {r['fastrl_speedup']:.2f}x" for r in rows if row_key(r) == row_key(row) and "fastrl_speedup" in r
        )
        lines.append(
            f"  {op} {'x'.join(map(str, shape))} {dtype}: measured {row['median_ms']:.3f} ms "
            f"({percent_of_copy(row, copy_gbps):.0f}% of copy BW); {predicted}; speed-up over {peers or 'no peer'}"
        )
    return "\n".join(lines)


# The estimate's stated assumptions (seconds). A call of a case's impl is timed
# REPS times after 2 warm-ups, then once more for its peak memory.
REPS = 10
GPU_IMAGE_TRITON = "3.6.0"  # the lent GPU machines' (KINDS.md)
CALLS = REPS + 3
IMPORTS_S = 25.0  # python, torch, Triton, TRL, veRL, Liger imported once by the bench process
CASE_S = 0.5  # a case's inputs drawn on the GPU and its check against the float64 reference
TRITON_COMPILE_S = 4.0  # a Triton kernel's first compile, per timed fastrl or Triton-peer impl of a case
UNMEASURED_CALL_S = 0.05  # a call no GPU run has timed yet (the fused LM head's; the new logprobs fwd+bwd case)
NOT_CARRIED = ("flash-attn", "quack", "FlashInfer")  # too large for a call's 64 MiB, or a CUDA build (peers.sh)
TRITON_PEERS = ("fastrl", "TRL kernels", "Liger")
SETUP_S = 20.0  # the peers' wheels into /tmp/site, and fastrl installed editable without its native build
BUILD_S = 40.0  # fastrl._C (the CPU kernels): in the background, beside the smoke (session.sh's old setup, ~40 s)
# 36 of the ~900 tests `pytest -m gpu` runs, which took over 330 s on 16 workers
# (H100, 2026-11-24): ~15 s of their share, but each worker compiles the kernels
# of its own tests first (about 4 s a kernel) and one test spawns an NCCL rank.
SMOKE_S = 100.0
PACK_S = 10.0  # the README's tables regenerated, results.tgz
BUDGET_S = 345  # session.sh's QUICK_BUDGET: a device call of 360 s, less a margin for the summary


def _measured_call_times(directory: Path, gpu: str) -> dict[tuple, float]:
    """(op, shape, dtype, impl) -> seconds a call on ``gpu``, from the GPU results
    files: as measured on that GPU, else on the other one scaled by the ratio of
    the two runs' copy bandwidth (the log-prob, KL and sampling peers move bytes)."""
    runs = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))]
    runs = [r for r in runs if r.get("device_type") == "cuda" and model_of(r["device"])]
    bandwidth = {model_of(r["device"]): r["copy_bandwidth_gbps"] for r in runs}
    times = {}
    for run in sorted(runs, key=lambda r: model_of(r["device"]) == gpu):  # this GPU's rows last: they win
        scale = run["copy_bandwidth_gbps"] / bandwidth.get(gpu, run["copy_bandwidth_gbps"])
        for row in run["rows"]:
            if "median_ms" in row:
                times[(*row_key(row), row["impl"])] = row["median_ms"] / 1e3 * scale
    return times


def estimate(gpu: str = "H100", directory: Path = RESULTS_DIR) -> list[tuple[str, float, str]]:
    """(stage, seconds, how) for the plan on ``gpu``: the bench from the model's
    predicted fastrl times and the peers' measured times, the rest from the stated
    overheads above. Every peer the plan times counts, importable here or not,
    but those bench/gpu/peers.sh does not carry."""
    predicted = predictions(GPU_IMAGE_TRITON, directory) or {"ops": []}
    fastrl_s = {(op["op"], tuple(op["shape"]), op["dtype"]): op["predicted"][gpu]["time_s"] for op in predicted["ops"]}
    measured = _measured_call_times(directory, gpu)
    timed = compile_s = unmeasured = 0
    cases_planned = cases(torch.device("cuda"))
    for case, key in cases_planned:
        for impl in case.impls:
            if impl.name.startswith(NOT_CARRIED) or (impl.unavailable or "").startswith("skipped in the quick plan"):
                continue
            seconds = fastrl_s.get(key) if impl.name == "fastrl" else None
            seconds = seconds or measured.get((key[0], tuple(key[1]), key[2], impl.name))
            if seconds is None:
                seconds, unmeasured = UNMEASURED_CALL_S, unmeasured + 1
            timed += CALLS * seconds
            compile_s += TRITON_COMPILE_S if impl.name.startswith(TRITON_PEERS) else 0.0
    bench_s = IMPORTS_S + len(cases_planned) * CASE_S + compile_s + timed
    return [
        ("setup", SETUP_S, "peers' wheels installed, fastrl installed without its native build"),
        ("build", BUILD_S, "fastrl._C, in the background beside the smoke (not counted in the total)"),
        ("smoke", SMOKE_S, f"{len(SMOKE_TESTS)} node ids of pytest -m gpu, 8 workers"),
        ("bench", bench_s, f"{len(cases_planned)} cases: {timed:.0f} s timed ({CALLS} calls an impl; "
                           f"{unmeasured} impls at an assumed {UNMEASURED_CALL_S * 1e3:.0f} ms a call), "
                           f"{compile_s:.0f} s Triton compiles, {IMPORTS_S:.0f} s imports"),
        ("pack", PACK_S, "README tables regenerated, results.tgz"),
    ]  # fmt: skip


def estimated_total(stages: list[tuple[str, float, str]]) -> float:
    """The plan's wall time: every stage but the background build."""
    return sum(seconds for stage, seconds, _ in stages if stage != "build")


def format_estimate(stages: list[tuple[str, float, str]], gpu: str) -> str:
    lines = [f"the quick plan's estimated time on an {gpu} (bench/quick.py; a budget of {BUDGET_S} s):"]
    lines += [f"  {stage:<6} {seconds:5.0f} s  {how}" for stage, seconds, how in stages]
    return "\n".join([*lines, f"  total  {estimated_total(stages):5.0f} s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.quick", description=__doc__.splitlines()[0])
    parser.add_argument("--smoke-ids", metavar="DEVICE", help="print the smoke's pytest node ids on DEVICE (cuda, cpu)")
    parser.add_argument("--estimate", choices=("H100", "H200"), help="print the plan's time per stage on this GPU")
    args = parser.parse_args(argv)
    if args.smoke_ids:
        print("\n".join(smoke_node_ids(args.smoke_ids)))
    if args.estimate:
        print(format_estimate(estimate(args.estimate), args.estimate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
