"""Capture Triton launches and compile them as a GPU would, without a GPU.

A launcher of ``fastrl.kernels`` is called with meta tensors (shape, dtype and
strides, no storage: a [16384, 151936] bf16 logits tensor costs nothing) while
``JITFunction.__getitem__`` is replaced by a recorder, so each ``kernel[grid](...)``
is captured with its arguments instead of run. Each capture then goes through
Triton's own JIT argument binder (``create_function_from_signature``, which calls
``specialize_impl`` on every argument) and ``JITFunction._pack_args``, the two
steps ``JITFunction.run`` takes before it compiles: the signature, the
constexprs and the ``tt.divisibility`` attributes (16 for a 16-byte aligned
pointer and an int divisible by 16) are the ones a real launch computes. A meta
tensor's ``data_ptr()`` is 0, aligned like every fresh allocation of the CUDA
caching allocator. The cubins therefore load what a real launch loads
(``LDG.E.128`` where the alignment allows it). Works with Triton 3.6 and 3.9
(both have that binder and ``_pack_args``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
from collections.abc import Callable, Iterator

import torch


@dataclasses.dataclass
class Launch:
    """One captured ``kernel[grid](*args, **kwargs)``; ``role`` says what it is
    for (set by :func:`role` around the launcher call)."""

    fn: object  # triton.runtime.jit.JITFunction
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    role: str | None = None


_current_role: list[str | None] = [None]


@contextlib.contextmanager
def role(name: str) -> Iterator[None]:
    """Launches captured inside the block are labelled ``name``."""
    _current_role.append(name)
    try:
        yield
    finally:
        _current_role.pop()


class _Recorder:
    def __init__(self, fn, grid, sink: list[Launch]):
        self.fn, self.grid, self.sink = fn, grid, sink

    def __call__(self, *args, **kwargs):
        grid = self.grid
        if callable(grid):
            grid = grid(dict(zip(self.fn.arg_names, args)) | kwargs)
        self.sink.append(Launch(self.fn, tuple(int(g) for g in grid), args, kwargs, _current_role[-1]))


@contextlib.contextmanager
def recording() -> Iterator[list[Launch]]:
    """Every Triton launch inside the block is captured (not run) into the list yielded."""
    from triton.runtime.jit import JITFunction

    sink: list[Launch] = []
    original = JITFunction.__getitem__
    JITFunction.__getitem__ = lambda self, grid: _Recorder(self, grid, sink)
    try:
        yield sink
    finally:
        JITFunction.__getitem__ = original


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor with a shape and no storage, for a launcher that only reads its metadata."""
    return torch.empty(shape, dtype=dtype, device="meta")


@dataclasses.dataclass
class Variant:
    """A launch as JITFunction.run sees it after binding: what it compiles."""

    fn: object
    signature: dict
    constexprs: dict
    attrs: dict
    options: object  # the backend's parsed options (num_warps, ...)
    bound: dict  # argument name -> value

    @property
    def name(self) -> str:
        return self.fn.__name__

    @property
    def num_warps(self) -> int:
        return int(self.options.num_warps)

    def key(self) -> str:
        const = sorted((str(k), repr(v)) for k, v in self.constexprs.items())
        attrs = sorted((str(k), repr(v)) for k, v in self.attrs.items())
        return repr((self.name, sorted(self.signature.items()), const, attrs, repr(self.options)))

    def describe(self) -> str:
        """The constexpr flags that pick this variant, e.g. ``WITH_ENTROPY=True, BLOCK_V=8192``."""
        parts = []
        for path, value in sorted(self.constexprs.items()):
            param = self.fn.params[path[0]]
            if len(path) != 1 or not param.is_constexpr:
                continue  # a None pointer or an int 1, specialised away
            shown = value if isinstance(value, (bool, int, float)) else getattr(value, "name", value)
            parts.append(f"{param.name}={shown}")
        return ", ".join(parts)


def bind(launch: Launch, arch: int) -> Variant:
    """The signature, constexprs, specialisation attributes and options a real
    launch of ``launch`` computes on an sm_``arch`` GPU, by Triton's own binder."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return Variant(fn, signature, constexprs, attrs, options, dict(bound))


def compile_variant(variant: Variant, arch: int) -> dict:
    """Compiles a bound variant for sm_``arch`` (Triton's cache makes a repeat
    instant): its cubin, TTGIR, and the metadata the model needs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(variant.fn, variant.signature, variant.constexprs, variant.attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=variant.options.__dict__)
    md = kernel.metadata
    return {
        "cubin": kernel.asm["cubin"],
        "ttgir": kernel.asm["ttgir"],
        "name": md.name,
        "shared": int(md.shared),
        "num_warps": int(md.num_warps),
    }


# Compilation in worker processes: forked after the variants are bound, each
# worker compiles by index (JITFunctions do not pickle, their results do).
_JOBS: list[tuple[Variant, int]] = []


def _compile_job(index: int) -> tuple[int, dict | str]:
    variant, arch = _JOBS[index]
    try:
        return index, compile_variant(variant, arch)
    except Exception as exc:  # noqa: BLE001 - reported with the kernel's name by the caller
        cause = exc.__cause__ or exc
        return index, f"{type(exc).__name__}: {exc}\ncaused by: {cause!r}"


def compile_all(jobs: list[tuple[Variant, int]], workers: int, progress: Callable[[str], None] | None = None
                ) -> list[dict | str]:  # fmt: skip
    """Compiled results (or an error message) of each (variant, arch), in order."""
    _JOBS[:] = jobs
    results: list[dict | str] = [""] * len(jobs)
    if workers <= 1 or len(jobs) <= 1:
        done = map(_compile_job, range(len(jobs)))
        pool = None
    else:
        pool = multiprocessing.get_context("fork").Pool(workers)
        done = pool.imap_unordered(_compile_job, range(len(jobs)))
    try:
        for index, result in done:
            results[index] = result
            if progress is not None:
                variant, arch = jobs[index]
                status = "FAILED" if isinstance(result, str) else "compiled"
                progress(f"{status} {variant.name} [{variant.describe()}] num_warps={variant.num_warps} sm_{arch}")
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    return results


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))
