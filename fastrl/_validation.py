"""Argument checks shared by every op. Each raises ValueError / TypeError naming
the argument and what it accepts, before any kernel runs.

Checks that would need a host sync on CUDA (label ranges, tensor temperatures)
run on CPU tensors always and on CUDA tensors only under ``FASTRL_CHECKS=1``;
without it the kernels never read out of bounds and return NaN for a bad row.
Inside a function being traced by ``torch.compile`` they are skipped on every
device (they read tensor values, which a graph cannot branch on), so a compiled
function behaves as CUDA does without ``FASTRL_CHECKS``.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers

import torch

from ._backend import checks_enabled, constant_when_traced, select_backend
from ._rows import compute_dtype

LOGIT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
LABEL_DTYPES = (torch.int32, torch.int64)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def host_checks(device: torch.device) -> bool:
    """Whether the checks that read tensor values run (module docstring)."""
    return not torch.compiler.is_compiling() and (device.type == "cpu" or checks_enabled())


def check_logits(logits: object, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(logits).__name__}")
    if logits.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({_names(LOGIT_DTYPES)}); got {logits.dtype}")
    if logits.dim() == 0:
        raise ValueError(f"{name} must have shape [..., V] with at least one dimension; got a 0-d tensor")
    if logits.shape[-1] == 0:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dimension; got shape {tuple(logits.shape)}")
    return logits


# The values an int64 holds, for the integer arguments the kernels take as int64.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


# The Triton sampler sums a float32-computed row's masses in int64 units of 2^-42
# (kernels/sampling/compact.py, _mass_units): V of them, each at most 2^42, stay below
# 2^63 for V < 2^21. A longer row (no language model's vocabulary) is refused, not wrapped.
TRITON_SAMPLER_MAX_VOCAB = 1 << 21


def check_sampler_vocab(vocab: int, backend: str, name: str = "logits") -> None:
    """A ValueError for a row the Triton sampler cannot sum exactly (TRITON_SAMPLER_MAX_VOCAB)."""
    if backend == "triton" and vocab >= TRITON_SAMPLER_MAX_VOCAB:
        raise ValueError(f"{name}: the Triton sampler takes rows of fewer than 2^21 = {TRITON_SAMPLER_MAX_VOCAB} "
                         f"tokens (its exact mass sums), got {vocab}")


def check_ignore_index(value: object) -> int:
    """An int the kernels can compare labels with: int64."""
    return check_scalar(value, "ignore_index", integer=True,
                        ok=lambda v: held_within(v, torch.int64, INT64_MIN, INT64_MAX),
                        accepted="an int64, in [-2**63, 2**63)")  # fmt: skip


def check_labels(labels: object, logits: torch.Tensor, ignore_index: object, name: str = "labels") -> torch.Tensor:
    """``labels`` must be integer ``[...]`` matching ``logits[..., V]``; on CPU
    (or under FASTRL_CHECKS=1) every label must be in [0, V) or equal
    ``ignore_index`` (None: no label is ignored)."""
    return check_token_labels(labels, logits.shape[:-1], logits.shape[-1], logits.device, ignore_index, name)


def check_token_labels(
    labels: object,
    token_shape: torch.Size,
    vocab: int | None,
    device: torch.device,
    ignore_index: object,
    name: str = "labels",
    source: str = "logits",
) -> torch.Tensor:
    """:func:`check_labels` for tokens of shape ``token_shape`` over a vocabulary
    of ``vocab`` on ``device``, which ``source`` names (``"hidden"``: the fused
    LM head's tokens are hidden.shape[:-1], its vocabulary weight.shape[0]).
    ``vocab=None``: a vocabulary shard's labels, whose values the ranks' agreement
    checks against the whole vocabulary (fastrl._distributed.agree): a rank that
    raised here alone would leave the others waiting in a collective."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(labels).__name__}")
    if labels.dtype not in LABEL_DTYPES:
        raise TypeError(f"{name} must have an integer dtype ({_names(LABEL_DTYPES)}); got {labels.dtype}")
    if ignore_index is not None:
        check_ignore_index(ignore_index)
        info = torch.iinfo(labels.dtype)
        if not info.min <= ignore_index <= info.max:  # torch would wrap it in a comparison, the kernels not
            raise ValueError(f"ignore_index must fit the labels' dtype {labels.dtype} ([{info.min}, {info.max}]); "
                             f"got {ignore_index}")  # fmt: skip
    if tuple(labels.shape) != tuple(token_shape):
        raise ValueError(f"{name} must have shape {source}.shape[:-1] = {tuple(token_shape)}; got {tuple(labels.shape)}")
    if labels.device != device:
        raise ValueError(f"{name} is on {labels.device} but {source} is on {device}; they must share a device")
    if vocab is not None and labels.numel() and host_checks(labels.device):
        bad = (labels < 0) | (labels >= vocab) if vocab <= torch.iinfo(labels.dtype).max else labels < 0
        if ignore_index is not None:
            bad &= labels != ignore_index
        if bool(bad.any()):
            first = labels[bad].flatten()[0].item()
            allowed = f" or equal ignore_index={ignore_index}" if ignore_index is not None else ""
            raise ValueError(f"{name} must lie in [0, {vocab}){allowed}; found {first} ({int(bad.sum())} such labels)")
    return labels


