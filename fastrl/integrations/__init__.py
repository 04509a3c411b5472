"""Swap an RL framework's own log-prob, entropy, KL and policy-loss functions for
fastrl's, in place, keeping the framework's signatures and return conventions::

    import fastrl.integrations.verl
    fastrl.integrations.verl.patch()                 # every op it knows
    fastrl.integrations.verl.patch(ops=["logprobs", "policy_loss"])   # or a choice
    ...                                              # build and run the trainer
    fastrl.integrations.verl.unpatch()               # the framework's own functions again

``fastrl.integrations.verl``, ``.trl`` and ``.openrlhf`` each list their ops (``OPS``),
the functions behind each op, and where fastrl's semantics differ from the
framework's. This module is the machinery they share, written once:

- A *target* is one function of the framework (``module`` + ``qualname``, which may
  be ``Class.method``) and a factory that builds its replacement from the original:
  a thin adapter with the framework's exact signature that checks whether fastrl
  reproduces this call and delegates to the fastrl op, or else calls the original
  (:func:`delegate`).
- :func:`patch` checks the installed version against the supported range and each
  target's signature against the adapter's (:class:`UnsupportedVersionError`, naming
  the version, when either differs), then replaces the original function object
  wherever a loaded module holds it under its own name (trainers do ``from ... import
  logprobs_from_logits``; an alias or a variable holding it is left alone), in the
  class for a method, and in the registries a target names (veRL's
  ``POLICY_LOSS_REGISTRY``, every key). Modules imported later get the replacement
  from the module they import it from. Patching again is a no-op (it only swaps
  references to the original that appeared since).
- :func:`unpatch` puts the original back everywhere the replacement is found,
  including modules imported after the patch.
- Every call that runs the framework's own code instead of fastrl's is counted in
  :data:`fallbacks` and announced once per reason with a :class:`FallbackWarning`.

Call ``patch()`` before the trainer builds its workers: an object that stored a
function when it was built (``self.fn = entropy_from_logits``) keeps what it stored.
A patch lives in one Python process: with Ray (veRL, OpenRLHF) call it in every
worker process that computes log-probs or losses (at the top of the worker's code,
or in Ray's ``runtime_env`` worker set-up hook), not only in the driver.
"""

from __future__ import annotations

import collections
import functools
import importlib
import importlib.metadata
import inspect
import math
import numbers
import re
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .._validation import host_checks

__all__ = [
    "FallbackWarning",
    "Framework",
    "Target",
    "UnsupportedVersionError",
    "delegate",
    "fallbacks",
    "patch",
    "patched",
    "reset_fallbacks",
    "unpatch",
]


class UnsupportedVersionError(RuntimeError):
    """The installed framework is outside the supported version range, or its
    functions do not have the layout (module, name, signature) fastrl patches."""


class FallbackWarning(UserWarning):
    """A patched function ran the framework's own implementation for a call fastrl
    does not reproduce exactly (issued once per function and reason)."""


# "framework.function: reason" -> number of calls that ran the framework's own code.
fallbacks: collections.Counter[str] = collections.Counter()
_warned: set[str] = set()


def reset_fallbacks() -> None:
    """Clears :data:`fallbacks` and re-arms the once-per-reason warnings."""
    fallbacks.clear()
    _warned.clear()


@dataclass(frozen=True)
class Target:
    """One framework function that an op replaces.

    ``make(original)`` returns the replacement: a function with exactly the
    original's parameters (names, kinds, defaults; checked by :func:`patch`).
    ``registries`` names dicts (``"module:NAME"``) whose entries holding the
    original are replaced too. ``requires``: a package the target's module
    imports that a framework install may lack (veRL's Megatron backend needs
    megatron-core): without it :func:`patch` of every op skips the target, and
    patching its op by name raises ImportError naming the package."""

    op: str
    module: str
    qualname: str
    make: Callable[[Callable], Callable]
    registries: tuple[str, ...] = ()
    requires: str | None = None

    @property
    def where(self) -> str:
        return f"{self.module}.{self.qualname}"


