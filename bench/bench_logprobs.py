"""pytest-benchmark view of the log-prob cases (the same cases, peers and byte
models as ``python -m fastrl.bench --op logprobs``).

    pytest bench/bench_logprobs.py                 # quick shapes
    FASTRL_BENCH_FULL=1 pytest bench/bench_logprobs.py
"""

import os

import pytest
import torch

from fastrl.bench import logprobs

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
QUICK = os.environ.get("FASTRL_BENCH_FULL", "0") in ("", "0")
CASES = logprobs.cases(DEVICE, quick=QUICK)
PARAMS = [
    pytest.param(case, impl, id=f"{case.op}-{'x'.join(map(str, case.shape))}-{str(case.dtype)[6:]}-{impl.name}")
    for case in CASES
    for impl in case.impls
]


@pytest.mark.parametrize("case,impl", PARAMS)
def test_logprobs(benchmark, case, impl):
    if impl.unavailable is not None:
        pytest.skip(impl.unavailable)
    fn = impl.make(case.make_inputs(DEVICE))
    benchmark.extra_info.update(min_bytes=case.min_bytes, bytes_formula=case.bytes_formula)
    if DEVICE.type == "cuda":
        benchmark.pedantic(lambda: (fn(), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)
    else:
        benchmark.pedantic(fn, rounds=5, warmup_rounds=1)