def check_row_param(
    value: object,
    name: str,
    shape: torch.Size,
    device: torch.device,
    *,
    integer: bool,
    ok=None,
    accepted: str = "",
) -> int | float | torch.Tensor:
    """A per-row parameter: a Python number, or a tensor of numbers that
    broadcasts to ``shape`` (one value per row) on ``device``. ``ok(t)`` tells
    which values are accepted, elementwise on a tensor or on a Python number
    (so write it with operators only; ``accepted`` says it in words); tensors
    are checked where that needs no host sync (CPU, or FASTRL_CHECKS=1).
    ``ok=None`` accepts every value of the right type."""
    kind = "an int" if integer else "a float"
    tensor_kind = "an integer" if integer else "a floating"
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() == integer or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name} must be {kind} or {tensor_kind} tensor; got a tensor of {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name} is on {value.device} but logits is on {device}; they must share a device")
        try:
            broadcast_ok = torch.broadcast_shapes(value.shape, shape) == shape
        except RuntimeError:
            broadcast_ok = False
        if not broadcast_ok:
            raise ValueError(f"{name} must broadcast to the per-token shape {tuple(shape)}; got shape {tuple(value.shape)}")
        if ok is not None and value.numel() and host_checks(device):
            good = ok(value)
            if not bool(good.all()):
                raise ValueError(f"{name} must be {accepted} in every row; found {value[~good].flatten()[0].item()}")
        return value
    return check_scalar(value, name, integer=integer, ok=ok, accepted=accepted, also="or a tensor")


def check_scalar(value: object, name: str, *, integer: bool = False, ok=None, accepted: str = "", also: str = ""):
    """A Python number (an int when ``integer``; bools are refused) for which
    ``ok(value)`` holds (``accepted`` says it in words), as int or float.

    ``ok`` compares the number with Python operators only (:func:`held_within`
    for the rounding a kernel applies), never through a tensor, ``in range(...)``
    or a sort: under ``torch.compile`` the number may be symbolic (an int or
    float argument of a function compiled with ``dynamic=True``, or a local of
    a frame resumed after a graph break, made dynamic when it changed), which
    comparisons take, as guards, and those do not (dynamo's
    InternalTorchDynamoError); and ``bool`` of a tensor breaks the graph."""
    number_type = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, number_type):
        kind = "an int" if integer else "a float"
        raise TypeError(f"{name} must be {kind}{' ' + also if also else ''}; got {type(value).__name__}")
    value = int(value) if integer else float(value)
    if ok is not None and not bool(ok(value)):
        raise ValueError(f"{name} must be {accepted}; got {value}")
    return value


def check_choice(value: object, name: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(repr(c) for c in choices)}; got {value!r}")
    return value


def check_per_token(values: object, name: str, like: torch.Tensor | None = None) -> torch.Tensor:
    """A floating tensor of per-token values ``[..., L]``; with ``like``, of its
    shape and on its device."""
    if not isinstance(values, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(values).__name__}")
    if values.dtype not in LOGIT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype ({_names(LOGIT_DTYPES)}); got {values.dtype}")
    if like is None:
        if values.dim() == 0:
            raise ValueError(f"{name} must have shape [..., L] with at least one dimension; got a 0-d tensor")
        return values
    if values.shape != like.shape:
        raise ValueError(f"{name} must have the shape of the log-probs {tuple(like.shape)}; got {tuple(values.shape)}")
    if values.device != like.device:
        raise ValueError(f"{name} is on {values.device} but the log-probs are on {like.device}; they must share a device")
    return values


