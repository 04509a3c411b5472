"""pytest-benchmark view of the logprobs cases: the same cases, peers and byte
models as ``python -m bench --op logprobs`` (quick shapes unless
FASTRL_BENCH_FULL=1).  Run: pytest bench/bench_logprobs.py"""

import pytest

from bench import logprobs, pytest_benchmark_run, pytest_params


@pytest.mark.parametrize("case,impl", pytest_params(logprobs))
def test_logprobs(benchmark, case, impl):
    pytest_benchmark_run(benchmark, case, impl)
