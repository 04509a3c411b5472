"""OpenRLHF (0.11.x) with fastrl's kernels: ``patch()`` replaces OpenRLHF's
functions below with thin adapters that keep OpenRLHF's signatures, dtypes and
return conventions and run the fastrl op. ``patch(ops=[...])`` chooses;
``unpatch()`` restores OpenRLHF's.

| op | OpenRLHF function | fastrl |
| --- | --- | --- |
| ``logprobs`` | ``openrlhf.models.utils.log_probs_from_logits(logits, labels, temperature=1.0)`` | ``logprobs_from_logits`` |
| ``entropy`` | ``openrlhf.models.utils.compute_entropy(logits)`` (a ``torch.compile``) | ``entropy_from_logits`` |
| ``kl`` | ``openrlhf.models.utils.compute_approx_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1", unbiased_gradient=False)`` | ``kl_penalty`` |
| ``agg_loss`` | ``openrlhf.models.loss.aggregate_loss(loss, loss_mask, token_level_loss=True, dp_size=1, batch_num_tokens=None, global_batch_size=None)`` | ``agg_loss`` |
| ``policy_loss`` | ``openrlhf.models.loss.PolicyLoss.forward`` (the class's method: instances built before the patch use it too) | ``policy_loss`` |

The functions are replaced in their modules and in every loaded module that
imported them by name (``openrlhf.models.actor``, ``openrlhf.trainer.ray.ppo_actor``,
``openrlhf.trainer.ppo_utils.experience_maker``, ... whichever are loaded); the loss
modules' own ``SFTLoss`` / ``ValueLoss`` then aggregate with fastrl too.
The two modules are imported through ``openrlhf.models`` as OpenRLHF does. That
package's ``__init__`` also imports the Actor and the reward / critic models, which
need flash-attn (a CUDA build; OpenRLHF's own requirements pin it), peft and
transformers. Where that import fails for a missing module (a machine without
CUDA, where OpenRLHF's models cannot run but its losses can), ``patch()`` loads
the two modules themselves from the installed OpenRLHF, under their own names
(``load_loss_modules``): the same files, run with their own imports (torch and
deepspeed), only ``openrlhf/models/__init__.py`` is not run. Code that then does
``from openrlhf.models.utils import compute_approx_kl`` gets them (and the patch).

OpenRLHF's conventions kept:

- ``log_probs_from_logits`` divides the caller's logits in place by ``temperature``
  when it is not 1 (``logits.div_``), as OpenRLHF does, and returns the logits' dtype
  (float32 from flash-attn for float64 logits when flash-attn is importable).
- ``compute_entropy`` returns the logits' dtype.
- ``compute_approx_kl`` returns float32 (OpenRLHF casts with ``.float()``); k1 / k2 / k3
  with OpenRLHF's clamp of the value to [-10, 10] (k3's own clamps coincide with
  fastrl's ``"k3"``), and with ``unbiased_gradient=True`` and no ``log_probs_old``
  fastrl's straight-through ``"k3+"`` (k3's value, k2's gradient).
- ``aggregate_loss`` / ``PolicyLoss``: ``token_level_loss=True`` is fastrl's
  ``"token-mean"`` (over ``batch_num_tokens``, times ``dp_size``, when given; else the
  local masked mean, ``dp_size`` ignored, as in OpenRLHF), ``False`` is
  ``"seq-mean-token-mean"`` (over ``global_batch_size`` likewise).
- Every result has the dtype OpenRLHF's own arithmetic gives: a float mask takes
  part in its type promotion (bf16 losses with a float32 mask give float32), found
  by running OpenRLHF's function on meta tensors (``integrations.result_dtype``).
- ``PolicyLoss.forward`` returns OpenRLHF's 5-tuple ``(loss, clip_ratio, ppo_kl,
  vllm_kl, is_filter_ratio)``: 0-d tensors (no host sync), the last two ``None``
  (no rollout correction); ``dual_clip`` is fastrl's ``clip_ratio_c``. ``ppo_kl`` is
  OpenRLHF's metric, the masked mean of the log-ratio ``old_log_probs - log_probs``
  unclamped (only the ratio in the loss is clamped to +-20), formed by OpenRLHF's own
  ``masked_mean``; fastrl's ``ppo_kl`` (veRL's) averages the clamped log-ratio.

Where fastrl's semantics intentionally differ from OpenRLHF's (README, "Policy loss
and KL semantics"), the patched functions follow fastrl's: a token outside the mask
is ignored entirely (OpenRLHF multiplies, so NaN there spreads); x / 0 := 0 (an
all-masked batch gives loss and metrics 0, OpenRLHF NaN); ``-inf`` logits
give a finite entropy (OpenRLHF: NaN).

Calls fastrl does not reproduce exactly run OpenRLHF's own code instead (counted in
``fastrl.integrations.fallbacks``, announced once per reason with a
``FallbackWarning``): ``PolicyLoss`` with ``policy_loss_type="gspo"`` (OpenRLHF's
sequence ratio is differentiated through the mean, fastrl's GSPO ratio is
straight-through) or with train / rollout correction on (``is_correction_level``
not ``"off"``); ``compute_approx_kl`` with ``unbiased_gradient=True`` and
``log_probs_old`` (an importance-weighted gradient) or with a k1 / k2 estimator;
a ``None`` mask; tensors of different shapes (broadcasting), not floating or not
on a CPU / CUDA device; a non-bool mask holding values other than 0 and 1 (told on
CPU, and on CUDA only under ``FASTRL_CHECKS=1``; OpenRLHF's masks are bool); old log-probs or
advantages that require grad; and every call fastrl's argument checks reject.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from types import ModuleType

import torch

import fastrl

from . import (
    Framework,
    Target,
    constant_reason,
    delegate,
    first_reason,
    mask_reason,
    original_of,
    promoted,
    result_dtype,
    same_shape_reason,
    stand_in,
    tensor_reason,
)
from . import patch as _patch
from . import patched as _patched
from . import unpatch as _unpatch

__all__ = ["FRAMEWORK", "OPS", "load_loss_modules", "patch", "patched", "unpatch"]

_NAME = "openrlhf"
_UTILS = "openrlhf.models.utils"
_LOSS = "openrlhf.models.loss"


def load_loss_modules() -> tuple[ModuleType, ModuleType]:
    """``openrlhf.models.utils`` and ``openrlhf.models.loss``, the modules that hold
    the functions :func:`patch` replaces: imported through ``openrlhf.models``, or,
    when that package's ``__init__`` fails for a missing module (flash-attn, peft,
    transformers: what its Actor and models need), loaded from their files in the
    installed OpenRLHF under their own names, their own imports (torch, deepspeed)
    real. Raises the ImportError of those imports when they fail too."""
    try:
        return importlib.import_module(_UTILS), importlib.import_module(_LOSS)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] == "openrlhf":  # not OpenRLHF 0.11's layout
            raise
        package_error = error
    if all(name in sys.modules for name in (_UTILS, _LOSS)):
        return sys.modules[_UTILS], sys.modules[_LOSS]
    spec = importlib.util.find_spec("openrlhf")
    directory = os.path.join(next(iter(spec.submodule_search_locations)), "models")
    for name in (_UTILS, _LOSS):  # loss imports masked_mean from .utils: utils first
        if name in sys.modules:
            continue
        path = os.path.join(directory, name.rsplit(".", 1)[1] + ".py")
        if not os.path.isfile(path):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException as error:
            del sys.modules[name]
            raise ImportError(
                f"fastrl.integrations.openrlhf: importing {name} failed: {error} (openrlhf.models itself "
                f"failed first: {package_error})"
            ) from error
    return sys.modules[_UTILS], sys.modules[_LOSS]


@functools.cache
def _flash_attn_importable() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _agg(token_level_loss, dp_size, batch_num_tokens, global_batch_size) -> dict:
    """fastrl.agg_loss options equal to OpenRLHF's aggregate_loss arguments."""
    if token_level_loss:
        if batch_num_tokens is None:
            return {"loss_agg_mode": "token-mean"}  # the local masked mean: OpenRLHF ignores dp_size here
        return {"loss_agg_mode": "token-mean", "batch_num_tokens": batch_num_tokens, "dp_size": dp_size}
    if global_batch_size is None:
        return {"loss_agg_mode": "seq-mean-token-mean"}
    return {"loss_agg_mode": "seq-mean-token-mean", "global_batch_size": global_batch_size, "dp_size": dp_size}


