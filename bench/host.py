"""``python -m bench.host``: the host's share of a small call, measured on a CPU.

A call whose GPU work is a few microseconds is as fast as the Python that
launches it: on an H200 (triton 3.6) ``fastrl.sample`` at B = 1 ran 20 us on
the GPU and 462 us a call. This measures that host time without a GPU: each op
runs on CPU tensors through Triton's own launch path (the binder, the cache
key, the launch metadata, the launcher object) with a null CUDA driver
(``null_driver``): the kernels compile for sm_90 as on a GPU, at their first
call, and the launcher's last step, the driver call, does nothing. Each case is
timed twice: as it is, and with every Triton kernel of its module stubbed out
(fastrl's own Python: checks, dispatch, launch planning, workspace), so that
the difference is Triton's launch path. The GPU work and the driver's launch
itself (a few microseconds a kernel) are not in it.

The paths are the GPU's: the backend is Triton, no row is checked on the host
(``sampling._rejects_bad_rows``), and the sampler takes the histogram the
installed Triton gets on a GPU (``sampling._uses_window``). Times are the best
of several rounds (a shared machine's noise only adds), for the installed
Triton; run it under each (``build/tritons/<version>/bin/python -m bench.host``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Callable, Iterator

import torch


class _NullUtils:
    """The driver utilities a compiled kernel asks for when first launched."""

    def load_binary(self, name, kernel, shared, device):
        return 1, 1, 64, 0, 1024  # module, function, registers, spills, max threads

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}


class _NullLauncher:
    def __init__(self, src, metadata):
        pass

    def __call__(self, *args):
        pass


class _NullDriver:
    """A CUDA driver for an H100 (sm_90) whose launches do nothing."""

    utils = _NullUtils()
    launcher_cls = _NullLauncher

    def is_active(self):
        return True

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_device_interface(self):
        return torch.cuda

    def map_python_to_cpp_type(self, ty):
        return ty


@contextlib.contextmanager
def null_driver() -> Iterator[None]:
    """Triton's active driver replaced by _NullDriver, and fastrl set to take the
    Triton backend, with a GPU's paths, on CPU tensors."""
    from fastrl.kernels import _launch
    from fastrl.kernels import sampling as sampling_kernels
    from triton.runtime import driver

    import fastrl
    from fastrl import _backend, sampling

    unavailable = _backend._unavailable
    with contextlib.ExitStack() as stack:
        patch = stack.enter_context(_patches())
        # (the attribute set_active sets: reset_active would look for a GPU driver)
        patch(driver, "_active", _NullDriver())
        patch(_backend, "_unavailable", lambda name, device: None if name == "triton" else unavailable(name, device))
        patch(sampling, "_rejects_bad_rows", lambda device: False)
        patch(sampling_kernels, "_uses_window", lambda device: _launch.triton_histogram_is_slow())
        stack.enter_context(fastrl.use_backend("triton"))
        yield


@contextlib.contextmanager
def _patches() -> Iterator[Callable[[object, str, object], None]]:
    """patch(owner, name, value) for the block (unittest.mock's, undone in reverse)."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        yield lambda owner, name, value: stack.enter_context(mock.patch.object(owner, name, value))


@contextlib.contextmanager
def kernels_stubbed() -> Iterator[None]:
    """Every Triton kernel fastrl.kernels launches (``*_kernel``) is a no-op Python call."""
    import importlib

    import triton

    class _Stub:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    with _patches() as patch:
        for family in ("logprobs", "kl", "policy", "sampling"):
            module = importlib.import_module(f"fastrl.kernels.{family}")
            for name, value in list(vars(module).items()):
                if name.endswith("_kernel") and isinstance(value, triton.runtime.jit.JITFunction):
                    patch(module, name, _Stub())
        yield


def _cases() -> dict[str, Callable[[], object]]:
    """name -> one call, on the inputs the GPU benchmark draws (bench/)."""
    import fastrl

    gen = torch.Generator().manual_seed(0)
    cases = {}
    for batch in (1, 64):
        logits = (torch.randn(batch, 151936, generator=gen) * 3).bfloat16()
        cases[f"sample top-k 50 [{batch}x151936 bf16]"] = lambda x=logits: fastrl.sample(
            x, temperature=0.7, top_k=50, seed=1
        )
        cases[f"sample top-p 0.9 [{batch}x151936 bf16]"] = lambda x=logits: fastrl.sample(
            x, temperature=0.7, top_p=0.9, seed=1
        )
    logits = torch.randn(64, 151936, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 151936, (64,), generator=gen)

    def logprobs_entropy_step(x=logits, y=labels):
        logp, entropy = fastrl.logprobs_and_entropy(x, y)
        torch.autograd.grad(logp.sum() + entropy.sum(), x)  # (no .grad to accumulate into, on the CPU)

    cases["logprobs+entropy fwd+bwd [64x151936 bf16]"] = logprobs_entropy_step
    shape = (64, 8192)
    logp = (-torch.rand(shape, generator=gen) * 4).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(shape, generator=gen)
    advantages = torch.randn(64, 1, generator=gen).expand(shape).contiguous()
    mask = torch.ones(shape, dtype=torch.bool)

    def policy_step():
        loss, _ = fastrl.policy_loss(logp, old, advantages, mask)
        torch.autograd.grad(loss, logp)

    cases["policy_loss fwd+bwd [64x8192 fp32]"] = policy_step
    return cases


def best_us(call: Callable[[], object], *, calls: int, rounds: int) -> float:
    """The fastest round's time a call, in microseconds."""
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv: list[str] | None = None) -> int:
    import triton

    parser = argparse.ArgumentParser(prog="python -m bench.host", description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="calls a round (default 200)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds, the best taken (default 10)")
    parser.add_argument("--only", default="", help="the cases whose name starts with this")
    args = parser.parse_args(argv)
    from fastrl._backend import triton_interpreter

    if triton_interpreter():  # its kernels are then the interpreter's, launched another way
        parser.error("measures Triton's compiled launch path: run it without TRITON_INTERPRET")
    print(f"host time a call, triton {triton.__version__}, torch {torch.__version__}, CPU tensors, null driver")
    print(f"{'case':44s} {'call us':>9s} {'fastrl us':>9s} {'triton us':>9s}")
    with null_driver():
        for name, call in _cases().items():
            if not name.startswith(args.only):
                continue
            call()  # compiles, at the first call
            total = best_us(call, calls=args.calls, rounds=args.rounds)
            with kernels_stubbed():
                own = best_us(call, calls=args.calls, rounds=args.rounds)
            print(f"{name:44s} {total:9.1f} {own:9.1f} {total - own:9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
