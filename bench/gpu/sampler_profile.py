"""Device time of each kernel that fastrl.sample launches, at the canonical sampling
shapes (V = 151936 bfloat16, T = 0.7), one program a row and split: where the
time of a slow case goes. Run on a GPU machine: python bench/gpu/sampler_profile.py
"""

from __future__ import annotations

import collections

import torch
from fastrl.kernels import sampling as kernels
from torch.profiler import ProfilerActivity, profile

import fastrl

VOCAB = 151936
CASES = [(b, f) for f in (dict(top_k=50), dict(top_p=0.9)) for b in (1, 64, 256, 1024)]


def profile_case(batch: int, filters: dict, split: bool | None, reps: int = 5) -> None:
    x = (torch.randn(batch, VOCAB, device="cuda") * 3).to(torch.bfloat16)
    original = kernels._sm_count
    if split is not None:  # force the path (the launcher's choice when None)
        kernels._sm_count = lambda device: 10**6 if split else 0
    try:
        fastrl.sample(x, temperature=0.7, seed=0, **filters)  # compile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fastrl.sample(x, temperature=0.7, seed=0, **filters)
            torch.cuda.synchronize()
    finally:
        kernels._sm_count = original
    per_kernel = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:40]] += event.device_time_total / reps
    path = {None: "auto", True: "split", False: "one"}[split]
    parts = ", ".join(f"{name} {us:.1f}" for name, us in sorted(per_kernel.items(), key=lambda kv: -kv[1]))
    print(f"B={batch:5d} {list(filters)[0]:6s} {path:5s} total {sum(per_kernel.values()):9.1f} us: {parts}", flush=True)


if __name__ == "__main__":
    for batch, filters in CASES:
        for split in (None, False, True) if batch <= 256 else (None,):
            profile_case(batch, filters, split)