def _log_probs_from_logits(original):
    def log_probs_from_logits(logits, labels, temperature=1.0):
        reason = tensor_reason(logits=logits)
        if reason is not None:
            return delegate(_NAME, "log_probs_from_logits", original, (logits, labels, temperature), {}, None, reason)
        if temperature != 1.0:
            logits.div_(temperature)  # OpenRLHF scales the caller's logits in place

        def compute():
            out = fastrl.logprobs_from_logits(logits, labels)
            flash_fp32 = logits.dtype == torch.float64 and _flash_attn_importable()
            return out.to(torch.float32 if flash_fp32 else logits.dtype)

        # The logits are scaled already: OpenRLHF's own code, if it runs, gets temperature 1.
        return delegate(_NAME, "log_probs_from_logits", original, (logits, labels), {}, compute)

    return log_probs_from_logits


def _compute_entropy(original):
    def compute_entropy(logits):
        compute = lambda: fastrl.entropy_from_logits(logits).to(logits.dtype)  # noqa: E731
        return delegate(_NAME, "compute_entropy", original, (logits,), {}, compute, tensor_reason(logits=logits))

    return compute_entropy


def _compute_approx_kl(original):
    def compute_approx_kl(log_probs, log_probs_base, log_probs_old=None, kl_estimator="k1", unbiased_gradient=False):
        args = (log_probs, log_probs_base, log_probs_old, kl_estimator, unbiased_gradient)
        reason = first_reason(
            tensor_reason(log_probs=log_probs, log_probs_base=log_probs_base),
            None if kl_estimator in ("k1", "k2", "k3") else "unknown kl_estimator (OpenRLHF raises)",
        )
        if reason is None:
            reason = same_shape_reason(log_probs, log_probs_base=log_probs_base)
        if reason is None and unbiased_gradient:
            if log_probs_old is not None:
                reason = "unbiased_gradient with log_probs_old (an importance-weighted gradient)"
            elif kl_estimator != "k3":
                reason = "unbiased_gradient with a k1 / k2 estimator (a clamped value with an unclamped gradient)"

        def compute():
            if unbiased_gradient:
                return fastrl.kl_penalty(log_probs, log_probs_base, "k3+").float()
            kl = fastrl.kl_penalty(log_probs, log_probs_base, kl_estimator).float()
            return kl if kl_estimator == "k3" else kl.clamp(min=-10, max=10)  # k3 clamps in the kernel

        return delegate(_NAME, "compute_approx_kl", original, args, {}, compute, reason)

    return compute_approx_kl


