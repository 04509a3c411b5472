"""veRL (0.9.x) with fastrl's kernels: ``patch()`` replaces veRL's functions below
with thin adapters that keep veRL's signatures, dtypes and return conventions and
run the fastrl op. ``patch(ops=[...])`` chooses; ``unpatch()`` restores veRL's.

| op | veRL function (and where it is replaced) | fastrl |
| --- | --- | --- |
| ``logprobs`` | ``verl.utils.torch_functional.logprobs_from_logits(logits, labels, inplace_backward=True)`` | ``logprobs_from_logits`` |
| ``entropy`` | ``verl.utils.torch_functional.entropy_from_logits(logits)``, ``entropy_from_logits_with_chunking(logits, chunk_size=2048)`` | ``entropy_from_logits`` |
| ``sum_pi_squared`` | ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits(logits)`` (Σπ², the optimal-token baseline's) | ``sum_pi_squared`` |
| ``kl`` | ``verl.trainer.ppo.core_algos.kl_penalty(logprob, ref_logprob, kl_penalty)`` | ``kl_penalty`` |
| ``agg_loss`` | ``verl.trainer.ppo.core_algos.agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)`` | ``agg_loss`` |
| ``policy_loss`` | ``core_algos.compute_policy_loss_vanilla`` and ``compute_policy_loss_gspo``, and their ``POLICY_LOSS_REGISTRY`` entries ``"vanilla"`` / ``"gspo"`` (what ``get_policy_loss_fn`` returns) | ``policy_loss`` |
| ``fused_lm_head`` | ``verl.utils.experimental.torch_functional.FusedLinearForPPO.forward`` and ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (``use_fused_kernels``: the torch and Triton backends of the models' ``forward``) | ``linear_logprobs_and_entropy`` |
| ``vocab_parallel`` | ``verl.utils.megatron.tensor_parallel.vocab_parallel_entropy(vocab_parallel_logits)``, ``vocab_parallel_log_probs_from_logits(logits, labels)`` and ``vocab_parallel_sum_pi_squared(vocab_parallel_logits)`` (the Megatron backend's tensor-parallel logits; only where megatron-core imports) | ``entropy_from_logits`` / ``logprobs_from_logits`` / ``sum_pi_squared`` with ``group=`` Megatron's tensor-parallel group |
| ``engine`` | ``verl.workers.engine.fsdp.transformer_impl.FSDPEngineWithLMHead.prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func)`` (veRL's FSDP engine, and the veOmni engine, which calls it through ``super()``: a micro-batch's log-probs, entropy and Σπ² from the model's logits; only where peft, which that module imports, does) and ``verl.workers.engine.automodel.transformer_impl.AutomodelEngineWithLMHead.prepare_model_outputs(self, output, output_args, micro_batch)`` (the Automodel engine's; only where nemo_automodel imports). The torchtitan engine's is not replaced: it calls the patched ``logprobs_from_logits`` and its entropy function one by one | ``logprobs_and_entropy`` / ``logprobs_from_logits``, with ``group=`` a vocabulary-sharded DTensor's mesh group |

Each is replaced in its own module and in every loaded module that imported it by
name (``verl.workers.utils.losses``, ``verl.workers.rollout.naive.naive_rollout``,
``verl.trainer.distillation.losses``, ... whichever are loaded); modules imported
later take the replacement from veRL's module. Replacing ``agg_loss`` and
``kl_penalty`` in ``core_algos`` also changes what veRL's other loss functions there
call. Patch before veRL builds its engines: an engine stores
``verl_F.entropy_from_logits`` (or its ``torch.compile``) when it is built.

Conventions kept:

- ``logprobs_from_logits`` returns float32 when veRL would take its flash-attn path
  (flash-attn importable, ``VERL_DISABLE_FLASH_ATTN_CE`` unset: veRL's default on GPU),
  else the logits' dtype, as veRL's ``log_softmax`` path does. ``inplace_backward=True``
  (veRL's default) writes the gradient into the logits' storage, as flash-attn does;
  veRL passes ``False`` where it reuses the logits (for the entropy). Labels equal to
  -100 give 0, as flash-attn's cross-entropy does.
- ``entropy_from_logits`` returns the logits' dtype, ``entropy_from_logits_with_chunking``
  the default dtype (float32), as veRL does (16-bit logits under CUDA autocast, where
  veRL's engines call them: float32, as autocast runs veRL's softmax, log_softmax and
  logsumexp in float32 there; the log-probs and Σπ² likewise); the chunking is not needed (fastrl never
  allocates an ``[N, V]`` temporary) and ``chunk_size`` is ignored.
- ``vocab_parallel_entropy`` returns the logits' dtype and
  ``vocab_parallel_log_probs_from_logits`` float32, as veRL's and Megatron's do, the
  shards being those of ``megatron.core.parallel_state``'s tensor-parallel group in
  rank order; neither writes into the logits (Megatron's cross-entropy subtracts the
  max from float32 logits in place).
- ``calculate_sum_pi_squared_from_logits`` and ``vocab_parallel_sum_pi_squared``
  return the logits' dtype, as veRL's.
- The engine's ``prepare_model_outputs`` returns veRL's ``model_output``: ``log_probs``
  and, with ``calculate_entropy``, ``entropy``, with ``calculate_sum_pi_squared``,
  ``sum_pi_squared`` (the logits' dtype), all from the one pass, nested jagged over the micro-batch's
  ``cu_seqlens``, packed (remove-padding, the static padding and Ulysses' gathered
  and stripped by veRL's own ``_gather_and_unpad_packed``) or padded (the padded
  logits are read whole and the valid positions kept: no ``torch.cat`` copy), in
  veRL's dtypes (the log-probs as ``logprobs_from_logits`` above; the entropy in the
  logits' dtype, float32 with ``entropy_from_logits_with_chunking``). It divides by
  the temperatures inside the kernel (clamped at 1e-8 as veRL does, in float32:
  veRL divides bf16 logits by the temperature rounded to bf16, and rounds the
  quotient). ``entropy_checkpointing`` and the chunked entropy need nothing (fastrl
  keeps three floats a row for the backward). The backward writes the gradient into
  the logits' storage whether or not the entropy is computed: veRL's own
  remove-padding path overwrites the model's logits already (temperature 1, no
  entropy), and fastrl reads them once for both outputs; another autograd node that
  saved them raises torch's in-place error instead of reading a gradient. Logits
  that are a DTensor sharded on the vocabulary over one mesh dimension (FSDP2 with
  tensor parallelism) are not gathered: each rank's shard goes to the sharded op,
  its first column from the mesh coordinate and ``torch.chunk``'s split.
- ``kl_penalty``, ``agg_loss`` and the policy losses return the dtype of veRL's
  arithmetic on the inputs, for every combination of dtypes: a float mask takes part
  (bf16 losses with a float32 mask give float32), and the seq-mean modes give at
  least float32 (veRL's ``.float()`` sequence mask). ``agg_loss``'s and the losses'
  are found by running veRL's own ``agg_loss`` on meta tensors
  (``integrations.result_dtype``).
- The policy losses return ``(loss, metrics)`` with ``metrics`` the Python floats veRL
  returns (``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``; read
  with one host synchronisation where veRL makes three). The vanilla loss reads
  ``clip_ratio``, ``clip_ratio_low`` / ``_high``, ``clip_ratio_c`` and
  ``global_batch_info`` from the config as veRL does. GSPO reports
  ``pg_clipfrac_lower = 0.0`` and aggregates as the installed veRL does: always with
  ``"seq-mean-token-mean"`` in veRL 0.9.0 (whatever ``loss_agg_mode`` it is given),
  with the ``loss_agg_mode`` given from veRL 0.9.1 on.

Where fastrl's semantics intentionally differ from veRL's (README, "Policy loss and
KL semantics"), the patched functions follow fastrl's:

- A token outside the mask is ignored entirely: its values may be NaN (veRL lets NaN
  through ``loss_mat * loss_mask`` in the seq-mean modes and in its gradients).
- x / 0 := 0: an all-masked batch has loss 0 (veRL: NaN in ``token-mean``).
- ``-inf`` logits (a masked vocabulary) give finite log-probs and entropies where
  veRL's ``softmax * logits`` gives NaN.
- The arithmetic is float32 inside the kernels (veRL computes in the inputs' dtype:
  bf16 inputs differ by bf16 rounding; the result is cast back to veRL's dtype).

Calls fastrl does not reproduce exactly run veRL's own function instead (counted in
``fastrl.integrations.fallbacks``, announced once per reason with a
``FallbackWarning``): tensors that are not floating or not on a CPU / CUDA device,
tensors of different shapes (veRL broadcasts), a non-bool mask holding values
other than 0 and 1 (veRL multiplies by it; told on CPU, and on CUDA only under
``FASTRL_CHECKS=1`` because it reads the mask on the host: pass bool masks), old
log-probs, advantages or rollout weights that require grad (fastrl treats them as
constants), a config that veRL's own function
asserts on or whose ``global_batch_info`` has keys ``agg_loss`` does not take,
``entropy_from_logits_with_chunking`` on logits that are not 2-D, the engine's
``use_fused_kernels`` (the model's fused head computes the log-probs: op
``fused_lm_head``; veRL raises there with ``calculate_sum_pi_squared``), distillation
(its loss reads the scaled logits), a ``pad_mode`` veRL does not take, and logits
that are a DTensor sharded otherwise, and every call
fastrl's argument checks reject (veRL then raises its own error, or computes).
``kl_penalty(..., "full")`` raises veRL's ``NotImplementedError``, with a pointer to
``fastrl.full_kl``: veRL passes per-token log-probs, which do not determine the
full-vocabulary KL.
"""