def check_mask(mask: object, name: str, like: torch.Tensor) -> torch.Tensor:
    """A mask of ``like``'s shape and device: bool, or numbers that are all 0 or 1
    (checked where that needs no host sync: CPU, or FASTRL_CHECKS=1)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"{name} must be bool or hold 0 / 1; got a tensor of {mask.dtype}")
    if mask.shape != like.shape:
        raise ValueError(f"{name} must have the shape of the log-probs {tuple(like.shape)}; got {tuple(mask.shape)}")
    if mask.device != like.device:
        raise ValueError(f"{name} is on {mask.device} but the log-probs are on {like.device}; they must share a device")
    if mask.dtype != torch.bool and mask.numel() and host_checks(mask.device):
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            raise ValueError(f"{name} must be bool or hold only 0 and 1; found {mask[bad].flatten()[0].item()}")
    return mask


def check_count(value: object, name: str, device: torch.device) -> int | float | torch.Tensor | None:
    """None, a non-negative finite number, or a one-element tensor holding one (a
    global token or sequence count, perhaps all-reduced on the device; its value is
    checked where that needs no host sync: on the CPU, or under FASTRL_CHECKS=1)."""
    if value is None:
        return None
    ok, accepted = (lambda v: (v >= 0) & (v < math.inf)), "non-negative and finite"
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a number or a one-element real tensor; got shape {tuple(value.shape)}")
        if host_checks(value.device) and not bool(ok(value).all()):
            raise ValueError(f"{name} must be {accepted}; got {value.item()}")
        return value.reshape(()).to(device=device, dtype=torch.float64)
    return check_scalar(value, name, ok=ok, accepted=accepted, also="or a one-element tensor")


# held_bounds' results: (dtype, low, high) -> (lo, hi).
_HELD_BOUNDS: dict[tuple[torch.dtype, float, float], tuple[float, float]] = {}


@constant_when_traced  # called at trace time: its arguments are constants, its tensors never traced
def held_bounds(dtype: torch.dtype, low: float, high: float) -> tuple[float, float]:
    """``(lo, hi)``: the numbers x that a kernel computing in ``dtype`` holds
    within ``[low, high]`` (two values of ``dtype``) are exactly ``lo <= x <= hi``
    (x a float64 or an int). A float is rounded to nearest, ties to even, as the
    C++ kernels' cast, the Triton kernels' conversion and the reference's
    ``.to`` all round: the bounds are the midpoints to the neighbours outside,
    included where the tie rounds inwards (float32's are exact in float64; for
    float64 itself the midpoint rounds to one of the two, and the bound stays
    ``low`` / ``high``). An int is held as int64 when it fits."""
    key = (dtype, low, high)
    if key not in _HELD_BOUNDS:
        if not dtype.is_floating_point:
            info = torch.iinfo(dtype)
            _HELD_BOUNDS[key] = (max(low, info.min), min(high, info.max))
        else:
            f64, inf = torch.float64, torch.tensor(math.inf, dtype=dtype)

            def bound(edge: float, outwards: torch.Tensor) -> torch.Tensor:
                edge = torch.tensor(edge, dtype=dtype)
                step = torch.nextafter(edge, outwards).to(f64) - edge.to(f64)
                if step.isinf():  # past dtype's largest value: the spacing below it continues (2**128 for float32)
                    step = edge.to(f64) - torch.nextafter(edge, -outwards).to(f64)
                return edge.to(f64) + step / 2

            lo, hi = bound(low, -inf), bound(high, inf)
            if not lo.to(dtype) >= low:
                lo = torch.nextafter(lo, torch.tensor(math.inf, dtype=f64))
            if not hi.to(dtype) <= high:
                hi = torch.nextafter(hi, torch.tensor(-math.inf, dtype=f64))
            _HELD_BOUNDS[key] = (lo.item(), hi.item())
    return _HELD_BOUNDS[key]


def held_within(value, dtype: torch.dtype, low: float, high: float):
    """Whether ``value`` (a number, or a tensor elementwise), as a kernel
    computing in ``dtype`` holds it, lies in ``[low, high]``: a float rounded to
    ``dtype`` (1e300 is inf in float32, 1e-50 is 0), an integer tensor converted
    to it (wrapping), an int beyond int64 held by no kernel. A Python number is
    compared with :func:`held_bounds`, never made a tensor (:func:`check_scalar`
    says why); a tensor is compared exactly, in float64 (int64 for an integer
    ``dtype``)."""
    lo, hi = held_bounds(dtype, low, high)
    if isinstance(value, torch.Tensor):
        value = value.to(torch.float64 if dtype.is_floating_point else dtype)
    return (value >= lo) & (value <= hi)


def flat_per_row(value: int | float | torch.Tensor, rows: torch.Size, dtype: torch.dtype) -> int | float | torch.Tensor:
    """A checked per-row parameter as the kernels take it: a Python number
    unchanged, a tensor broadcast to ``rows`` as a contiguous [N] of ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype).expand(rows).reshape(-1).contiguous()
    return value


