"""pytest-benchmark view of the sampling cases: the same cases, peers and byte
models as ``python -m bench --op sampling`` (quick shapes unless
FASTRL_BENCH_FULL=1).  Run: pytest bench/bench_sampling.py"""

import pytest

from bench import pytest_benchmark_run, pytest_params, sampling


@pytest.mark.parametrize("case,impl", pytest_params(sampling))
def test_sampling(benchmark, case, impl):
    pytest_benchmark_run(benchmark, case, impl)
