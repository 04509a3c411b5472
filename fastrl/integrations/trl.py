"""TRL (1.16.x) with fastrl's kernels: ``patch()`` replaces TRL's log-prob and
entropy helpers in ``trl.trainer.utils`` with thin adapters that keep TRL's
signatures, shape rules and dtypes and run the fastrl op. ``patch(ops=[...])``
chooses; ``unpatch()`` restores TRL's.

| op | TRL function | fastrl |
| --- | --- | --- |
| ``logprobs`` | ``selective_log_softmax(logits, index, temperature=1.0, row_mask=None)`` | ``logprobs_from_logits`` |
| ``entropy`` | ``entropy_from_logits(logits, chunk_size=128)`` | ``entropy_from_logits`` |
| ``logprobs_and_entropy`` | ``selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0, row_mask=None)`` | ``logprobs_and_entropy`` |
| ``fused_lm_head`` | ``_ChunkedLogProbFunction`` (``add_fused_lm_head``'s ``ChunkedLogProbFunction.apply``) | ``linear_logprobs_and_entropy`` |

Each is replaced in ``trl.trainer.utils`` and in every loaded module that imported
it by name (in TRL 1.16 the trainers that call them: ``trl.experimental.cpo``,
``orpo``, ``sdpo``, ``sdft``, ``a2po``, ``tpo``); modules imported later take the
replacement from ``trl.trainer.utils``. TRL 1.16's ``GRPOTrainer`` scores tokens
with its own fused LM head (``add_fused_lm_head``, which never materialises the
logits): its ``_ChunkedLogProbFunction`` is replaced by a class whose ``apply``
runs ``fastrl.linear_logprobs_and_entropy`` for the outputs it asks for (log-probs,
entropy); the others (``log_sum_sq_probs``, ``mean_logits``, ``is_top1``), a
DeepSpeed ZeRO-3 head and a non-positive temperature run TRL's own. TRL forms each
tile's logits in the compute dtype (bf16 under bf16 autocast), fastrl in float32
from the GEMM's sums, so under bf16 the patched log-probs are the more exact ones;
in float32 the two agree to float32 rounding. GRPOTrainer computes its loss and KL
inline, so there is no TRL policy-loss or KL function to replace (README: how TRL's
loss types map onto ``fastrl.policy_loss``).

TRL's conventions kept:

- ``index`` of shape ``(...)`` gives one log-prob per position, of shape ``(..., K)``
  K of them (top-K), each ``log_softmax(logits / temperature)[index]``. With K, fastrl
  computes one log-prob per row at the row's largest logit and adds the logit
  differences: ``logp[i] = (x[i] - x[argmax]) / T + logp[argmax]``, exact and
  differentiable (the gradient of the gather is a ``[..., V]`` tensor, as in TRL).
- ``row_mask`` (shape of ``index``): positions where it is 0 give 0 (log-prob and
  entropy) and no gradient, and their index is never read.
- The result's dtype is TRL's: float32 where TRL would run its own Triton kernel
  (CUDA / XPU, 16- or 32-bit logits, ``index`` of shape ``(...)``), otherwise the
  logits' dtype (TRL's ``log_softmax`` path), even though fastrl computes in float32.
- ``temperature`` must be positive (TRL raises ``ValueError`` otherwise, and still does).
- ``chunk_size`` is not needed (fastrl never allocates an ``[N, V]`` temporary) and is
  ignored once it is a positive int.

Where fastrl's semantics intentionally differ from TRL's: ``-inf`` logits (a masked
vocabulary) give a finite entropy where TRL's ``exp(logp) * logp`` gives NaN, and a
label of -100 (outside ``row_mask``) gives 0 where TRL's gather fails.

Half precision: fastrl computes in float32 and rounds the result once, so a bf16 /
fp16 log-prob or entropy is the exact value rounded to that dtype (half an ulp at
most). TRL computes ``log_softmax`` and the entropy's sum in the logits' dtype and
rounds at every step, and TRL's own tests pin that rounding (``torch.equal`` on bf16
results): they fail against the patch, whose results are not TRL's bit for bit but
more accurate. In float32 the two agree to float32 rounding.

Calls fastrl does not reproduce exactly run TRL's own function instead (counted in
``fastrl.integrations.fallbacks``, announced once per reason with a
``FallbackWarning``): logits that are not floating or not on a CPU / CUDA device,
an ``index`` whose leading dimensions are not the logits' (TRL broadcasts), a
``row_mask`` not of ``index``'s shape, ``(..., K)`` indices in
``selective_log_softmax_and_entropy`` (TRL takes ``(...)`` there), a temperature
that is not a positive finite number, and every call fastrl's argument checks
reject (TRL then raises its own error, or computes).
"""

from __future__ import annotations