def check_temperature(
    temperature: object, shape: torch.Size, device: torch.device, dtype: torch.dtype, *, greedy_ok: bool = False
) -> float | torch.Tensor:
    """A temperature the kernels can divide by, as a number or a floating tensor
    that broadcasts to ``shape`` (one per row) on ``device``: checked as the
    kernel will see it, rounded to ``dtype`` (the compute dtype), where it must
    lie in [finfo.tiny, finfo.max] so that it and 1 / T are finite normal numbers
    (1e300 rounds to inf in float32, and 1 / 1e-40 overflows; a subnormal T is
    refused too, as a GPU may flush it to 0). With ``greedy_ok`` an exact 0 is
    accepted too (greedy sampling); 1e-50 is not, though float32 rounds it to 0.

    A tensor that requires grad is refused where the op would run a kernel
    (native, Triton): the kernels hold T constant, as every RL framework does,
    and give it no gradient, which would go unnoticed. The reference
    differentiates through ``logits / T`` exactly, so there it is taken."""
    if isinstance(temperature, torch.Tensor) and temperature.requires_grad and torch.is_grad_enabled():
        backend = select_backend(device)
        if backend != "reference":
            raise TypeError(
                f"temperature must not require grad on the {backend} backend: its kernels hold the temperature "
                "constant (as RL frameworks do) and would give it no gradient. Pass temperature.detach(), or run "
                "under fastrl.use_backend('reference') to differentiate through it"
            )
    finfo = torch.finfo(dtype)

    def ok(t):
        in_range = held_within(t, dtype, finfo.tiny, finfo.max)
        return in_range | (t == 0) if greedy_ok else in_range

    low = "0 (greedy) or " if greedy_ok else ""
    accepted = f"{low}between {finfo.tiny:.3g} and {finfo.max:.3g} in {str(dtype).replace('torch.', '')}, the compute dtype"
    return check_row_param(temperature, "temperature", shape, device, integer=False, ok=ok, accepted=accepted)


def check_bool(value: object, name: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {type(value).__name__}")
    return value


def keyword_only_options(op=None, *, hint: str = ""):
    """Wraps a public op whose options are keyword-only so that one passed
    positionally fails naming the fix, where Python's own error ("takes 2
    positional arguments but 3 were given") does not say which names to use;
    ``hint`` adds what the caller most likely meant (another framework's
    positional signature). The trap it closes: TRL's
    ``selective_log_softmax(logits, index, temperature)`` takes the temperature
    positionally. ``@keyword_only_options`` or ``@keyword_only_options(hint=...)``;
    the signature ``inspect`` / ``help`` show stays the op's own (``functools.wraps``)."""
    if op is None:
        return functools.partial(keyword_only_options, hint=hint)
    params = inspect.signature(op).parameters.values()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    limit, name = len(positional), op.__name__
    suffix = f" ({hint})" if hint else ""

    @functools.wraps(op)
    def checked(*args, **kwargs):
        if len(args) > limit:
            one = len(keywords) == 1
            raise TypeError(
                f"{name}() takes {limit} positional argument{'' if limit == 1 else 's'} ({', '.join(positional)}) "
                f"but {len(args)} were given; {', '.join(keywords)} {'is' if one else 'are'} keyword-only: "
                f"pass {'it' if one else 'them'} by name, e.g. {name}(..., {keywords[0]}=...){suffix}"
            )
        return op(*args, **kwargs)

    return checked


def check_logprobs_arguments(logits, labels, temperature, ignore_index, sharded: bool = False):
    """The checks of the log-prob ops' arguments, labels in [0, V) or ignore_index
    (``sharded``: a vocabulary shard's, whose labels' values the ranks' agreement
    checks); returns the checked temperature."""
    check_logits(logits)
    check_ignore_index(ignore_index)
    if labels is not None:
        vocab = None if sharded else logits.shape[-1]
        check_token_labels(labels, logits.shape[:-1], vocab, logits.device, ignore_index)
    return check_temperature(temperature, logits.shape[:-1], logits.device, compute_dtype(logits))