def _aggregate_loss(original):
    def aggregate_loss(loss, loss_mask, token_level_loss=True, dp_size=1, batch_num_tokens=None,
                       global_batch_size=None):  # fmt: skip
        args = (loss, loss_mask, token_level_loss, dp_size, batch_num_tokens, global_batch_size)
        reason = first_reason(tensor_reason(loss=loss), None if loss_mask is not None else "loss_mask is None")
        if reason is None:
            reason = first_reason(same_shape_reason(loss, loss_mask=loss_mask), mask_reason(loss_mask, "loss_mask"))

        def compute():
            options = _agg(token_level_loss, dp_size, batch_num_tokens, global_batch_size)
            return fastrl.agg_loss(loss, loss_mask, **options).to(result_dtype(original, *args))

        return delegate(_NAME, "aggregate_loss", original, args, {}, compute, reason)

    return aggregate_loss


def _policy_loss_forward(original):
    env = original.__globals__

    def dtypes(log_probs, old_log_probs, advantages, action_mask, aggregation):
        """The dtypes of OpenRLHF's loss and clip_ratio: its per-token loss
        aggregated by its own aggregate_loss, and masked_mean of a float32 clip
        indicator (it multiplies by the mask and divides by its sum)."""
        ndim = log_probs.dim()
        per_token = stand_in(promoted(log_probs, old_log_probs, advantages), ndim)
        return (
            result_dtype(original_of(env["aggregate_loss"]), per_token, action_mask, *aggregation),
            result_dtype(env["masked_mean"], stand_in(torch.float32, ndim), action_mask, None),
        )

    def ppo_kl_of(log_probs, old_log_probs, action_mask):
        """OpenRLHF's ppo_kl, masked_mean(-(log_probs - old_log_probs), action_mask):
        the log-ratio unclamped, in OpenRLHF's dtype, by its own masked_mean, with
        fastrl's mask semantics (module docstring): a token outside the mask is
        ignored (set to 0 first, so NaN there does not spread), and no valid token
        gives 0. The mask holds 0 / 1 only (mask_reason), so its bool is the mask."""
        valid = action_mask.bool()
        neg_log_ratio = torch.where(valid, -(log_probs - old_log_probs).detach(), 0)
        return torch.where(valid.any(), env["masked_mean"](neg_log_ratio, action_mask, None), 0)

    def forward(self, log_probs, old_log_probs, advantages, action_mask=None, rollout_log_probs=None, dp_size=1,
                batch_num_tokens=None, global_batch_size=None):  # fmt: skip
        args = (self, log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
                batch_num_tokens, global_batch_size)  # fmt: skip
        reason = None
        if getattr(self, "policy_loss_type", None) != "ppo":
            reason = "policy_loss_type is not 'ppo' (OpenRLHF's GSPO ratio has another gradient than fastrl's)"
        elif getattr(self, "is_correction_level", None) != "off":
            reason = "train / rollout correction is on (is_correction_level is not 'off')"
        elif action_mask is None:
            reason = "action_mask is None"
        if reason is None:
            reason = tensor_reason(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
        if reason is None:
            reason = first_reason(
                same_shape_reason(log_probs, old_log_probs=old_log_probs, advantages=advantages,
                                  action_mask=action_mask),
                constant_reason(old_log_probs=old_log_probs, advantages=advantages),
                mask_reason(action_mask, "action_mask"),
            )  # fmt: skip

        def compute():
            loss, metrics = fastrl.policy_loss(
                log_probs, old_log_probs, advantages, action_mask, clip_ratio_low=self.clip_eps_low,
                clip_ratio_high=self.clip_eps_high, clip_ratio_c=self.dual_clip,
                **_agg(self.token_level_loss, dp_size, batch_num_tokens, global_batch_size),
            )  # fmt: skip
            aggregation = (self.token_level_loss, dp_size, batch_num_tokens, global_batch_size)
            loss_dtype, clip_dtype = dtypes(log_probs, old_log_probs, advantages, action_mask, aggregation)
            # Not metrics["ppo_kl"]: fastrl's (veRL's) averages the log-ratio clamped to +-20, OpenRLHF's does not.
            ppo_kl = ppo_kl_of(log_probs, old_log_probs, action_mask)
            return loss.to(loss_dtype), metrics["pg_clipfrac"].to(clip_dtype), ppo_kl, None, None

        return delegate(_NAME, "PolicyLoss.forward", original, args, {}, compute, reason)

    return forward


FRAMEWORK = Framework(
    name=_NAME,
    display="OpenRLHF",
    distribution="openrlhf",
    supported=((0, 11), (0, 12)),
    tested="0.11.2",
    targets=(
        Target("logprobs", _UTILS, "log_probs_from_logits", _log_probs_from_logits),
        Target("entropy", _UTILS, "compute_entropy", _compute_entropy),
        Target("kl", _UTILS, "compute_approx_kl", _compute_approx_kl),
        Target("agg_loss", _LOSS, "aggregate_loss", _aggregate_loss),
        Target("policy_loss", _LOSS, "PolicyLoss.forward", _policy_loss_forward),
    ),
)
OPS = FRAMEWORK.ops


def patch(ops=None) -> dict[str, list[str]]:
    """Replaces OpenRLHF's functions of ``ops`` (default: all of :data:`OPS`) with
    fastrl's adapters wherever they are loaded; returns where, per op. Idempotent.
    Raises ``UnsupportedVersionError`` naming the installed OpenRLHF when it is not
    0.11.x or its functions' layout differs."""
    if importlib.util.find_spec(_NAME) is not None:  # else _patch says OpenRLHF is not installed
        try:
            load_loss_modules()
        except ModuleNotFoundError as error:
            if error.name is None or error.name.split(".")[0] != "openrlhf":
                raise
            # Another layout than 0.11's: _patch names the version and what is missing.
    return _patch(FRAMEWORK, ops)


def unpatch(ops=None) -> None:
    """Restores OpenRLHF's own functions (of ``ops``, default all) everywhere."""
    _unpatch(FRAMEWORK, ops)


def patched() -> list[str]:
    """The OpenRLHF ops patched now."""
    return _patched(FRAMEWORK)[_NAME]