import inspect

import torch

import fastrl

from . import Framework, Target, UnsupportedVersionError, delegate, first_reason, temperature_reason, tensor_reason
from . import patch as _patch
from . import patched as _patched
from . import unpatch as _unpatch

__all__ = ["FRAMEWORK", "OPS", "patch", "patched", "unpatch"]

_NAME = "trl"
_UTILS = "trl.trainer.utils"


def _fp32_kernel(env):
    """``fp32(logits, index=None, row_mask=None)``: whether TRL would run its own
    Triton kernel (which returns float32) on these tensors."""
    kernel_available, supported = env.get("is_triton_available"), env.get("_supports_trl_loss_kernel")
    if kernel_available is None or supported is None:
        return lambda logits, index=None, row_mask=None: False
    # TRL asks transformers on every call whether Triton imports, and that logs: under torch.compile a graph
    # break, with fullgraph=True an error. The answer is the process's: asked once per trace, outside the graph.
    triton = torch.compiler.assume_constant_result(lambda: bool(kernel_available()))
    return lambda logits, index=None, row_mask=None: triton() and bool(supported(logits, index, row_mask))


def _index_reason(logits, index, row_mask, *, allow_k: bool) -> str | None:
    """None when ``index`` is ``logits.shape[:-1]`` (or, with ``allow_k``, that plus
    a trailing K) and ``row_mask`` is absent or of ``index``'s shape."""
    if not isinstance(index, torch.Tensor):
        return "index is not a tensor"
    lead = logits.shape[:-1]
    if index.shape != lead and not (allow_k and index.dim() == logits.dim() and index.shape[:-1] == lead):
        return "index's leading dimensions are not the logits' (TRL broadcasts)"
    if row_mask is not None and (not isinstance(row_mask, torch.Tensor) or row_mask.shape != index.shape):
        return "row_mask is not a tensor of index's shape"
    return None


def _labels(index, row_mask):
    """index with -100 (fastrl's ignore_index) where row_mask is 0."""
    return index if row_mask is None else index.masked_fill(row_mask == 0, -100)


def _selective_log_softmax(original):
    fp32_kernel = _fp32_kernel(original.__globals__)

    def selective_log_softmax(logits, index, temperature=1.0, row_mask=None):
        args = (logits, index, temperature, row_mask)
        reason = first_reason(tensor_reason(logits=logits), temperature_reason(temperature))
        if reason is None:
            reason = _index_reason(logits, index, row_mask, allow_k=True)

        def compute():
            dtype = torch.float32 if fp32_kernel(logits, index, row_mask) else logits.dtype
            if index.shape == logits.shape[:-1]:
                out = fastrl.logprobs_from_logits(logits, _labels(index, row_mask), temperature=temperature)
                return out.to(dtype)
            # (..., K): log_softmax(z)[i] = (x[i] - x[a]) / T + log_softmax(z)[a], a = the row's argmax
            # (never a -inf logit), from one fastrl log-prob per row and two gathers.
            anchor = logits.detach().argmax(dim=-1)
            anchor_logp = fastrl.logprobs_from_logits(logits, anchor, temperature=temperature)
            safe = index if row_mask is None else index.masked_fill(row_mask == 0, 0)
            # One gather (one [..., V] scatter in its backward) for the K tokens and the anchor.
            gathered = logits.gather(-1, torch.cat([safe, anchor.unsqueeze(-1)], dim=-1)).to(anchor_logp.dtype)
            chosen, top = gathered[..., :-1], gathered[..., -1:]
            out = (chosen - top) / temperature + anchor_logp.unsqueeze(-1)
            if row_mask is not None:
                out = out.masked_fill(row_mask == 0, 0.0)
            return out.to(dtype)

        return delegate(_NAME, "selective_log_softmax", original, args, {}, compute, reason)

    return selective_log_softmax


def _entropy_from_logits(original):
    fp32_kernel = _fp32_kernel(original.__globals__)

    def entropy_from_logits(logits, chunk_size=128):
        reason = tensor_reason(logits=logits)
        if reason is None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
            reason = "chunk_size is not a positive int"

        def compute():
            dtype = torch.float32 if fp32_kernel(logits) else logits.dtype
            return fastrl.entropy_from_logits(logits).to(dtype)

        return delegate(_NAME, "entropy_from_logits", original, (logits, chunk_size), {}, compute, reason)

    return entropy_from_logits