@dataclass(frozen=True)
class Framework:
    """A framework fastrl can patch: its import and distribution names, the
    supported ``[low, high)`` range of (major, minor) versions, the version the
    tests ran with, and its targets."""

    name: str
    display: str
    distribution: str
    supported: tuple[tuple[int, int], tuple[int, int]]
    tested: str
    targets: tuple[Target, ...] = field(default=())

    @property
    def ops(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.op for t in self.targets))

    @property
    def supported_text(self) -> str:
        (a, b), (c, d) = self.supported
        if (c, d) == (a, b + 1):
            return f"{self.display} {a}.{b}.x"
        return f"{self.display} >= {a}.{b}, < {c}.{d}"


# ---------------------------------------------------------------------------- versions


def framework_version(framework: Framework) -> str:
    """The installed version string (package metadata, else ``<module>.__version__``)."""
    try:
        return importlib.metadata.version(framework.distribution)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        module = importlib.import_module(framework.name)
    except ImportError as error:
        raise ModuleNotFoundError(
            f"fastrl.integrations.{framework.name}: {framework.display} is not installed "
            f"(fastrl patches {framework.supported_text}; `pip install 'fastrl[{framework.name}]'`)"
        ) from error
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        raise UnsupportedVersionError(
            f"fastrl.integrations.{framework.name}: cannot tell which {framework.display} is installed "
            f"(no package metadata for {framework.distribution!r}, no {framework.name}.__version__); "
            f"fastrl patches {framework.supported_text}"
        )
    return version


def release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string: "0.9.1rc2" -> (0, 9, 1); () if none."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = release(version)
    return parts[:2] if len(parts) >= 2 else None


def check_version(framework: Framework) -> str:
    """The installed version, or :class:`UnsupportedVersionError` naming it when it
    is outside the supported range."""
    version = framework_version(framework)
    parsed = _major_minor(version)
    low, high = framework.supported
    if parsed is None or not (low <= parsed < high):
        raise UnsupportedVersionError(
            f"fastrl.integrations.{framework.name} supports {framework.supported_text} (tested with "
            f"{framework.display} {framework.tested}); the installed {framework.display} is {version}. "
            f"Install {framework.display}=={framework.tested} or leave it unpatched."
        )
    return version


def _parameters(fn: Callable) -> list[tuple[str, Any, Any]]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def _describe(params: list[tuple[str, Any, Any]]) -> str:
    out = []
    for name, kind, default in params:
        prefix = "*" if kind is inspect.Parameter.VAR_POSITIONAL else "**" if kind is inspect.Parameter.VAR_KEYWORD else ""
        out.append(f"{prefix}{name}" + ("" if default is inspect.Parameter.empty else f"={default!r}"))
    return "(" + ", ".join(out) + ")"


# ------------------------------------------------------------------------ the swapping


@dataclass
class _Patch:
    framework: str
    target: Target
    original: Any
    replacement: Any
    # (container, key, is_item, label): module globals and registry entries (dict
    # items) or class attributes swapped, and how to name the place.
    locations: list[tuple[Any, Any, bool, str]]


_ACTIVE: dict[tuple[str, str], _Patch] = {}
_LOCK = threading.RLock()


def _module_dicts() -> Iterable[tuple[str, dict]]:
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) if module is not None else None
        if isinstance(namespace, dict):
            yield name, namespace


def _swap_in_modules(swaps: dict[str, list[tuple[Any, Any]]]) -> dict[int, list[tuple[Any, Any, bool, str]]]:
    """One pass over every loaded module: a global named like a key of ``swaps``
    whose value is one of that name's objects (by identity) is replaced by its
    partner. Returns the locations per swapped object's id. (Only the original
    name: ``from m import f`` is found, ``from m import f as g`` or a variable that
    happens to hold ``f`` is left alone.)"""
    found: dict[int, list[tuple[Any, Any, bool, str]]] = collections.defaultdict(list)
    if not swaps:
        return found
    for module_name, namespace in _module_dicts():
        for key, pairs in swaps.items():
            value = namespace.get(key)
            if value is None:
                continue
            for old, new in pairs:
                if value is old:
                    namespace[key] = new
                    found[id(old)].append((namespace, key, True, f"{module_name}.{key}"))
                    break
    return found


class _MissingRequirement(ImportError):
    """A target's module cannot load without its ``requires`` package."""


