"""The end-to-end demo (examples/grpo_tiny.py, `make demo`), shortened: GRPO on
CPU with a fixed seed must raise the reward on both backends, the two backends
must train the same model, and the reward-curve PNG must be written."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo_tiny.py"


def load_example():
    spec = importlib.util.spec_from_file_location("grpo_tiny", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_grpo_demo_reward_rises(tmp_path, capsys):
    demo = load_example()
    png = tmp_path / "reward_curve.png"
    threads = torch.get_num_threads()
    try:
        results = demo.main(["--device", "cpu", "--steps", "40", "--seed", "0", "--compare", "--plot", str(png)])
    finally:
        torch.set_num_threads(threads)  # main() sets it for the whole process

    assert [r.backend for r in results] == ["fastrl", "reference"]
    for result in results:
        first = demo.mean_reward(result, first=True, window=10)
        last = demo.mean_reward(result, first=False, window=10)
        # Chance level is about 0.15; 40 steps take it to about 0.55.
        assert last > first + 0.15, f"{result.backend}: reward {first:.3f} -> {last:.3f} did not rise"
        assert all(0.0 <= h["reward"] <= 1.0 for h in result.history)
    # Same seed, same sampler counters, same math: the two backends draw the same
    # tokens until float rounding differences compound, many steps later.
    fastrl_run, reference_run = results
    early = [abs(a["reward"] - b["reward"]) for a, b in zip(fastrl_run.history[:10], reference_run.history[:10])]
    assert max(early) < 0.05, f"fastrl and reference diverge early: reward differences {early}"

    captured = capsys.readouterr()
    out = captured.out
    assert "speed-up" in out and "policy_loss bwd" in out
    # The timing table adds up: its op rows sum to "all fastrl ops", and that plus
    # "rest" is the whole step (each row a mean over the same steps), per backend.
    rows = {}
    for line in out.splitlines():
        for label in (*demo.FASTRL_OPS, "all fastrl ops", "rest (model, optimizer, ...)", "whole training step"):
            if line.startswith(label + " "):
                rows[label] = [float(v) for v in line[len(label):].split()[-3:-1]]  # fastrl, reference ms/step
    assert len(rows) == len(demo.FASTRL_OPS) + 3, out
    for column in range(2):
        ops = sum(rows[op][column] for op in demo.FASTRL_OPS)
        assert abs(ops - rows["all fastrl ops"][column]) <= 0.001 * len(demo.FASTRL_OPS) + 1e-9, (column, rows)
        total = rows["all fastrl ops"][column] + rows["rest (model, optimizer, ...)"][column]
        assert abs(total - rows["whole training step"][column]) <= 0.002, (column, rows)
    # Captured output is not a terminal: no progress bar between the step lines.
    assert "GRPO [" not in captured.err and "\r" not in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
