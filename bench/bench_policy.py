"""pytest-benchmark view of the policy cases: the same cases, peers and byte
models as ``python -m bench --op policy`` (quick shapes unless
FASTRL_BENCH_FULL=1).  Run: pytest bench/bench_policy.py"""

import pytest

from bench import policy, pytest_benchmark_run, pytest_params


@pytest.mark.parametrize("case,impl", pytest_params(policy))
def test_policy(benchmark, case, impl):
    pytest_benchmark_run(benchmark, case, impl)