def _resolve(framework: Framework, version: str, target: Target) -> tuple[Any, str, Any]:
    """(container, attribute, current object) of a target, importing its module;
    UnsupportedVersionError when the module or the name is missing,
    _MissingRequirement when the package the target requires is."""
    try:
        module = importlib.import_module(target.module)
    except ModuleNotFoundError as error:
        missing = error.name or ""
        if target.requires is not None and (missing == target.requires or missing.startswith(target.requires + ".")):
            raise _MissingRequirement(
                f"fastrl.integrations.{framework.name}: {target.where} needs {target.requires}, which does not "
                f"import here ({error})"
            ) from error
        if error.name is not None and (target.module == error.name or target.module.startswith(error.name + ".")):
            raise UnsupportedVersionError(
                f"fastrl.integrations.{framework.name}: {framework.display} {version} has no module "
                f"{target.module} (fastrl patches {framework.supported_text})"
            ) from error
        raise ImportError(
            f"fastrl.integrations.{framework.name}: importing {target.module} from {framework.display} {version} "
            f"failed: {error}"
        ) from error
    container: Any = module
    parts = target.qualname.split(".")
    for part in parts[:-1]:
        container = getattr(container, part, None)
        if container is None:
            break
    attribute = parts[-1]
    namespace = vars(container) if container is not None else {}
    if attribute not in namespace:
        raise UnsupportedVersionError(
            f"fastrl.integrations.{framework.name}: {framework.display} {version} has no {target.where} "
            f"(fastrl patches {framework.supported_text})"
        )
    return container, attribute, namespace[attribute]


def _make(framework: Framework, version: str, target: Target, original: Any) -> Any:
    replacement = target.make(original)
    expected, actual = _parameters(replacement), _parameters(original)
    if expected != actual:
        raise UnsupportedVersionError(
            f"fastrl.integrations.{framework.name}: in {framework.display} {version}, {target.where} takes "
            f"{_describe(actual)}; fastrl's replacement takes {_describe(expected)} "
            f"(fastrl patches {framework.supported_text}, tested with {framework.tested})"
        )
    functools.update_wrapper(replacement, original, assigned=("__module__", "__name__", "__qualname__"), updated=())
    replacement.__doc__ = (
        f"fastrl replacement of {target.where} (fastrl.integrations.{framework.name}); "
        f"the original is ``__wrapped__``.\n\n{original.__doc__ or ''}"
    )
    replacement.__fastrl_original__ = original
    return replacement


def _selected(framework: Framework, ops: Iterable[str] | str | None) -> list[Target]:
    if ops is None:
        names = set(framework.ops)
    else:
        if isinstance(ops, str):
            ops = [ops]
        names = set(ops)
        unknown = sorted(names - set(framework.ops))
        if unknown:
            raise ValueError(
                f"fastrl.integrations.{framework.name}: unknown op(s) {', '.join(map(repr, unknown))}; "
                f"ops are {', '.join(map(repr, framework.ops))}"
            )
    return [t for t in framework.targets if t.op in names]


def patch(framework: Framework, ops: Iterable[str] | str | None = None) -> dict[str, list[str]]:
    """Replaces the targets of ``ops`` (default: all) of ``framework``; see the module
    docstring. Returns, per op, where a replacement now stands (``module.name``,
    ``Class.method`` or ``module.DICT[key]``). Idempotent."""
    targets = _selected(framework, ops)
    with _LOCK:
        version = check_version(framework)
        pending: list[tuple[Target, Any, str, Any, Any]] = []
        # Resolve and check every target before changing anything.
        for target in targets:
            try:
                container, attribute, current = _resolve(framework, version, target)
            except _MissingRequirement:
                if ops is None:  # every op: the ones this install cannot load are left out
                    continue
                raise
            record = _ACTIVE.get((framework.name, target.where))
            if record is not None:
                pending.append((target, container, attribute, record.original, record.replacement))
                continue
            original = getattr(current, "__fastrl_original__", current)
            pending.append((target, container, attribute, original, _make(framework, version, target, original)))

        swaps: dict[str, list[tuple[Any, Any]]] = collections.defaultdict(list)
        for _, _, attribute, original, replacement in pending:
            swaps[attribute].append((original, replacement))
        found = _swap_in_modules(swaps)
        for target, container, attribute, original, replacement in pending:
            record = _ACTIVE.setdefault(
                (framework.name, target.where), _Patch(framework.name, target, original, replacement, [])
            )
            record.locations.extend(found.get(id(original), []))
            # A class: its method is in no module's globals.
            if not isinstance(container, type(sys)) and vars(container).get(attribute) is original:
                setattr(container, attribute, replacement)
                record.locations.append((container, attribute, False, target.where))
            for spec in target.registries:
                module_name, _, dict_name = spec.partition(":")
                registry = getattr(importlib.import_module(module_name), dict_name)
                for key, value in list(registry.items()):
                    if value is original:
                        registry[key] = replacement
                        record.locations.append((registry, key, True, f"{module_name}.{dict_name}[{key!r}]"))
        return {
            op: sorted({loc[3] for r in _ACTIVE.values() if r.framework == framework.name and r.target.op == op
                        for loc in r.locations})
            for op in dict.fromkeys(t.op for t in targets)
        }  # fmt: skip