from __future__ import annotations

import inspect
import os
import types

import torch

import fastrl

from . import (
    Framework,
    Target,
    constant_reason,
    delegate,
    first_reason,
    framework_version,
    mask_reason,
    original_of,
    promoted,
    release,
    result_dtype,
    same_shape_reason,
    stand_in,
    temperature_reason,
    tensor_reason,
)
from . import patch as _patch
from . import patched as _patched
from . import unpatch as _unpatch

__all__ = ["FRAMEWORK", "OPS", "patch", "patched", "unpatch"]

_NAME = "verl"
_F = "verl.utils.torch_functional"
_CORE = "verl.trainer.ppo.core_algos"
_AGG_KEYS = frozenset({"dp_size", "batch_num_tokens", "global_batch_size", "loss_scale_factor"})
_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# veRL 0.9.0's compute_policy_loss_gspo aggregates with "seq-mean-token-mean" whatever
# loss_agg_mode it is given; from 0.9.1 on it aggregates with the loss_agg_mode given.
_GSPO_TAKES_LOSS_AGG_MODE = (0, 9, 1)


class _Unsupported(Exception):
    pass


# ----------------------------------------------------------------- log-probs, entropy


# The device types whose autocast runs softmax, log_softmax, logsumexp and sum in
# float32 (CUDA's float32 list; CPU autocast has no such entries for them).
_AUTOCAST_FLOAT32 = ("cuda",)


