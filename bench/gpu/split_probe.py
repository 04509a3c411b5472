"""Which launch of a split row's sampler varies between identical calls: run ON a
lent GPU (bench/gpu/session.sh probe-split).

The H200 suite (triton 3.6, 2026-11-27) found top-p log-probs of split rows with
the window histogram differing between identical calls (tests/test_sampling.py,
test_full_vocabulary_rows_on_the_gpu_are_exact_and_repeatable[top-p-window]),
where the top-digit histogram's are repeatable. This repeats that case and keeps
each launch's workspace (the histogram, the rows' records, the counters and the
candidate lists, sorted: their order is the atomics') after every call, and
prints the first stage whose bytes differ between calls, with both calls' values,
and each row's list against the tokens the float64 reference keeps. It found a
histogram one to three tokens short of the list (triton 3.6 pairing tl.histogram's
values with other elements' mask: select._window_counts)."""

from __future__ import annotations

import os
import sys

import torch
from fastrl.kernels import sampling

from fastrl import reference

# PROBE_CALLS / PROBE_WINDOWS (comma-separated 0/1) shrink the run, e.g. under
# compute-sanitizer, where each launch is slow
CALLS = int(os.environ.get("PROBE_CALLS", 8 if torch.cuda.is_available() else 2))
WINDOWS = [bool(int(w)) for w in os.environ.get("PROBE_WINDOWS", "1,0").split(",")]


def _capture(window: bool, x: torch.Tensor, filters: dict):
    """(stages, outputs) of one call: each workspace tensor after the call."""
    seen = {}
    workspace = sampling._workspace

    def keep(*args, **kwargs):
        seen.update(workspace(*args, **kwargs))
        return seen

    sampling._workspace = keep
    try:
        tokens, logprobs, _, _ = sampling.sample_forward(x, temperature=0.7, top_k=0, top_p=filters.get("top_p", 1.0),
                                                      min_p=0.0, seed=0, offset=0, window=window)  # fmt: skip
    finally:
        sampling._workspace = workspace
    if x.is_cuda:
        torch.cuda.synchronize()
    counters = seen["counters"].clone()
    lists = seen["lists"].clone()
    # entries past a row's counter were never written (torch.empty): masked out
    written = torch.arange(lists.shape[-1], device=lists.device) < counters.unsqueeze(-1)
    stages = {
        "hist": seen["hist"].clone().view(x.shape[0], -1),
        "records": seen["records"].clone()[:, :5],  # (the record's last three int64 are padding)
        "counters": counters,
        "lists": torch.sort(torch.where(written, lists, torch.iinfo(torch.int64).max), dim=-1).values,
    }
    return stages, (tokens.clone(), logprobs.clone())


def main() -> int:
    gen = torch.Generator().manual_seed(0)
    # (on a CPU, through Triton's interpreter, a smaller row: a check of this script)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = (torch.randn(4, 151936 if device == "cuda" else 65536, generator=gen) * 3).bfloat16().to(device)
    filters = {"top_p": 0.9}
    kept = reference.truncated_log_distribution(x.double(), temperature=0.7, **filters).isfinite()
    status = 0
    for window in WINDOWS:
        runs = [_capture(window, x, filters) for _ in range(CALLS)]
        first, (tokens, logprobs) = runs[0]
        print(f"window={window}: logprobs {logprobs.tolist()}")
        rec = first["records"].cpu()
        for r in range(x.shape[0]):
            n_kept = int(kept[r].sum())
            lowest = float(rec[r, 3].view(torch.float64)) if rec.numel() else float("nan")
            at_or_above = int((x[r].float() >= lowest).sum())
            counter = int(first["counters"][r])
            print(f"  row {r}: kept {n_kept}, record lowest {lowest:.9g} compacted {int(rec[r, 4])}, "
                  f"counter {counter}, tokens at or above lowest {at_or_above}")  # fmt: skip
            # the list must hold every token >= its floor, and the floor every kept token
            if int(rec[r, 4]) and (counter != at_or_above or bool((x[r][kept[r]].float() < lowest).any())):
                print(f"    row {r}: the list is not the tokens at or above a floor under every kept one")
                status = 1
        for i, (stages, out) in enumerate(runs[1:], 1):
            for name, value in stages.items():
                if not torch.equal(value, first[name]):
                    rows = (value != first[name]).reshape(value.shape[0], -1).any(-1).nonzero().flatten().tolist()
                    print(f"  call {i}: {name} differs from call 0 in rows {rows}")
                    for r in rows[:2]:
                        diff = (value[r] != first[name][r]).nonzero().flatten()[:8].tolist()
                        print(f"    row {r} at {diff}: {value[r][diff].tolist()} vs {first[name][r][diff].tolist()}")
                    status = 1
                    break
            if not (torch.equal(out[0], tokens) and torch.equal(out[1], logprobs)):
                print(f"  call {i}: outputs differ: {out[1].tolist()}")
                status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