def unpatch(framework: Framework, ops: Iterable[str] | str | None = None) -> None:
    """Restores the original functions of ``ops`` (default: all) wherever their
    replacements are, modules imported after the patch included. A no-op for ops
    that are not patched."""
    targets = _selected(framework, ops)
    with _LOCK:
        records = [r for t in targets if (r := _ACTIVE.pop((framework.name, t.where), None)) is not None]
        for record in records:
            for container, key, is_item, _ in record.locations:
                if is_item:
                    if container.get(key) is record.replacement:
                        container[key] = record.original
                elif vars(container).get(key) is record.replacement:
                    setattr(container, key, record.original)
            for spec in record.target.registries:
                module_name, _, dict_name = spec.partition(":")
                registry = getattr(sys.modules.get(module_name), dict_name, None)
                for key, value in list((registry or {}).items()):
                    if value is record.replacement:
                        registry[key] = record.original
        swaps: dict[str, list[tuple[Any, Any]]] = collections.defaultdict(list)
        for record in records:
            swaps[record.target.qualname.rsplit(".", 1)[-1]].append((record.replacement, record.original))
        _swap_in_modules(swaps)


def patched(framework: Framework | str | None = None) -> dict[str, list[str]]:
    """The patched ops, per framework name (or of one framework)."""
    with _LOCK:
        out: dict[str, list[str]] = {}
        for (name, _), record in _ACTIVE.items():
            out.setdefault(name, [])
            if record.target.op not in out[name]:
                out[name].append(record.target.op)
    if framework is None:
        return out
    name = framework if isinstance(framework, str) else framework.name
    return {name: out.get(name, [])}


# ------------------------------------------------------------------- adapters' helpers


def fallback(framework: str, function: str, reason: str, original: Callable, args: tuple, kwargs: dict,
             detail: str | None = None) -> Any:  # fmt: skip
    """Counts and (once per reason) announces a call that runs the framework's own
    implementation, then runs it."""
    key = f"{framework}.{function}: {reason}"
    fallbacks[key] += 1
    if key not in _warned:
        _warned.add(key)
        message = f"fastrl.integrations.{framework}: {function} runs the framework's own code: {reason}"
        warnings.warn(message + (f" ({detail})" if detail else ""), FallbackWarning, stacklevel=4)
    return original(*args, **kwargs)


def delegate(framework: str, function: str, original: Callable, args: tuple, kwargs: dict,
             compute: Callable[[], Any], reason: str | None = None) -> Any:  # fmt: skip
    """The body of a replacement: ``compute()`` (the fastrl op) unless ``reason``
    says fastrl does not reproduce this call; when fastrl's argument checks reject
    the call (ValueError / TypeError, raised before any kernel runs), the original
    runs too, so a patched function raises exactly where the framework's does."""
    if reason is not None:
        return fallback(framework, function, reason, original, args, kwargs)
    try:
        return compute()
    except (TypeError, ValueError) as error:
        return fallback(framework, function, "fastrl's argument checks reject the call", original, args, kwargs,
                        detail=f"{type(error).__name__}: {error}")  # fmt: skip


_FLOATS = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def tensor_reason(**tensors: Any) -> str | None:
    """Why fastrl cannot take these (optional) per-token / logits tensors, or None:
    each must be a floating tensor on a CPU or CUDA device (all on one device)."""
    device = None
    for name, t in tensors.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            return f"{name} is not a torch.Tensor"
        if t.dtype not in _FLOATS:
            return f"{name} is not a floating tensor"
        if t.device.type not in ("cpu", "cuda"):
            return f"{name} is on a {t.device.type} device (fastrl runs on CPU and CUDA)"
        if device is not None and t.device != device:
            return "the tensors are on different devices"
        device = t.device
    return None