def _softmax_dtype(logits: torch.Tensor) -> torch.dtype:
    """The dtype veRL's softmax / log_softmax / logsumexp chains give on these
    logits: float32 for 16-bit logits under CUDA autocast (veRL's engines run
    ``prepare_model_outputs`` inside ``torch.autocast``), else the logits' dtype."""
    if (logits.dtype in (torch.float16, torch.bfloat16) and logits.device.type in _AUTOCAST_FLOAT32
            and torch.is_autocast_enabled(logits.device.type)):  # fmt: skip
        return torch.float32
    return logits.dtype


def _logprob_dtype(env: dict, logits: torch.Tensor) -> torch.dtype:
    """What veRL's ``logprobs_from_logits`` returns: float32 on its flash-attn path
    (importable and not disabled), else what its log_softmax path gives
    (``_softmax_dtype``); ``env``: the globals of veRL's ``torch_functional`` module."""
    flash = env.get("FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE", False) and (
        os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1"
    )
    return torch.float32 if flash else _softmax_dtype(logits)


def _logprobs_from_logits(original):
    env = original.__globals__

    def logprobs_from_logits(logits, labels, inplace_backward=True):
        def compute():
            return fastrl.logprobs_from_logits(logits, labels, inplace_backward).to(_logprob_dtype(env, logits))

        return delegate(_NAME, "logprobs_from_logits", original, (logits, labels, inplace_backward), {}, compute,
                        tensor_reason(logits=logits))  # fmt: skip

    return logprobs_from_logits


def _entropy_from_logits(original):
    def entropy_from_logits(logits):
        compute = lambda: fastrl.entropy_from_logits(logits).to(_softmax_dtype(logits))  # noqa: E731
        return delegate(_NAME, "entropy_from_logits", original, (logits,), {}, compute, tensor_reason(logits=logits))

    return entropy_from_logits


def _entropy_from_logits_with_chunking(original):
    def entropy_from_logits_with_chunking(logits, chunk_size=2048):
        reason = tensor_reason(logits=logits)
        if reason is None and logits.dim() != 2:
            reason = "logits are not 2-D [N, V] (veRL's chunked entropy takes [N, V] only)"
        if reason is None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0):
            reason = "chunk_size is not a positive int"
        compute = lambda: fastrl.entropy_from_logits(logits).to(torch.get_default_dtype())  # noqa: E731
        return delegate(_NAME, "entropy_from_logits_with_chunking", original, (logits, chunk_size), {}, compute, reason)

    return entropy_from_logits_with_chunking


def _sum_pi_squared(original):
    """``calculate_sum_pi_squared_from_logits`` (veRL's Σπ² for its optimal-token
    baseline): in the logits' dtype, as veRL's."""

    def calculate_sum_pi_squared_from_logits(logits):
        compute = lambda: fastrl.sum_pi_squared(logits).to(_softmax_dtype(logits))  # noqa: E731
        return delegate(_NAME, "calculate_sum_pi_squared_from_logits", original, (logits,), {}, compute,
                        tensor_reason(logits=logits))  # fmt: skip

    return calculate_sum_pi_squared_from_logits