def _selective_log_softmax_and_entropy(original):
    fp32_kernel = _fp32_kernel(original.__globals__)

    def selective_log_softmax_and_entropy(logits, index, entropy_requires_grad=True, temperature=1.0, row_mask=None):
        args = (logits, index, entropy_requires_grad, temperature, row_mask)
        reason = first_reason(tensor_reason(logits=logits), temperature_reason(temperature))
        if reason is None:
            reason = _index_reason(logits, index, row_mask, allow_k=False)

        def compute():
            dtype = torch.float32 if fp32_kernel(logits, index, row_mask) else logits.dtype
            logp, entropy = fastrl.logprobs_and_entropy(logits, _labels(index, row_mask), temperature=temperature)
            if not entropy_requires_grad:
                entropy = entropy.detach()
            if row_mask is not None:
                entropy = entropy.masked_fill(row_mask == 0, 0.0)
            return logp.to(dtype), entropy.to(dtype)

        return delegate(_NAME, "selective_log_softmax_and_entropy", original, args, {}, compute, reason)

    return selective_log_softmax_and_entropy


_FUSED_OUTPUTS = ("log_probs", "entropy")


def _fused_lm_head(original):
    """``trl.trainer.utils._ChunkedLogProbFunction`` (TRL's fused LM head, which
    ``add_fused_lm_head`` and so GRPOTrainer call) as a class whose ``apply``
    runs ``fastrl.linear_logprobs_and_entropy``: the same 5-tuple (log-probs,
    entropy or None, and None for the three outputs fastrl does not compute)."""
    original_outputs = inspect.signature(original.forward).parameters["outputs"].default

    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=original_outputs):  # fmt: skip
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
        reason = first_reason(tensor_reason(hidden=hidden, weight=weight, bias=bias), temperature_reason(temperature))
        if reason is None and not set(outputs) <= set(_FUSED_OUTPUTS):
            reason = f"outputs {sorted(set(outputs) - set(_FUSED_OUTPUTS))} are not computed by fastrl"
        if reason is None and hasattr(weight, "ds_id"):
            reason = "the LM head is a DeepSpeed ZeRO-3 parameter (TRL gathers it again in its backward)"

        def compute():
            logp, entropy = fastrl.linear_logprobs_and_entropy(
                hidden, weight, targets, bias=bias, temperature=float(temperature), with_entropy="entropy" in outputs,
                logit_scale=logit_scale, softcap=final_logit_softcapping,
            )  # fmt: skip
            return logp, entropy, None, None, None

        return delegate(_NAME, "ChunkedLogProbFunction.apply", original.apply, args, {}, compute, reason)

    # patch() compares a replacement's parameters with the original's; a class's are
    # (*args, **kwargs), so compare apply with TRL's forward (less ctx) here.
    theirs = list(inspect.signature(original.forward).parameters.items())[1:]
    ours = list(inspect.signature(apply).parameters.items())
    if [(n, p.default) for n, p in theirs] != [(n, p.default) for n, p in ours]:
        raise UnsupportedVersionError(
            f"fastrl.integrations.trl: TRL's ChunkedLogProbFunction.forward takes {[n for n, _ in theirs]}; "
            f"fastrl's replacement takes {[n for n, _ in ours]} (fastrl patches {FRAMEWORK.supported_text})"
        )

    def __init__(self, *args, **kwargs):  # the parameters patch() compares with the class's: a Function's
        raise TypeError(f"{original.__name__} is used through its apply(), not instantiated")

    # A plain class, not a subclass of TRL's: torch.compile traces an autograd.Function's forward and backward
    # whatever its apply, so a subclass would run TRL's own head in every compiled graph.
    return type(original.__name__, (), {"apply": staticmethod(apply), "__fastrl_apply__": apply, "__init__": __init__})


FRAMEWORK = Framework(
    name=_NAME,
    display="TRL",
    distribution="trl",
    supported=((1, 16), (1, 17)),
    tested="1.16.0",
    targets=(
        Target("logprobs", _UTILS, "selective_log_softmax", _selective_log_softmax),
        Target("entropy", _UTILS, "entropy_from_logits", _entropy_from_logits),
        Target("logprobs_and_entropy", _UTILS, "selective_log_softmax_and_entropy", _selective_log_softmax_and_entropy),
        Target("fused_lm_head", _UTILS, "_ChunkedLogProbFunction", _fused_lm_head),
    ),
)
OPS = FRAMEWORK.ops


def patch(ops=None) -> dict[str, list[str]]:
    """Replaces TRL's functions of ``ops`` (default: all of :data:`OPS`) with
    fastrl's adapters wherever they are loaded; returns where, per op. Idempotent.
    Raises ``UnsupportedVersionError`` naming the installed TRL when it is not
    1.16.x or its functions' layout differs."""
    return _patch(FRAMEWORK, ops)


def unpatch(ops=None) -> None:
    """Restores TRL's own functions (of ``ops``, default all) everywhere."""
    _unpatch(FRAMEWORK, ops)


def patched() -> list[str]:
    """The TRL ops patched now."""
    return _patched(FRAMEWORK)[_NAME]
