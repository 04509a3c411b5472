"""Compiles every Triton kernel of fastrl for the GPUs we target, on a machine
without one (run by tests/test_triton_compile.py in a fresh process).

The Triton interpreter, which runs the kernels in CI, executes Python: it does
not apply the compiler's rules (globals must be constexpr, types must agree
across branches, ...). This script calls every launcher in fastrl.kernels with
small CPU tensors while `JITFunction.__getitem__` is replaced by a recorder, so
each launch is captured with its arguments instead of run; each distinct
(kernel, argument types, constexprs, num_warps) is then compiled to a cubin for
sm_90 (H100 / H200; the compiler's rules do not depend on the architecture)
with Triton's own ptxas. Prints one line per compiled kernel and exits non-zero
on the first failure, or if a kernel of fastrl.kernels was never launched.
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
POINTER_TYPES = {
    torch.float32: "*fp32", torch.float64: "*fp64", torch.bfloat16: "*bf16", torch.float16: "*fp16",
    torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8", torch.bool: "*i1",
}  # fmt: skip
LAUNCH_OPTIONS = ("num_warps", "num_stages")

launches: list[tuple[JITFunction, tuple, dict]] = []


class _Recorder:
    def __init__(self, fn: JITFunction):
        self.fn = fn

    def __call__(self, *args, **kwargs):
        launches.append((self.fn, args, kwargs))


JITFunction.__getitem__ = lambda self, grid: _Recorder(self)


def _exercise() -> None:
    """Calls every launcher with the flag combinations the API uses."""
    from fastrl.kernels import kl, logprobs, policy, sampling

    n, v = 3, 300
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(n, v).to(dtype)
        labels = torch.zeros(n, dtype=torch.int64)
        temps = torch.ones(n)
        for temperature, with_entropy in ((1.0, True), (temps, False)):
            _, entropy, stats = logprobs.logprobs_forward(
                x, labels, temperature, -100, with_entropy=with_entropy, with_stats=True
            )
            grad = torch.ones(n)
            logprobs.logprobs_backward(
                x, labels, temperature, -100, stats, entropy, grad, grad if with_entropy else None, torch.empty_like(x)
            )
        logprobs.logprobs_forward(x, None, 1.0, -100, with_entropy=True, with_stats=False)
        for params in ({"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.0},
                       {"temperature": temps, "top_k": torch.full((n,), 5), "top_p": temps, "min_p": temps * 0}):
            sampling.sample_forward(x, **params, seed=1, offset=0)
            sampling.sample_forward(x, **params, seed=torch.ones(n, dtype=torch.int64), offset=torch.zeros(1, dtype=torch.int64))
            _, trunc_stats = sampling.truncated_forward(x, labels, **params, with_stats=True)
            sampling.truncated_backward(x, labels, trunc_stats, torch.ones(n), torch.empty_like(x), **params)
        for temperature in (1.0, temps):
            full, full_stats = kl.full_kl_forward(x, x, temperature, with_stats=True)
            kl.full_kl_backward(x, x, temperature, full_stats, full, torch.ones(n), torch.empty_like(x))

    tokens = torch.zeros(n * 7)
    for estimator in range(4):
        kl.kl_penalty_forward(tokens, tokens, estimator=estimator)
        kl.kl_penalty_backward(tokens, tokens, tokens, estimator=estimator, straight_through=estimator == 3)

    rows = torch.zeros(n, 37)
    mask = torch.ones(n, 37, dtype=torch.uint8)
    for sequence, clip_c, estimator, extras in ((False, None, -1, False), (True, 3.0, 3, True), (False, 3.0, 0, True)):
        weights, ref, values = (rows, rows, rows) if extras else (None, None, None)
        stats = policy.policy_forward(
            rows, rows, rows, mask, weights, ref, values, estimator=estimator, clip_low=0.2, clip_high=0.2,
            clip_c=clip_c, sequence=sequence, with_pg=True,
        )  # fmt: skip
        _, _, row_weights = policy.policy_finalize(
            stats, mode=3, dp_size=1, batch_num_tokens=None, global_batch_size=None, norm=37.0, kl_coef=0.1,
            value_coef=-0.1, loss_dtype=torch.float32,
        )  # fmt: skip
        policy.policy_backward(
            rows, rows, rows, mask, weights, ref, stats, row_weights, torch.ones(()), estimator=estimator,
            straight_through=False, kl_coef=0.1, value_coef=-0.1, clip_low=0.2, clip_high=0.2, clip_c=clip_c,
            sequence=sequence, with_pg=True, grad_logp=torch.empty_like(rows), grad_values=rows if extras else None,
        )  # fmt: skip
    # agg_loss: the values alone, no PG and no KL.
    policy.policy_forward(rows, None, None, mask, None, None, rows, estimator=-1, clip_low=0.0, clip_high=0.0,
                          clip_c=None, sequence=False, with_pg=False)  # fmt: skip
    for mode, count in enumerate((None, 10.0, torch.tensor(4.0, dtype=torch.float64), None, 2.0)):
        policy.policy_finalize(
            stats, mode=mode, dp_size=2, batch_num_tokens=count, global_batch_size=count, norm=37.0, kl_coef=0.0,
            value_coef=1.0, loss_dtype=torch.float32,
        )  # fmt: skip
    for sequence, truncate in ((False, True), (True, False)):
        _, rc_stats = policy.rollout_correction_forward(
            rows, rows, mask, sequence=sequence, truncate=truncate, clip_min=0.0, clip_max=2.0, low_threshold=0.5
        )
        policy.rollout_finalize(rc_stats, sequence=sequence)


def _signature(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, options) of one captured launch."""
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    signature, constexprs = {}, {}
    for index, (name, param) in enumerate(zip(fn.arg_names, fn.params)):
        value = values[name]
        if param.is_constexpr or value is None:
            signature[name] = "constexpr"
            constexprs[(index,)] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs, options


def _all_kernels() -> set[str]:
    """The names of every kernel (a @triton.jit function named *_kernel) in fastrl.kernels."""
    import importlib
    import pkgutil

    import fastrl.kernels

    names = set()
    for info in pkgutil.iter_modules(fastrl.kernels.__path__):
        module = importlib.import_module(f"fastrl.kernels.{info.name}")
        names |= {n for n, obj in vars(module).items() if isinstance(obj, JITFunction) and n.endswith("_kernel")}
    return names


def main() -> int:
    _exercise()
    missed = _all_kernels() - {fn.__name__ for fn, _, _ in launches}
    if missed:
        print(f"FAILED: never launched by _exercise: {sorted(missed)}")
        return 1
    seen = set()
    for fn, args, kwargs in launches:
        signature, constexprs, options = _signature(fn, args, kwargs)
        key = (fn.__name__, tuple(signature.items()), tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
               tuple(options.items()))  # fmt: skip
        if key in seen:
            continue
        seen.add(key)
        try:
            triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET, options=options)
        except Exception as exc:  # noqa: BLE001 - report which kernel and why, then fail
            cause = exc.__cause__ or exc
            print(f"FAILED {fn.__name__} {options}: {type(exc).__name__}: {exc}\ncaused by: {cause!r}")
            return 1
        print(f"compiled {fn.__name__} {options} for sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main())
