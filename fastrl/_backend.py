"""The one dispatch point: which backend runs a call.

Backends:
  ``triton``    the Triton kernels in ``fastrl.kernels``: compiled on CUDA tensors,
                and on CPU tensors under ``TRITON_INTERPRET=1`` (how CI covers them).
  ``native``    the C++ kernels of the ``fastrl._C`` extension (CPU tensors only).
  ``reference`` the PyTorch references in ``fastrl.reference`` (the spec).

Default per call, from the tensors' device: CUDA -> triton; CPU -> native, or the
reference with one warning when the extension is missing. ``FASTRL_BACKEND`` or
the context manager :func:`use_backend` (which wins over the variable) force one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import os
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType

import torch

BACKENDS = ("triton", "native", "reference")

_forced: contextvars.ContextVar[str | None] = contextvars.ContextVar("fastrl_backend", default=None)


def _check_name(name: object, what: str) -> str:
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"{what} must be one of {', '.join(BACKENDS)}; got {name!r}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Run every fastrl op inside the block on backend ``name``
    (``"triton"``, ``"native"`` or ``"reference"``)."""
    token = _forced.set(_check_name(name, "use_backend(name)"))
    try:
        yield
    finally:
        _forced.reset(token)


def forced_backend() -> str | None:
    """The backend forced by :func:`use_backend` or ``FASTRL_BACKEND``, if any."""
    name = _forced.get()
    if name is not None:
        return name
    env = os.environ.get("FASTRL_BACKEND", "").strip()
    return _check_name(env, "the environment variable FASTRL_BACKEND") if env else None


@functools.cache
def native_module() -> ModuleType | None:
    """``fastrl._C``, or None when the extension was not built. Its CPU kernels
    run at the best x86-64 level the CPU has, or at ``FASTRL_CPU_ISA``
    (x86-64-v4, x86-64-v3 or x86-64) when that is set, to time or test a lower
    level's code on a machine that has a higher one."""
    try:
        module = importlib.import_module("fastrl._C")
    except ImportError:
        return None
    _apply_cpu_isa(module)
    return module


@functools.cache
def _apply_cpu_isa(module: ModuleType) -> None:
    level = os.environ.get("FASTRL_CPU_ISA", "")
    if level:
        try:
            module.set_cpu_isa(level)
        except ValueError as err:
            raise ValueError(f"FASTRL_CPU_ISA={level}: {err}") from None


def triton_interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def _unavailable(name: str, device: torch.device) -> str | None:
    """Why backend ``name`` cannot run on ``device``, or None if it can."""
    if name == "reference":
        return None
    if name == "native":
        if native_module() is None:
            return "the native extension fastrl._C is not built (reinstall with a C++ compiler)"
        if device.type != "cpu":
            return f"the native backend runs CPU tensors only, these are {device.type} tensors (use the triton backend)"
        return None
    if not triton_importable():
        return "triton is not installed"
    if device.type == "cpu" and not triton_interpreter():
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
    if device.type not in ("cpu", "cuda"):
        return f"the Triton backend has no kernels for {device.type} tensors"
    return None


@functools.cache
def _warn_reference_fallback(device_type: str) -> None:
    warnings.warn(
        f"fastrl: no fused kernel is available for {device_type} tensors "
        "(native extension not built or triton missing); running the PyTorch reference",
        RuntimeWarning,
        stacklevel=5,  # past _select_backend, select_backend and the op's helper: the public op
    )


# Under torch.compile the backend is chosen once, when the function is traced: dynamo must
# call _select_backend natively and take its result as a constant (tracing it graph-breaks on
# ContextVar.get). @torch.compiler.assume_constant_result tells dynamo so, but applying it
# imports torch._dynamo (about 3 s, Triton with it), which `import fastrl` must not cost. So
# it is applied on first use under compilation, when dynamo is loaded anyway: dynamo resolves
# a module's attribute with a real getattr, so in the traced select_backend the lookup
# `_MODULE._select_backend_as_constant` runs the module __getattr__ below, which marks
# _select_backend before dynamo inspects it. Eager calls never touch the decorator.
_MODULE = sys.modules[__name__]


def select_backend(device: torch.device) -> str:
    """The backend that runs an op on tensors of ``device``."""
    if torch.compiler.is_compiling():
        return _MODULE._select_backend_as_constant(device)
    return _select_backend(device)


# What __getattr__ marks on first use under compilation: select_backend's and
# constant_when_traced's functions, by the attribute name their callers look up.
_CONSTANT_WHEN_TRACED = {"_select_backend_as_constant": lambda device: _select_backend(device)}


def constant_when_traced(fn):
    """``fn`` (a function of constants: numbers, dtypes, devices) whose result
    torch.compile takes as a constant, called natively at trace time instead of
    traced, by select_backend's mechanism above: torch._dynamo is not imported
    until something compiles."""
    name = f"_{fn.__module__.replace('.', '_')}_{fn.__name__}_as_constant"
    _CONSTANT_WHEN_TRACED[name] = fn

    @functools.wraps(fn)
    def call(*args):
        if torch.compiler.is_compiling():
            return getattr(_MODULE, name)(*args)
        return fn(*args)

    return call


def __getattr__(name: str):
    if name in _CONSTANT_WHEN_TRACED:
        marked = globals()[name] = torch.compiler.assume_constant_result(_CONSTANT_WHEN_TRACED[name])
        return marked
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _select_backend(device: torch.device) -> str:
    name = forced_backend()
    if name is not None:
        why = _unavailable(name, device)
        if why is not None:
            raise RuntimeError(f"fastrl backend {name!r} was requested but cannot run: {why}")
        return name
    candidate = "triton" if device.type == "cuda" else "native"
    if _unavailable(candidate, device) is None:
        return candidate
    _warn_reference_fallback(device.type)
    return "reference"


def checks_enabled() -> bool:
    """``FASTRL_CHECKS=1``: also run the checks that need a host sync on CUDA."""
    return os.environ.get("FASTRL_CHECKS", "0") not in ("", "0")