def same_shape_reason(reference: torch.Tensor, **tensors: Any) -> str | None:
    """None when every given tensor has ``reference``'s shape (the framework would broadcast)."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.shape != reference.shape:
            return f"{name} has another shape than the log-probs (broadcasting)"
    return None


def constant_reason(**tensors: Any) -> str | None:
    """None unless one of these tensors requires a gradient: fastrl treats them as
    constants where the framework would differentiate through them."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            return f"{name} requires grad (fastrl treats it as a constant)"
    return None


def mask_reason(mask: Any, name: str = "mask") -> str | None:
    """None when ``mask`` is bool, or numbers all 0 or 1. Frameworks multiply by a
    weighted mask, fastrl only selects tokens. Telling reads the mask's values, so it
    happens where fastrl's own value checks run (``_validation.host_checks``: CPU, or
    CUDA under ``FASTRL_CHECKS=1``, never inside torch.compile); elsewhere a mask is
    taken as 0 / 1, so that a patched function adds no host synchronisation."""
    if not isinstance(mask, torch.Tensor):
        return f"{name} is not a tensor"
    if mask.is_complex():
        return f"{name} is complex"
    if mask.requires_grad:
        return f"{name} requires grad"
    if mask.dtype == torch.bool or not mask.numel() or not host_checks(mask.device):
        return None
    if not bool(((mask == 0) | (mask == 1)).all()):
        return f"{name} holds values other than 0 and 1 (a weighted mask)"
    return None


def temperature_reason(temperature: Any) -> str | None:
    """None when ``temperature`` is a positive finite Python number (what the
    frameworks' fused heads and log-prob helpers take)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        return "temperature is not a number"
    if not (0 < temperature < math.inf):
        return "temperature is not positive and finite"
    return None


def first_reason(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r is not None), None)


def promoted(*tensors: Any) -> torch.dtype:
    """The dtype the framework's own elementwise arithmetic on these tensors gives
    (non-floating ones, such as a bool mask, do not take part)."""
    dtypes = [t.dtype for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return functools.reduce(torch.promote_types, dtypes) if dtypes else torch.get_default_dtype()


def stand_in(dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """A meta tensor (no data) of this dtype and number of dimensions: what torch's
    type promotion sees of a tensor."""
    return torch.empty((1,) * ndim, dtype=dtype, device="meta")


def _key(value: Any) -> Any:
    """What of an argument can decide the dtype of a framework's result: a tensor's
    dtype and dimensions, a number's type (int / float; bools and strings kept)."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.dim())
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return int if isinstance(value, numbers.Integral) else float
    return value  # None, a bool, a string: kept as they are


def _from_key(key: Any) -> Any:
    if isinstance(key, tuple):
        return stand_in(*key)
    return key(1) if key in (int, float) else key


@functools.lru_cache(maxsize=1024)
def _cached_result_dtype(fn: Callable, args: tuple, kwargs: tuple) -> torch.dtype:
    out = fn(*map(_from_key, args), **{name: _from_key(key) for name, key in kwargs})
    return out.dtype


@torch.compiler.assume_constant_result
def _result_dtype(fn: Callable, args: tuple, kwargs: tuple) -> torch.dtype:
    """The cached result; under torch.compile called as it is at trace time, not traced: the result is a
    constant of the keys (traced, the framework's function on meta tensors would enter the graph, and Dynamo
    ignores an lru_cache)."""
    return _cached_result_dtype(fn, args, kwargs)


def result_dtype(fn: Callable, *args: Any, **kwargs: Any) -> torch.dtype:
    """The dtype of ``fn(*args, **kwargs)``, a framework's own tensor function,
    exactly as torch's type promotion gives it for every mix of dtypes, 0-d
    tensors and Python numbers (a float mask takes part, a ``.float()`` inside
    lifts bf16 to float32): ``fn`` runs on meta tensors (no data, no
    arithmetic) of the arguments' dtypes and dimensions, numbers replaced by 1 /
    1.0, once per such signature. For functions without data-dependent control flow."""
    return _result_dtype(fn, tuple(map(_key, args)), tuple(sorted((k, _key(v)) for k, v in kwargs.items())))


def original_of(fn: Callable) -> Callable:
    """The framework's own function behind a replacement (itself when not replaced)."""
    return getattr(fn, "__fastrl_original__", fn)
