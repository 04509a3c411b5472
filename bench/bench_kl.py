"""pytest-benchmark view of the kl cases: the same cases, peers and byte
models as ``python -m bench --op kl`` (quick shapes unless
FASTRL_BENCH_FULL=1).  Run: pytest bench/bench_kl.py"""

import pytest

from bench import kl, pytest_benchmark_run, pytest_params


@pytest.mark.parametrize("case,impl", pytest_params(kl))
def test_kl(benchmark, case, impl):
    pytest_benchmark_run(benchmark, case, impl)
