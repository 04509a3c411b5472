"""pytest-benchmark view of the fused LM head cases: the same cases, peers and
byte models as ``python -m bench --op linear`` (quick shapes unless
FASTRL_BENCH_FULL=1).  Run: pytest bench/bench_linear.py"""

import pytest

from bench import linear, pytest_benchmark_run, pytest_params


@pytest.mark.parametrize("case,impl", pytest_params(linear))
def test_linear(benchmark, case, impl):
    pytest_benchmark_run(benchmark, case, impl)