# -------------------------------------------------------------------------- KL, agg


def _kl_penalty(original):
    def kl_penalty(logprob, ref_logprob, kl_penalty):
        args = (logprob, ref_logprob, kl_penalty)
        base = kl_penalty[:-1] if isinstance(kl_penalty, str) and kl_penalty.endswith("+") else kl_penalty
        if base == "full":
            try:
                return original(*args)
            except NotImplementedError as error:
                raise NotImplementedError(
                    "veRL's kl_penalty(..., 'full') is given per-token log-probs, which do not determine the "
                    "full-vocabulary KL; veRL leaves it unimplemented. fastrl.full_kl(logits, ref_logits) computes "
                    "it from the two policies' logits."
                ) from error
        reason = first_reason(
            tensor_reason(logprob=logprob, ref_logprob=ref_logprob),
            None if base in _ESTIMATORS else "unknown estimator (veRL raises)",
        )
        if reason is None:
            reason = same_shape_reason(logprob, ref_logprob=ref_logprob)
        compute = lambda: fastrl.kl_penalty(logprob, ref_logprob, kl_penalty).to(promoted(logprob, ref_logprob))  # noqa: E731
        return delegate(_NAME, "kl_penalty", original, args, {}, compute, reason)

    return kl_penalty


def _agg_loss(original):
    def agg_loss(loss_mat, loss_mask, loss_agg_mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                 loss_scale_factor=None):  # fmt: skip
        args = (loss_mat, loss_mask, loss_agg_mode, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
        reason = tensor_reason(loss_mat=loss_mat)
        if reason is None:
            reason = first_reason(same_shape_reason(loss_mat, loss_mask=loss_mask), mask_reason(loss_mask, "loss_mask"))

        def compute():
            loss = fastrl.agg_loss(
                loss_mat, loss_mask, loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
                global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
            )  # fmt: skip
            return loss.to(result_dtype(original, *args))

        return delegate(_NAME, "agg_loss", original, args, {}, compute, reason)

    return agg_loss


# ---------------------------------------------------------------------- policy loss


def _options(config, env, *, gspo: bool) -> dict:
    """fastrl.policy_loss options from veRL's config, read as veRL's function reads it."""
    if config is None:
        raise _Unsupported("config is None (veRL asserts)")
    if gspo:
        actor_config = env.get("ActorConfig")
        if actor_config is None or not isinstance(config, actor_config):
            raise _Unsupported("config is not an ActorConfig (veRL's GSPO asserts)")
    else:
        algo_config = env.get("AlgoConfig")
        if algo_config is not None and isinstance(config, algo_config):
            raise _Unsupported("config is an AlgoConfig (veRL asserts)")
    try:
        clip_ratio = config.clip_ratio
        low = config.clip_ratio_low if config.clip_ratio_low is not None else clip_ratio
        high = config.clip_ratio_high if config.clip_ratio_high is not None else clip_ratio
        clip_ratio_c = None if gspo else config.get("clip_ratio_c", 3.0)
        info = dict(config.global_batch_info)
    except Exception as error:  # veRL's own function fails the same way
        raise _Unsupported(f"reading the config fails ({type(error).__name__})") from error
    if set(info) - _AGG_KEYS:
        raise _Unsupported("config.global_batch_info has keys agg_loss does not take")
    return {"clip_ratio_low": low, "clip_ratio_high": high, "clip_ratio_c": clip_ratio_c, **info}


def _policy_loss(original, *, gspo: bool):
    env = original.__globals__
    name = "compute_policy_loss_gspo" if gspo else "compute_policy_loss_vanilla"
    # The installed veRL's semantics: its GSPO took no loss_agg_mode before 0.9.1.
    fixed_mode = gspo and release(framework_version(FRAMEWORK)) < _GSPO_TAKES_LOSS_AGG_MODE

    def loss_dtype(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, mode, info):
        """The dtype veRL's function returns: its per-token loss's (GSPO's sequence
        ratio divides by the mask's sums, so a float mask takes part), aggregated by
        veRL's own agg_loss (which multiplies by the mask)."""
        per_token = promoted(log_prob, old_log_prob, advantages, rollout_is_weights, response_mask if gspo else None)
        return result_dtype(original_of(env["agg_loss"]), stand_in(per_token, log_prob.dim()), response_mask, mode,
                            **info)  # fmt: skip

    def body(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
        args = (old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)
        try:
            options = _options(config, env, gspo=gspo)
            reason = None
        except _Unsupported as unsupported:
            options, reason = {}, str(unsupported)
        if reason is None:
            reason = tensor_reason(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages,
                                   rollout_is_weights=rollout_is_weights)  # fmt: skip
        if reason is None:
            reason = first_reason(
                same_shape_reason(log_prob, old_log_prob=old_log_prob, advantages=advantages,
                                  response_mask=response_mask, rollout_is_weights=rollout_is_weights),
                constant_reason(old_log_prob=old_log_prob, advantages=advantages, rollout_is_weights=rollout_is_weights),
                mask_reason(response_mask, "response_mask"),
            )  # fmt: skip

        def compute():
            mode = "seq-mean-token-mean" if fixed_mode else loss_agg_mode
            loss, metrics = fastrl.policy_loss(
                log_prob, old_log_prob, advantages, response_mask, ratio_level="sequence" if gspo else "token",
                loss_agg_mode=mode, rollout_is_weights=rollout_is_weights, **options,
            )  # fmt: skip
            values = torch.stack([metrics["pg_clipfrac"], metrics["ppo_kl"], metrics["pg_clipfrac_lower"]])
            # One host sync for the three floats veRL returns. torch.compile cannot trace tolist() of a float tensor:
            # there .item() each, as veRL does (captured in the graph with fullgraph=True, else a graph break there).
            if torch.compiler.is_compiling():  # (written out: a break in a generator would skip the whole frame)
                clipfrac, ppo_kl, clipfrac_lower = values[0].item(), values[1].item(), values[2].item()
            else:
                clipfrac, ppo_kl, clipfrac_lower = values.tolist()
            info = {k: v for k, v in options.items() if k in _AGG_KEYS}
            dtype = loss_dtype(log_prob, old_log_prob, advantages, response_mask, rollout_is_weights, mode, info)
            return loss.to(dtype), {
                "actor/pg_clipfrac": clipfrac,
                "actor/ppo_kl": ppo_kl,
                "actor/pg_clipfrac_lower": 0.0 if gspo else clipfrac_lower,
            }

        return delegate(_NAME, name, original, args, {}, compute, reason)

    if gspo:

        def compute_policy_loss_gspo(old_log_prob, log_prob, advantages, response_mask,
                                     loss_agg_mode="seq-mean-token-mean", config=None, rollout_is_weights=None):  # fmt: skip
            return body(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

        return compute_policy_loss_gspo

    def compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                    config=None, rollout_is_weights=None):  # fmt: skip
        return body(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights)

    return compute_policy_loss_vanilla


_REGISTRY = (f"{_CORE}:POLICY_LOSS_REGISTRY",)

_EXPERIMENTAL = "verl.utils.experimental.torch_functional"
_LINEAR_CE = "verl.utils.kernel.linear_cross_entropy"


def _head_reason(hidden, weight, temperature) -> str | None:
    reason = first_reason(tensor_reason(hidden=hidden, weight=weight), temperature_reason(temperature))
    if reason is None and hidden.dim() not in (2, 3):
        reason = "hidden_states is not 2-D or 3-D"
    return reason


def _fused_linear_for_ppo(original):
    """``FusedLinearForPPO.forward`` (veRL's fused LM head with
    ``use_fused_kernels`` and the torch backend): float32 log-probs, the entropy in
    the hidden states' dtype, shaped like the labels."""

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        args = (self, hidden_states, vocab_weights, input_ids, temperature)

        def compute():
            logp, entropy = fastrl.linear_logprobs_and_entropy(
                hidden_states, vocab_weights, input_ids.long(), temperature=float(temperature)
            )
            return logp, entropy.to(hidden_states.dtype)

        reason = _head_reason(hidden_states, vocab_weights, temperature)
        return delegate(_NAME, "FusedLinearForPPO.forward", original, args, {}, compute, reason)

    return forward


def _linear_cross_entropy(original):
    """``linear_cross_entropy`` (``LinearCrossEntropy.apply``, veRL's fused LM head
    with the Triton backend): float32 log-probs and entropy, one per token
    (flattened), for ``reduction="none"`` without a process group; the summed and
    averaged reductions and the vocabulary-parallel group run veRL's own."""
    names = list(inspect.signature(original.__self__.forward).parameters)[1:]

    def linear_cross_entropy(*args, **kwargs):
        bound = dict(zip(names, args)) | kwargs
        hidden, weight = bound.get("hidden"), bound.get("weight")
        temperature, reduction = bound.get("temperature", 1.0), bound.get("reduction", "none")
        reason = _head_reason(hidden, weight, temperature)
        if reason is None and reduction != "none":
            reason = f"reduction {reduction!r} (fastrl returns per-token values)"
        if reason is None and bound.get("dist_process_group") is not None:
            reason = "a vocabulary-parallel process group"

        def compute():
            logp, entropy = fastrl.linear_logprobs_and_entropy(
                hidden, weight, bound["labels"].long(), temperature=float(temperature)
            )
            return logp.reshape(-1), entropy.reshape(-1)

        return delegate(_NAME, "linear_cross_entropy", original, args, kwargs, compute, reason)

    return linear_cross_entropy


_TP = "verl.utils.megatron.tensor_parallel"


def _tensor_parallel_group():
    """Megatron's tensor-parallel group, which veRL's Megatron backend shards the
    vocabulary over."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _vocab_parallel_entropy(original):
    """``vocab_parallel_entropy`` (veRL's Megatron backend): the entropy of the
    whole vocabulary from this rank's shard, in the logits' dtype."""

    def vocab_parallel_entropy(vocab_parallel_logits):
        def compute():
            entropy = fastrl.entropy_from_logits(vocab_parallel_logits, group=_tensor_parallel_group())
            return entropy.to(vocab_parallel_logits.dtype)

        reason = tensor_reason(vocab_parallel_logits=vocab_parallel_logits)
        return delegate(_NAME, "vocab_parallel_entropy", original, (vocab_parallel_logits,), {}, compute, reason)

    return vocab_parallel_entropy


def _vocab_parallel_sum_pi_squared(original):
    """``vocab_parallel_sum_pi_squared`` (veRL's Megatron backend): Σπ² of the
    whole vocabulary from this rank's shard, in the logits' dtype; never writes
    into the logits (veRL's promises that too)."""

    def vocab_parallel_sum_pi_squared(vocab_parallel_logits):
        def compute():
            result = fastrl.sum_pi_squared(vocab_parallel_logits, group=_tensor_parallel_group())
            return result.to(vocab_parallel_logits.dtype)

        reason = tensor_reason(vocab_parallel_logits=vocab_parallel_logits)
        return delegate(_NAME, "vocab_parallel_sum_pi_squared", original, (vocab_parallel_logits,), {}, compute,
                        reason)  # fmt: skip

    return vocab_parallel_sum_pi_squared


def _vocab_parallel_log_probs(original):
    """``vocab_parallel_log_probs_from_logits`` (Megatron-core's
    ``-vocab_parallel_cross_entropy``): float32 log-probs of the labels."""

    def vocab_parallel_log_probs_from_logits(logits, labels):
        def compute():
            return fastrl.logprobs_from_logits(logits, labels, group=_tensor_parallel_group())

        reason = tensor_reason(logits=logits)
        return delegate(_NAME, "vocab_parallel_log_probs_from_logits", original, (logits, labels), {}, compute, reason)

    return vocab_parallel_log_probs_from_logits


# ------------------------------------------------------------------- the FSDP engine

_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
_AUTOMODEL_ENGINE = "verl.workers.engine.automodel.transformer_impl"


def _vocab_shard(logits):
    """``(local shard, process group, vocab_start)`` of logits that are a DTensor
    sharded on the vocabulary over one mesh dimension and replicated over the
    others (FSDP2 with tensor parallelism), or a string saying why fastrl cannot
    take them. A Shard placement splits as ``torch.chunk`` does, ceil(V / n)
    columns a coordinate, the last ones shorter or empty; the start is taken
    from the mesh coordinate, since a process group numbers its ranks in sorted
    order, which a permuted mesh does not follow."""
    from torch.distributed.tensor import Replicate, Shard

    ndim = logits.dim()
    sharded = [d for d, p in enumerate(logits.placements) if isinstance(p, Shard)]
    if len(sharded) != 1 or logits.placements[sharded[0]].dim % ndim != ndim - 1:
        return "the logits are a DTensor not sharded on the vocabulary (the last dimension) alone"
    if not all(isinstance(p, Replicate) for d, p in enumerate(logits.placements) if d != sharded[0]):
        return "the logits are a DTensor with a partial placement"
    mesh, mesh_dim = logits.device_mesh, sharded[0]
    vocab, parts = logits.shape[-1], mesh.size(mesh_dim)
    chunk = -(-vocab // parts)
    vocab_start = min(mesh.get_local_rank(mesh_dim) * chunk, vocab)
    local = logits.to_local()
    if local.shape[-1] != min(chunk, vocab - vocab_start):
        return "the logits are a DTensor whose shards are not torch.chunk's split of the vocabulary"
    return local, mesh.get_group(mesh_dim), vocab_start


def _engine_temperature(output_args: dict, key: str):
    """The per-token (remove-padding) or per-sample temperature the engine divides
    by, clamped as veRL clamps it; 1.0 where veRL skips the division."""
    if output_args.get("temperature_is_one", False):
        return 1.0
    return output_args[key].clamp(min=1e-8)


def _prepare_model_outputs(original):
    """``FSDPEngineWithLMHead.prepare_model_outputs`` (the FSDP engine's, and
    veOmni's, which calls it through ``super()``)."""
    outputs = _engine_outputs(original, "FSDPEngineWithLMHead", fsdp=True)

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        return outputs((self, output, output_args, micro_batch, logits_processor_func))

    return prepare_model_outputs


def _automodel_prepare_model_outputs(original):
    """``AutomodelEngineWithLMHead.prepare_model_outputs``: the FSDP engine's
    semantics less what the Automodel engine has not (Σπ², distillation, sequence
    parallelism: its packed log-probs are its outputs as they are); a bare tensor
    stands for the model output's logits, as there."""
    outputs = _engine_outputs(original, "AutomodelEngineWithLMHead", fsdp=False)

    def prepare_model_outputs(self, output, output_args, micro_batch):
        if isinstance(output, torch.Tensor):
            output = types.SimpleNamespace(logits=output)
        return outputs((self, output, output_args, micro_batch))

    return prepare_model_outputs


def _engine_outputs(original, engine: str, *, fsdp: bool):
    """The body of a veRL engine's ``prepare_model_outputs`` (called with its
    arguments): the log-probs and, with ``calculate_entropy``, the entropy (and
    on the FSDP engine, with ``calculate_sum_pi_squared``, Σπ²) of a micro-batch
    from one read of the logits, the per-sample temperature inside the kernel,
    and veRL's outputs (nested jagged, in veRL's dtypes) from them. ``fsdp``: the
    FSDP engine's options (Σπ², distillation) and its Ulysses / static-padding
    gather of packed outputs (``_gather_and_unpad_packed``)."""
    env = original.__globals__  # the engine's module: veRL's tensordict helpers, DTensor, verl_F
    functional = vars(env["verl_F"])

    def prepare_model_outputs(args):
        self, output, output_args, micro_batch = args[:4]

        def option(key, default=False):
            return env["tu"].get_non_tensor_data(data=micro_batch, key=key, default=default)

        no_padding = env["DatasetPadMode"].NO_PADDING
        remove_padding, entropy_wanted = option("use_remove_padding", True), option("calculate_entropy")
        sum_pi_squared_wanted = fsdp and option("calculate_sum_pi_squared")
        logits = getattr(output, "logits", None)
        reason = first_reason(
            None if option("pad_mode", no_padding) == no_padding else "a pad_mode other than no_padding (veRL raises)",
            "use_fused_kernels (the model's fused head computes the log-probs: fastrl's fused_lm_head op)"
            if option("use_fused_kernels") else None,
            "distillation (its loss reads the scaled logits)"
            if fsdp and (option("distillation_use_topk") or option("distillation_only")) else None,
            tensor_reason(logits=logits),
        )  # fmt: skip
        if reason is None and (logits.dim() != 3 or (remove_padding and logits.shape[0] != 1)):
            reason = "the logits are not [1, tokens, V] (remove-padding) or [batch, sequence, V]"
        if reason is None and not remove_padding:
            lengths = micro_batch["input_ids"].offsets().diff()
            if logits.shape[0] != len(lengths) or logits.shape[1] < int(lengths.max()):  # (veRL synced on it too)
                reason = "the padded logits do not cover every sample (veRL reads other rows for the missing ones)"
        shard = None
        if reason is None and isinstance(logits, env["DTensor"]):
            shard = _vocab_shard(logits)
            reason = shard if isinstance(shard, str) else None

        def compute():
            input_ids = micro_batch["input_ids"]
            cu_seqlens = input_ids.offsets()
            rows, group, vocab_start = shard if shard is not None else (logits, None, None)
            if remove_padding:
                rows = rows.squeeze(0)
                labels = output_args["input_ids_rmpad_rolled"]
                temperature = _engine_temperature(output_args, "temperature_rmpad")
            else:
                # [batch, sequence] labels over the padded layout: the packed ones at
                # each sample's positions, ignore_index (log-prob 0, no gradient) after
                valid = torch.arange(rows.shape[1], device=rows.device) < cu_seqlens.diff().unsqueeze(1)
                labels = torch.full(valid.shape, -100, dtype=torch.long, device=rows.device)
                labels[valid] = output_args["input_ids_rmpad_rolled"]
                temperature = _engine_temperature(output_args, "temperature")
                if isinstance(temperature, torch.Tensor):
                    temperature = temperature.unsqueeze(-1)
            # In-place backward whether or not the entropy is wanted: veRL's own
            # remove-padding path already overwrites the model's logits (temperature 1,
            # no entropy), and fastrl's one fused read leaves no second reader of them;
            # any other autograd node that saved them raises (the version counter).
            common = dict(temperature=temperature, group=group, vocab_start=vocab_start)
            entropy = sum_pi_squared = None
            if sum_pi_squared_wanted:
                log_probs, entropy, sum_pi_squared = fastrl.logprobs_and_entropy(
                    rows, labels, inplace_backward=True, sum_pi_squared=True, **common
                )
            elif entropy_wanted:
                log_probs, entropy = fastrl.logprobs_and_entropy(rows, labels, inplace_backward=True, **common)
            else:
                log_probs = fastrl.logprobs_from_logits(rows, labels, True, **common)
            log_probs = log_probs.to(_logprob_dtype(functional, logits))
            if entropy_wanted:
                # veRL's entropy_from_logits keeps the logits' dtype, its chunked one the default dtype
                chunked = remove_padding and getattr(self.engine_config, "entropy_from_logits_with_chunking", False)
                entropy = entropy.to(torch.get_default_dtype() if chunked else _softmax_dtype(logits))

            def jagged(values):  # veRL's layout: [batch, j] over the packed tokens
                if remove_padding and fsdp:
                    values = self._gather_and_unpad_packed(values, output_args["pad_size"])
                elif not remove_padding:
                    values = values[valid]
                return torch.nested.nested_tensor_from_jagged(values, cu_seqlens)

            model_output = {"log_probs": jagged(log_probs)}
            if entropy_wanted:
                model_output["entropy"] = jagged(entropy)
            if sum_pi_squared_wanted:
                model_output["sum_pi_squared"] = jagged(sum_pi_squared.to(_softmax_dtype(logits)))
            return model_output

        return delegate(_NAME, f"{engine}.prepare_model_outputs", original, args, {}, compute, reason)

    return prepare_model_outputs


FRAMEWORK = Framework(
    name=_NAME,
    display="veRL",
    distribution="verl",
    supported=((0, 9), (0, 10)),
    tested="0.9.1",
    targets=(
        Target("logprobs", _F, "logprobs_from_logits", _logprobs_from_logits),
        Target("entropy", _F, "entropy_from_logits", _entropy_from_logits),
        Target("entropy", _F, "entropy_from_logits_with_chunking", _entropy_from_logits_with_chunking),
        Target("sum_pi_squared", _F, "calculate_sum_pi_squared_from_logits", _sum_pi_squared),
        Target("kl", _CORE, "kl_penalty", _kl_penalty),
        Target("agg_loss", _CORE, "agg_loss", _agg_loss),
        Target("policy_loss", _CORE, "compute_policy_loss_vanilla", lambda f: _policy_loss(f, gspo=False), _REGISTRY),
        Target("policy_loss", _CORE, "compute_policy_loss_gspo", lambda f: _policy_loss(f, gspo=True), _REGISTRY),
        Target("fused_lm_head", _EXPERIMENTAL, "FusedLinearForPPO.forward", _fused_linear_for_ppo),
        Target("fused_lm_head", _LINEAR_CE, "linear_cross_entropy", _linear_cross_entropy),
        Target("vocab_parallel", _TP, "vocab_parallel_entropy", _vocab_parallel_entropy, requires="megatron"),
        Target("vocab_parallel", _TP, "vocab_parallel_log_probs_from_logits", _vocab_parallel_log_probs,
               requires="megatron"),
        Target("vocab_parallel", _TP, "vocab_parallel_sum_pi_squared", _vocab_parallel_sum_pi_squared,
               requires="megatron"),
        Target("engine", _FSDP_ENGINE, "FSDPEngineWithLMHead.prepare_model_outputs", _prepare_model_outputs,
               requires="peft"),
        Target("engine", _AUTOMODEL_ENGINE, "AutomodelEngineWithLMHead.prepare_model_outputs",
               _automodel_prepare_model_outputs, requires="nemo_automodel"),
    ),
)
OPS = FRAMEWORK.ops


def patch(ops=None) -> dict[str, list[str]]:
    """Replaces veRL's functions of ``ops`` (default: all of :data:`OPS`) with
    fastrl's adapters wherever they are loaded; returns where, per op. Idempotent.
    Raises ``UnsupportedVersionError`` naming the installed veRL when it is not
    0.9.x or its functions' layout differs."""
    return _patch(FRAMEWORK, ops)


def unpatch(ops=None) -> None:
    """Restores veRL's own functions (of ``ops``, default all) everywhere."""
    _unpatch(FRAMEWORK, ops)


def patched() -> list[str]:
    """The veRL ops patched now."""
    return _patched(FRAMEWORK)[_NAME]
