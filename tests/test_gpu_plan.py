"""The quick GPU plan's plumbing (``bash bench/gpu/session.sh quick``, bench/quick.py),
run dry on the CPU so that it still works the day a GPU is lent: the stages and
their summary, the smoke's node ids (collected: a renamed test or parameter fails
here, not in the GPU session), the results file with a measured fastrl row for
every planned case and the model's prediction beside it, labelled, and the
README's tables regenerated from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from bench import quick

ROOT = Path(__file__).resolve().parents[1]
# What issue 38 asks the plan to measure, as (op, shape, dtype) of its cases.
REQUIRED = [
    ("logprobs fwd", [16384, 151936], "bfloat16"),
    ("logprobs fwd+bwd", [16384, 151936], "bfloat16"),
    ("logprobs+entropy fwd", [16384, 151936], "bfloat16"),
    ("logprobs+entropy fwd+bwd", [16384, 151936], "bfloat16"),
    *[(f"sample {mode}", [batch, 151936], "bfloat16") for mode in ("top-k 50", "top-p 0.9") for batch in (1, 64, 1024)],
    ("full_kl fwd", [8192, 151936], "bfloat16"),
    ("full_kl fwd+bwd", [8192, 151936], "bfloat16"),
    ("policy_loss fwd+bwd", [64, 8192], "float32"),
    ("linear logprobs+entropy fwd", [8192, 4096, 151936], "bfloat16"),
    ("linear logprobs+entropy fwd+bwd", [8192, 4096, 151936], "bfloat16"),
]


def test_the_quick_plan_runs_dry_from_its_stages_to_the_readme(tmp_path):
    env = {**os.environ, "FASTRL_QUICK_DRY": "1", "OUT": str(tmp_path), "PY": sys.executable}
    proc = subprocess.run(["bash", "bench/gpu/session.sh", "quick"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    summary = output.split("=== summary\n")[1].splitlines()
    assert [line.split()[:3] for line in summary] == [[stage, "exit", "0"] for stage in ("setup", "smoke", "bench-quick", "pack")]

    # the smoke: every node id found (-q --collect-only lists each test it collected)
    collected = (tmp_path / "smoke.log").read_text().splitlines()
    for node in quick.smoke_node_ids("cpu"):
        assert any(line == node or line.startswith(node + "[") for line in collected), f"{node} is not collected"

    # the estimate, in the bench's log, within the budget session.sh gives the plan
    bench_log = (tmp_path / "bench-quick.log").read_text()
    total = next(line for line in bench_log.splitlines() if line.strip().startswith("total"))
    assert float(total.split()[1]) < quick.BUDGET_S
    assert f"QUICK_BUDGET:-{quick.BUDGET_S}" in (ROOT / "bench" / "gpu" / "session.sh").read_text()

    # the results: a fastrl row measured for every planned case (in order), the
    # prediction of the GPU case it stands in for beside it, and each peer timed
    # or listed with why not
    runs = {path: json.loads(path.read_text()) for path in (tmp_path / "dry-results").glob("*.json")}
    ((results, payload),) = [(path, run) for path, run in runs.items() if run.get("plan", "").startswith("quick (dry run")]
    assert "incomplete" not in payload
    planned = [(op, tuple(shape), dtype) for op, shape, dtype in payload["plan_cases"]]
    assert {(op, tuple(shape), dtype) for op, shape, dtype in REQUIRED} <= set(planned)
    ours = [row for row in payload["rows"] if row["impl"] == "fastrl"]
    assert len(ours) == len(planned) and all("median_ms" in row for row in ours)
    predicted = quick.predictions(payload["triton"])
    predicted_cases = {(op["op"], tuple(op["shape"]), op["dtype"]) for op in predicted["ops"]}
    for row, (op, shape, dtype) in zip(ours, planned):
        assert row["op"] == op  # at a tiny stand-in shape (and on the CPU the policy loss takes float32 logits)
        if (op, shape, dtype) in predicted_cases:
            guess = row["predicted"]
            assert tuple(guess["shape"]) == shape and guess["gpu"] == "H100" and guess["time_ms"] > 0
            assert "not measured" in guess["label"] and guess["triton"] == predicted["triton"]
        else:
            assert "predicted" not in row
    assert sum("predicted" in row for row in ours) >= 12
    peers = [row for row in payload["rows"] if row["impl"] != "fastrl"]
    assert all("median_ms" in row or row["unavailable"] for row in peers)
    assert any(row["unavailable"].startswith("skipped in the quick plan") for row in peers if "unavailable" in row)
    assert all("predicted" not in row for row in peers)

    # the README's tables regenerated into the copy, and both in results.tgz
    readme = (tmp_path / "dry-README.md").read_text()
    assert "the quick (dry run: tiny stand-ins on the CPU for the plan's GPU cases) plan" in readme
    assert "**Predicted, not measured" in readme
    with tarfile.open(tmp_path / "results.tgz") as archive:
        names = archive.getnames()
    assert any(name.endswith("dry-README.md") for name in names)
    assert any(name.endswith(f"dry-results/{results.name}") for name in names)
