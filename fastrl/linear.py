"""Log-probs and entropy straight from hidden states: the LM head fused in, the
``[N, V]`` logits never held.

    x        = (hidden @ weight.T + bias) * logit_scale      float32 sums (float64 for float64 input)
    logits   = softcap * tanh(x / softcap)                    (softcap None: logits = x)
    logprob, entropy = logprobs_and_entropy(logits, labels, temperature=T, ignore_index=...)

How. Tokens go through in chunks of C rows. A chunk's logits are formed in a
float32 [C, V] buffer, a slab of the weight's rows at a time, from the GEMM's
float32 sums (never rounded to bf16: on CUDA cuBLAS writes float32 from bf16 /
fp16 operands, ``torch.mm(out_dtype=)``; on CPU, where torch has no such GEMM,
fastrl's own for bf16 on AVX512-BF16 (csrc/gemm.h: at the speed of oneDNN's
bf16 GEMM, twice that of float32), else the slab's operands are widened), then
read once by the same log-prob kernel
``logprobs_and_entropy`` launches (native on CPU, Triton on CUDA). The forward
keeps per token what that kernel's backward needs (max logit, log-normaliser,
entropy). The backward needs no whole row: given those, dL/dlogits is
elementwise, so it runs on blocks of B tokens x S vocabulary entries, a
vocabulary slab s at a time and within it every token block b. It forms the
block's logits again (the one GEMM it adds to the unfused path: the price of
not holding them; when one forward chunk held every token, that chunk's logits,
within ``chunk_bytes`` anyway, are kept for the backward instead), turns them into G = dL/dlogits with the log-prob backward
kernel (told that the block's columns start at s's first entry), applies the
chain rule of the cap and the scale,

    dlogits/dx = logit_scale * (1 - (logits / softcap)^2)      (= logit_scale without a softcap)

and multiplies out

    dL/dhidden[b] += G @ weight[s]     dL/dweight[s] += G.T @ hidden[b]     dL/dbias[s] += sum over b's tokens of G

in float32 accumulators: a slab's weight gradient is summed over every token
and rounded to a bf16 weight's dtype once, never per token block (rounding each
tile's product before summing biases training, as TRL's maintainers found), and
no [V, H] float32 accumulator is held. The gradient GEMMs take G rounded to the
weight's dtype where the GEMM takes that dtype with float32 sums (tensor cores on
CUDA, the native bf16 GEMM on CPU: one unbiased rounding of each element, what
every fused LM head does), float32 elsewhere.

Memory beyond inputs, outputs and gradients: the forward chunk's logits (C x V x
4 bytes; twice that with a softcap, whose slope is kept beside G), C chosen so
that this fits ``chunk_bytes`` (or capped by ``chunk_size``); a backward block
within the same budget (S = 16384 entries, or fewer, and as many tokens as fit);
a slab's widened operands where the GEMM widens them (fp16 on CPU, bf16 without
AVX512-BF16; at most ``_SLAB_BYTES``), or the native bf16 GEMM's packed copy of
its smaller operand (the chunk's hidden states, the slab); for bf16 / fp16 hidden
states that need a gradient, its float32 accumulator (N x H x 4 bytes), and a
slab's float32 weight-gradient accumulator (S x H x 4 bytes).

Rows are independent: a token's log-prob does not depend on the chunk it falls
in as far as the GEMM's own result does not (cuBLAS and oneDNN may pick a
different kernel, so a different summation order, for another number of rows).
"""

from __future__ import annotations

import dataclasses

import torch

from . import _distributed, _native, _ops, _validation, policy, reference
from ._backend import select_backend
from ._rows import row_view
from ._sharded import logprobs as sharded

__all__ = ["linear_logprobs_and_entropy", "policy_loss_from_hidden"]

# The chunk's logits buffers are sized to at most this by default: at V = 151936
# a chunk of 441 tokens (220 with a softcap), large enough for the GEMM to run
# at full speed, small against the 5 GB of a [16384, V] bf16 logits tensor.
DEFAULT_CHUNK_BYTES = 256 << 20
# policy_loss_from_hidden's default where it forms the gradients in the forward on a
# GPU (its docstring): chunks of ~1760 tokens at V = 151936.
_GPU_GRADIENT_CHUNK_BYTES = 1 << 30
# A slab of weight rows whose widened (float32) copy is at most this.
_SLAB_BYTES = 64 << 20


def _native_bf16_gemm(t: torch.Tensor) -> bool:
    """Whether the native float32-output bf16 GEMM (csrc/gemm.h) takes CPU
    tensor ``t``'s dtype: bf16, on a CPU with AVX512-BF16."""
    return t.device.type == "cpu" and t.dtype == torch.bfloat16 and _native.gemm_bf16_supported()


def _sums_operand(weight: torch.Tensor) -> bool:
    """Whether a GEMM takes ``weight``'s bf16 / fp16 as they are and returns
    float32 sums: cuBLAS on CUDA, the native GEMM for bf16 on CPU."""
    return (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16)) or _native_bf16_gemm(weight)


def _operand_dtype(weight: torch.Tensor, acc: torch.dtype) -> torch.dtype:
    """The gradient GEMMs' operand dtype: the weight's where a GEMM takes it with
    float32 sums (G rounded to it once, as every fused LM head does), else acc."""
    return weight.dtype if _sums_operand(weight) else acc


def _as_operand(grad: torch.Tensor, operand: torch.dtype) -> torch.Tensor:
    """G for the gradient GEMMs: rounded to ``operand``, by the native GEMM as it
    packs G (no copy) where that GEMM runs, else by a copy."""
    if operand == torch.bfloat16 and grad.device.type == "cpu" and _native.gemm_bf16_supported():
        return grad
    return grad.to(operand)


def _slab_rows(weight: torch.Tensor, acc: torch.dtype) -> int:
    """Weight rows a GEMM takes at once: all of them where no operand is widened
    (float32 / float64 weights, and those of _sums_operand), else as many as
    keep the widened copy within _SLAB_BYTES."""
    vocab, hidden_size = weight.shape
    if weight.dtype == acc or (acc == torch.float32 and _sums_operand(weight)):
        return vocab
    return max(1, _SLAB_BYTES // max(1, hidden_size * torch.finfo(acc).bits // 8))


def _mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b, or out += a @ b, summed in out's dtype (float32 or float64)
    and written into it in place. Operands of another dtype: cuBLAS's
    float32-output GEMM on CUDA for bf16 / fp16 (torch >= 2.8), the native one
    (csrc/gemm.h) for bf16 on an AVX512-BF16 CPU, which rounds a float32 operand
    beside a bf16 one to bf16 (G from _as_operand), else widened (the callers
    pass slabs, so the copies stay small). Never under autocast, which would run
    a float32 GEMM in bf16 and round its output."""
    if _autocasting(a.device.type):
        with torch.autocast(a.device.type, enabled=False):
            return _mm(a, b, out, accumulate)
    acc = out.dtype
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16) and acc == torch.float32:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
        return None
    if acc == torch.float32 and (_native_bf16_gemm(a) or _native_bf16_gemm(b)) and {a.dtype, b.dtype} <= _BF16_F32:
        _native.gemm_bf16(a, b, out, accumulate)
        return None
    a, b = a.to(acc), b.to(acc)
    if accumulate:
        out.addmm_(a, b)
    elif out.is_contiguous():
        torch.mm(a, b, out=out)
    else:
        out.copy_(torch.mm(a, b))
    return None


_BF16_F32 = {torch.bfloat16, torch.float32}


def _epilogue(logits, bias_acc, logit_scale, softcap):
    """Bias, scale and cap applied in place to GEMM output ``logits``; returns
    (logits, dlogits/dx = logit_scale * (1 - (logits / softcap)^2)) with a
    softcap, else (logits, None)."""
    if bias_acc is not None:
        logits += bias_acc
    if logit_scale != 1.0:
        logits *= logit_scale
    if softcap is None:
        return logits, None
    logits.div_(softcap).tanh_()
    slope = torch.square(logits).neg_().add_(1.0).mul_(logit_scale)
    return logits.mul_(softcap), slope


def _through_cap(grad, slope, logit_scale) -> None:
    """dL/dlogits -> dL/dx in place: times the cap's slope (which holds the
    scale, see _epilogue), or the scale alone without a cap."""
    if slope is not None:
        grad *= slope
    elif logit_scale != 1.0:
        grad *= logit_scale


def _block(buffer: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous [rows, cols] block at the start of flat ``buffer``: one buffer
    serves every chunk / block of a pass, so the pass does not fault in fresh
    pages for each (~10% of a float32 GEMM's time on CPU, measured)."""
    return buffer[: rows * cols].view(rows, cols)


def _chunk_logits(hidden_c, weight, bias_acc, logit_scale, softcap, slab, buffer):
    """The float32 (float64) [C, V] logits of a chunk of hidden states in
    ``buffer`` (_block), whole rows (the forward kernel reads a row at once), a
    slab of weight rows a GEMM."""
    vocab = weight.shape[0]
    logits = _block(buffer, hidden_c.shape[0], vocab)
    for v0 in range(0, vocab, slab):
        _mm(hidden_c, weight[v0 : v0 + slab].T, logits[:, v0 : v0 + slab])
    return _epilogue(logits, bias_acc, logit_scale, softcap)


def _chunk_rows(n_tokens: int, vocab: int, acc: torch.dtype, softcap, chunk_bytes: int, chunk_size) -> int:
    """Tokens a forward chunk holds: its logits buffers (two with a softcap)
    within chunk_bytes, at most chunk_size."""
    per_token = vocab * (torch.finfo(acc).bits // 8) * (2 if softcap is not None else 1)
    rows = max(1, chunk_bytes // per_token)
    if chunk_size is not None:
        rows = min(rows, chunk_size)
    return max(1, min(rows, n_tokens))


# The backward's blocks span at most this many vocabulary entries: wide enough for
# the GEMMs, narrow enough to leave tokens to the block at a 256 MiB budget.
_BACKWARD_COLS = 16384


def _backward_block(n_tokens: int, weight: torch.Tensor, acc: torch.dtype, operand: torch.dtype, softcap,
                    chunk_bytes: int, chunk_size) -> tuple[int, int]:  # fmt: skip
    """(tokens, vocabulary entries) of a backward block: its float32 logits /
    gradient (with a softcap also its slope, and on CUDA its copy in the operand
    dtype) within chunk_bytes; the widened weight slab within _SLAB_BYTES."""
    cols = min(weight.shape[0], _BACKWARD_COLS, _slab_rows(weight, acc))
    acc_bytes = torch.finfo(acc).bits // 8
    per_entry = acc_bytes * (2 if softcap is not None else 1) + (
        torch.finfo(operand).bits // 8 if operand != acc and not _native_bf16_gemm(weight) else 0
    )
    rows = max(1, chunk_bytes // (cols * per_entry))
    if chunk_size is not None:
        rows = min(rows, chunk_size)
    return max(1, min(rows, n_tokens)), cols


class _LinearLogprobs(torch.autograd.Function):
    """Outputs: logprob [N], entropy [N] (empty when not asked for)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temps, temp_scalar, ignore_index, with_entropy,
                logit_scale, softcap, chunk_bytes, chunk_size, backend, shard):  # fmt: skip
        acc = reference.compute_dtype(hidden)
        needs_grad = any(ctx.needs_input_grad[:3])
        rows = _chunk_rows(hidden.shape[0], weight.shape[0], acc, softcap, chunk_bytes, chunk_size)
        logprob, entropy, stats, (logits, slope) = _forward(
            hidden, weight, bias, labels, temps, temp_scalar, ignore_index, with_entropy, logit_scale, softcap, rows,
            backend, acc, needs_grad, shard,
        )  # fmt: skip
        # One chunk held every token: its logits (within chunk_bytes) are kept for the
        # backward, which then forms none again (one GEMM fewer). Otherwise none are kept.
        if not (needs_grad and rows >= hidden.shape[0]):
            logits = slope = None
        ctx.save_for_backward(hidden, weight, bias, labels, temps, stats, entropy if with_entropy else None, logits,
                              slope)  # fmt: skip
        ctx.temp_scalar, ctx.ignore_index, ctx.backend = temp_scalar, ignore_index, backend
        ctx.logit_scale, ctx.softcap, ctx.with_entropy = logit_scale, softcap, with_entropy
        ctx.chunk_bytes, ctx.chunk_size, ctx.shard = chunk_bytes, chunk_size, shard
        ctx.set_materialize_grads(False)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        """Vocabulary slab by slab, and within a slab token block by token block
        (module docstring): each slab's weight gradient is summed in float32 over
        every token and written once, so no [V, H] float32 accumulator is held.
        A vocabulary shard's columns start at its place in the whole vocabulary,
        and its dL/dhidden, a partial sum, is summed over the ranks."""
        _ops.refuse_double_backward()
        hidden, weight, bias, labels, temps, stats, entropy, kept_logits, kept_slope = ctx.saved_tensors
        if not ctx.with_entropy:
            grad_entropy = None
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 14
        acc = stats.dtype
        grad_logprob = None if grad_logprob is None else grad_logprob.to(acc).contiguous()
        grad_entropy = None if grad_entropy is None else grad_entropy.to(acc).contiguous()
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        n_tokens, hidden_size = hidden.shape
        vocab = weight.shape[0]
        shard = ctx.shard
        column_base, whole_vocab = (0, vocab) if shard is None else (shard.start, shard.vocab)
        operand = _operand_dtype(weight, acc)
        rows, cols = _backward_block(n_tokens, weight, acc, operand, ctx.softcap, ctx.chunk_bytes, ctx.chunk_size)
        # Accumulators are written by their first GEMM (no zero-filling pass over fresh memory).
        grad_hidden = torch.empty(n_tokens, hidden_size, dtype=acc, device=hidden.device) if want_hidden else None
        grad_weight = torch.empty_like(weight) if want_weight else None
        grad_bias = torch.zeros(vocab, dtype=acc, device=weight.device) if want_bias else None
        bias_acc = None if bias is None else bias.to(acc)
        block_buffer = torch.empty(rows * cols, dtype=acc, device=hidden.device)
        pick = lambda t, t0, t1: None if t is None else t[t0:t1]  # noqa: E731
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            weight_op = weight[v0:v1].to(operand)
            grad_weight_s = None
            if want_weight:  # summed in acc: the output itself when it is acc
                grad_weight_s = (
                    grad_weight[v0:v1]
                    if weight.dtype == acc
                    else torch.empty(v1 - v0, hidden_size, dtype=acc, device=weight.device)
                )
            for t0 in range(0, n_tokens, rows):
                t1 = min(t0 + rows, n_tokens)
                if kept_logits is not None:  # the forward's, read in place; the gradient goes to the buffer
                    logits = kept_logits[t0:t1, v0:v1]
                    slope = None if kept_slope is None else kept_slope[t0:t1, v0:v1]
                    grad = _block(block_buffer, t1 - t0, v1 - v0)
                else:  # formed again, and the gradient written over them
                    logits = _block(block_buffer, t1 - t0, v1 - v0)
                    _mm(hidden[t0:t1], weight_op.T, logits)
                    logits, slope = _epilogue(logits, pick(bias_acc, v0, v1), ctx.logit_scale, ctx.softcap)
                    grad = logits
                _ops.logprobs_backward(
                    row_view(logits), pick(labels, t0, t1), pick(temps, t0, t1), ctx.temp_scalar, ctx.ignore_index,
                    stats[t0:t1], pick(entropy, t0, t1), pick(grad_logprob, t0, t1), pick(grad_entropy, t0, t1),
                    row_view(grad), column_base + v0, whole_vocab, ctx.backend,
                )  # fmt: skip
                _through_cap(grad, slope, ctx.logit_scale)
                if want_bias:
                    grad_bias[v0:v1] += grad.sum(dim=0)
                grad_op = _as_operand(grad, operand)
                if want_hidden:
                    _mm(grad_op, weight_op, grad_hidden[t0:t1], accumulate=v0 > 0)
                if want_weight:
                    _mm(grad_op.T, hidden[t0:t1].to(operand), grad_weight_s, accumulate=t0 > 0)
            if want_weight and weight.dtype != acc:
                grad_weight[v0:v1] = grad_weight_s
        if shard is not None and grad_hidden is not None:  # summed in float32 (float64), rounded once
            grad_hidden = _distributed.sum_in_rank_order(grad_hidden, shard.group)
        return (
            None if grad_hidden is None else grad_hidden.to(hidden.dtype),
            grad_weight,
            None if grad_bias is None else grad_bias.to(bias.dtype),
            *(None,) * 11,
        )


def _forward(hidden, weight, bias, labels, temps, temp_scalar, ignore_index, with_entropy, logit_scale, softcap,
             rows, backend, acc, with_stats, shard=None):  # fmt: skip
    """(logprob [N], entropy [N] or empty, stats [N, 2] or empty, (logits, slope)
    of the last chunk), a chunk of ``rows`` tokens at a time. For a vocabulary
    ``shard`` (fastrl._sharded.logprobs), each chunk gives its shard's row
    statistics, and the ranks' are gathered and combined once at the end."""
    n_tokens = hidden.shape[0]
    new = lambda *shape: torch.empty(shape, dtype=acc, device=hidden.device)  # noqa: E731
    whole = shard is None  # (a shard's per-token outputs come from the combination at the end)
    logprob = new(n_tokens) if labels is not None and whole else new(0)
    entropy = new(n_tokens) if with_entropy and whole else new(0)
    stats = new(n_tokens, 2) if with_stats and whole else new(0)
    local = None if whole else new(n_tokens, 4)
    bias_acc = None if bias is None else bias.to(acc)
    slab = _slab_rows(weight, acc)
    buffer = new(min(rows, n_tokens) * weight.shape[0])
    for t0 in range(0, n_tokens, rows):
        t1 = min(t0 + rows, n_tokens)
        logits, slope = _chunk_logits(hidden[t0:t1], weight, bias_acc, logit_scale, softcap, slab, buffer)
        if not whole:
            local[t0:t1] = sharded.local_stats(
                row_view(logits), labels[t0:t1], None if temps is None else temps[t0:t1], temp_scalar, shard,
                with_entropy, backend,
            )  # fmt: skip
            continue
        lp, ent, st, _ = _ops.logprobs_forward(
            row_view(logits), None if labels is None else labels[t0:t1], None if temps is None else temps[t0:t1],
            temp_scalar, ignore_index, with_entropy, with_stats, False, backend,
        )  # fmt: skip
        if labels is not None:
            logprob[t0:t1] = lp
        if with_entropy:
            entropy[t0:t1] = ent
        if with_stats:
            stats[t0:t1] = st
    if not whole:
        logprob, all_entropy, stats, _ = sharded.combine_across_ranks(local, labels, temps, temp_scalar,
                                                                             ignore_index, shard)  # fmt: skip
        entropy = all_entropy if with_entropy else entropy
    return logprob, entropy, stats, (logits, slope) if n_tokens else (None, None)


def _check_float(t: object, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
    if t.dtype not in _validation.LOGIT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype (bfloat16, float16, float32, float64); got {t.dtype}")
    return t


def _gather_sharded(*tensors):
    """The tensors with every DTensor all-gathered into a plain tensor.

    FSDP2 (``fully_shard``) leaves a module's parameters sharded DTensors outside
    its forward, and a fused head reads ``lm_head.weight`` without calling the
    module, so the weight (or a sequence-parallel ``hidden``) may arrive sharded;
    it is gathered as TRL's fused head gathers it. ``full_tensor()`` is
    differentiable: its gradient is taken as replicated, so each rank's shard
    receives its slice of that rank's own gradient (summing over data-parallel
    ranks stays the trainer's job, as after TRL's gather)."""
    if not torch.distributed.is_available():
        return tensors
    from torch.distributed.tensor import DTensor

    return tuple(t.full_tensor() if isinstance(t, DTensor) else t for t in tensors)


def _check_head(hidden: object, weight: object, bias: object) -> None:
    """hidden [..., H], weight [V, H] (V, H >= 1) and bias [V] or None, on one device."""
    _check_float(hidden, "hidden")
    _check_float(weight, "weight")
    if hidden.dim() == 0 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden must have shape [..., H] with H >= 1; got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[0] == 0 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, H] (the LM head's [vocab, hidden]) with V >= 1 and "
                         f"H = hidden.shape[-1] = {hidden.shape[-1]}; got {tuple(weight.shape)}")  # fmt: skip
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}; they must share a device")
    if bias is not None:
        _check_float(bias, "bias")
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},); got {tuple(bias.shape)}")
        if bias.device != hidden.device:
            raise ValueError(f"bias is on {bias.device} but hidden is on {hidden.device}; they must share a device")


def _check_scale_and_cap(logit_scale: object, softcap: object, acc: torch.dtype) -> tuple[float, float | None]:
    """``logit_scale`` and ``softcap`` as the kernels hold them, in the compute
    dtype ``acc`` (``_validation.held_within``, as the temperature): 1e39 is
    finite in float64 but inf in float32, where it would make every output NaN.
    A softcap must be a normal number there (x / softcap; a GPU may flush a
    subnormal to 0)."""
    finfo, in_acc = torch.finfo(acc), f" in {str(acc).replace('torch.', '')}, the compute dtype"
    logit_scale = _validation.check_scalar(
        logit_scale, "logit_scale", ok=lambda v: _validation.held_within(v, acc, -finfo.max, finfo.max),
        accepted=f"a float between {-finfo.max:.3g} and {finfo.max:.3g}{in_acc}",
    )  # fmt: skip
    if softcap is not None:
        softcap = _validation.check_scalar(
            softcap, "softcap", ok=lambda v: _validation.held_within(v, acc, finfo.tiny, finfo.max),
            accepted=f"None (off) or a float between {finfo.tiny:.3g} and {finfo.max:.3g}{in_acc}",
        )  # fmt: skip
    return logit_scale, softcap


# Whether torch.autocast knows a device type, asked once a type outside a trace:
# torch.is_autocast_enabled raises for one it does not know (meta tensors, which
# every op takes through the reference), and torch.compile under torch 2.11
# cannot trace torch.amp.is_autocast_available (a graph break; seen on an H200).
_AUTOCAST_AVAILABLE = {t: torch.amp.is_autocast_available(t) for t in ("cpu", "cuda", "meta")}


def _autocasting(device_type: str) -> bool:
    """Whether torch.autocast is on for ``device_type``; never for a device type
    autocast does not know."""
    available = _AUTOCAST_AVAILABLE.get(device_type)
    if available is None:
        available = _AUTOCAST_AVAILABLE[device_type] = torch.amp.is_autocast_available(device_type)
    return available and torch.is_autocast_enabled(device_type)


def _autocast(hidden, weight, bias):
    """Under torch.autocast the LM head runs in the autocast dtype, as F.linear
    would (float64 stays float64); then hidden and weight must share a dtype."""
    device_type = hidden.device.type
    if _autocasting(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        cast = lambda t: t if t is None or t.dtype == torch.float64 else t.to(dtype)  # noqa: E731
        hidden, weight, bias = cast(hidden), cast(weight), cast(bias)
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight must have hidden's dtype {hidden.dtype} (cast one, or run under torch.autocast); "
                        f"got {weight.dtype}")  # fmt: skip
    return hidden, weight, bias


@dataclasses.dataclass
class _Head:
    """A fused-head call's checked arguments: hidden states flattened to [N, H]
    tokens (after autocast), labels to [N], temperatures to per-token rows or a
    scalar."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    temperature: float | torch.Tensor  # checked, for the reference
    temps: torch.Tensor | None
    temp_scalar: float
    token_shape: torch.Size
    logit_scale: float
    softcap: float | None
    acc: torch.dtype
    backend: str

    @property
    def inputs(self) -> tuple:
        return self.hidden, self.weight, self.bias


def _prepare(hidden, weight, labels, bias, temperature, ignore_index, with_entropy, logit_scale, softcap, chunk_size,
             chunk_bytes, group=None, vocab_start=None, also_check=None) -> tuple[_Head, _distributed.Shard | None]:  # fmt: skip
    """The checked arguments, and with a ``group`` this rank's vocabulary shard,
    agreed with the other ranks (_distributed.agree) after the same checks;
    ``also_check(head)``: the caller's checks of its other arguments, run
    before the agreement (a rank that raised after it would leave the others
    waiting in the backward's collective), returning more options the ranks
    must agree on (a dict)."""
    extra = {}

    def check(sharded):
        head = _checked_head(hidden, weight, labels, bias, temperature, ignore_index, with_entropy, logit_scale,
                             softcap, chunk_size, chunk_bytes, sharded)  # fmt: skip
        if also_check is not None:
            extra.update(also_check(head))
        return head

    if group is None:
        if vocab_start is not None:
            raise ValueError("vocab_start is for a vocabulary-sharded weight: pass the group= it is sharded over")
        return check(False), None
    checked = {}

    def layout():
        head = checked["head"] = check(True)
        options = {"temperature": head.temp_scalar if head.temps is None else head.temps,
                   "ignore_index": ignore_index, "logit_scale": head.logit_scale, "softcap": head.softcap,
                   "with_entropy": with_entropy, "bias": head.bias is not None,
                   # dL/dhidden is summed over the ranks in the backward: every rank or none must form it.
                   "hidden_needs_grad": torch.is_grad_enabled() and head.hidden.requires_grad, **extra}  # fmt: skip
        shape = (*head.token_shape, head.hidden.shape[-1])
        return _distributed.Layout(shape, head.weight.shape[0], head.hidden.dtype, head.hidden.device, options,
                                     "hidden shapes")  # fmt: skip

    outputs = _distributed.LABELED | (_distributed.ENTROPY if with_entropy else 0)
    shard = _distributed.agree(group, layout, vocab_start, outputs, _distributed.label_range(labels, ignore_index),
                                 lambda: (labels, checked["head"].temps))  # fmt: skip
    return checked["head"], shard


def _checked_head(hidden, weight, labels, bias, temperature, ignore_index, with_entropy, logit_scale, softcap,
                  chunk_size, chunk_bytes, sharded) -> _Head:  # fmt: skip
    """The checks of one rank's arguments: labels in [0, the weight's rows) or
    ignore_index (``sharded``: their values are the ranks' agreement's to check)."""
    _check_head(hidden, weight, bias)
    hidden, weight, bias = _gather_sharded(hidden, weight, bias)
    _validation.check_ignore_index(ignore_index)
    token_shape = hidden.shape[:-1]
    label_vocab = None if sharded else weight.shape[0]
    _validation.check_token_labels(labels, token_shape, label_vocab, hidden.device, ignore_index, source="hidden")
    _validation.check_bool(with_entropy, "with_entropy")
    if chunk_size is not None:
        _validation.check_scalar(chunk_size, "chunk_size", integer=True, ok=lambda v: v >= 1,
                                 accepted="None or a positive int")  # fmt: skip
    _validation.check_scalar(chunk_bytes, "chunk_bytes", integer=True, ok=lambda v: v >= 1, accepted="a positive int")
    hidden, weight, bias = _autocast(hidden, weight, bias)
    acc = reference.compute_dtype(hidden)
    logit_scale, softcap = _check_scale_and_cap(logit_scale, softcap, acc)
    temperature = _validation.check_temperature(temperature, token_shape, hidden.device, acc)
    temps, temp_scalar = _ops.split_row_param(_validation.flat_per_row(temperature, token_shape, acc))
    return _Head(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, labels.reshape(-1).contiguous(), temperature, temps,
        temp_scalar, token_shape, float(logit_scale), softcap, acc, select_backend(hidden.device),
    )  # fmt: skip


def _reference(head: _Head, labels: torch.Tensor, ignore_index: int, with_entropy: bool):
    hidden = head.hidden.reshape(*head.token_shape, head.hidden.shape[-1])
    return reference.linear_logprobs_and_entropy(
        hidden, head.weight, labels, bias=head.bias, temperature=head.temperature, ignore_index=ignore_index,
        with_entropy=with_entropy, logit_scale=head.logit_scale, softcap=head.softcap,
    )  # fmt: skip


@_validation.keyword_only_options
def linear_logprobs_and_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    with_entropy: bool = True,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    group: object = None,
    vocab_start: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs, entropy)`` of the LM head's logits without holding them
    (module docstring): equal to ``logprobs_and_entropy(lm_head(hidden), labels)``
    with the logits in float32.

    Args:
        hidden: ``[..., H]`` bf16 / fp16 / fp32 (fp64 computed in fp64).
        weight: ``[V, H]`` the LM head's weight, hidden's dtype (under
            ``torch.autocast`` both run in the autocast dtype). A DTensor
            (FSDP2's sharded parameter) is all-gathered first, as TRL does.
        labels: ``[...]`` int32 / int64, in ``[0, V)`` or ``ignore_index``.
        bias: ``[V]`` or None.
        temperature: positive float, or per-token temperatures broadcastable to ``labels.shape``
            (a constant: on the kernel backends a tensor that requires grad raises a TypeError).
        ignore_index: label whose log-prob is 0 and whose gradient is 0.
        with_entropy: False skips the entropy (returned as None).
        logit_scale: the logits are multiplied by it before the cap (Cohere's ``logit_scale``,
            Granite's ``1 / logits_scaling``); any float finite in the compute dtype (float32,
            float64 for float64 hidden states).
        softcap: ``softcap * tanh(x / softcap)`` (Gemma's final-logit soft-capping), None: off;
            else positive, normal and finite in the compute dtype.
        chunk_size: at most this many tokens a chunk.
        chunk_bytes: the chunk's logits buffers stay within this (default 256 MiB).
        group: a ``torch.distributed`` process group over which the LM head is
            sharded by vocabulary (Megatron's column-parallel output layer):
            ``weight`` / ``bias`` are this rank's rows, ``hidden`` the same
            on every rank, ``labels`` global ids; every rank gets the whole
            vocabulary's log-probs and entropy (one all-gather of 16 bytes a
            token in the forward, as ``logprobs_from_logits(group=)``). The
            backward sums dL/dhidden over the ranks itself (it replaces the
            column-parallel layer, its copy-to-tensor-parallel-region
            included: do not pass ``hidden`` through one): an all-to-all and an
            all-gather of float32 [N, H], the traffic of an all-reduce, added
            in rank order (``fastrl._distributed.sum_in_rank_order``); every
            rank must run it. None: unsharded.
        vocab_start: with ``group``, the global id of this rank's first row
            (default: the shards in rank order).

    Returns:
        float32 ``[...]`` log-probs and entropy (or None), differentiable w.r.t.
        ``hidden``, ``weight`` and ``bias``; their gradients come back in their dtypes.
    """
    head, shard = _prepare(hidden, weight, labels, bias, temperature, ignore_index, with_entropy, logit_scale,
                           softcap, chunk_size, chunk_bytes, group, vocab_start)  # fmt: skip
    return _logprobs_of(head, labels, ignore_index, with_entropy, chunk_bytes, chunk_size, shard)


def _logprobs_of(head: _Head, labels, ignore_index, with_entropy, chunk_bytes, chunk_size, shard=None):
    """linear_logprobs_and_entropy on checked arguments (a vocabulary ``shard``
    of the head, or None)."""
    if shard is not None and (head.backend == "reference" or labels.numel() == 0):
        # The spec's logits of the shard, the sharded reference log-probs, and hidden's gradient summed over the ranks.
        hidden = _distributed.summed_gradient_over_ranks(head.hidden.to(head.acc), shard.group)
        logits = reference.lm_head_logits(hidden, head.weight, head.bias, logit_scale=head.logit_scale,
                                          softcap=head.softcap)  # fmt: skip
        logprob, entropy, _ = sharded.logprobs_of_shard(logits, head.labels, head.temps, head.temp_scalar,
                                                               ignore_index, with_entropy, shard, "reference")  # fmt: skip
        return logprob.view(head.token_shape), entropy.view(head.token_shape) if with_entropy else None
    if head.backend == "reference" or labels.numel() == 0:
        return _reference(head, labels, ignore_index, with_entropy)
    wants_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in head.inputs)
    if wants_grad:
        logprob, entropy = _LinearLogprobs.apply(
            *head.inputs, head.labels, head.temps, head.temp_scalar, ignore_index, with_entropy, head.logit_scale,
            head.softcap, chunk_bytes, chunk_size, head.backend, shard,
        )  # fmt: skip
    else:
        rows = _chunk_rows(head.hidden.shape[0], head.weight.shape[0], head.acc, head.softcap, chunk_bytes, chunk_size)
        logprob, entropy, _, _ = _forward(*head.inputs, head.labels, head.temps, head.temp_scalar, ignore_index,
                                          with_entropy, head.logit_scale, head.softcap, rows, head.backend, head.acc,
                                          False, shard)  # fmt: skip
    return logprob.view(head.token_shape), entropy.view(head.token_shape) if with_entropy else None


def _forward_with_gradients(head: _Head, ignore_index, with_entropy, rows, token_gradients, wants):
    """The forward of a loss L whose gradient w.r.t. each token's (log-prob,
    entropy) depends on that token alone (and on constants): L's gradients
    w.r.t. hidden, weight and bias at an upstream gradient of 1, formed chunk by
    chunk while the chunk's logits are at hand, so no GEMM forms them again: the
    unfused path's three GEMMs (Liger's fused-linear losses do the same).

    ``token_gradients(t0, t1, logprob, entropy)`` gives (dL/dlogprob,
    dL/dentropy or None) of tokens [t0, t1). Returns (logprob [N], entropy [N] or
    empty, grad_hidden [N, H], grad_weight [V, H], grad_bias [V], each None when
    not wanted), gradients in float32 (float64): the weight's is summed over every
    chunk there, a [V, H] float32 accumulator for a bf16 / fp16 head (the price
    of the GEMM saved; the per-token outputs' backward holds none)."""
    hidden, weight, acc = head.hidden, head.weight, head.acc
    (n_tokens, hidden_size), vocab = hidden.shape, weight.shape[0]
    new = lambda *shape: torch.empty(shape, dtype=acc, device=hidden.device)  # noqa: E731
    want_hidden, want_weight, want_bias = wants
    logprob, entropy = new(n_tokens), new(n_tokens) if with_entropy else new(0)
    # Written by their first GEMM (no zero-filling pass).
    grad_hidden = new(n_tokens, hidden_size) if want_hidden else None
    grad_weight = new(vocab, hidden_size) if want_weight else None
    grad_bias = torch.zeros(vocab, dtype=acc, device=hidden.device) if want_bias else None
    bias_acc = None if head.bias is None else head.bias.to(acc)
    slab = _slab_rows(weight, acc)
    # The gradient GEMMs' operands (as in the backward), a block of columns at a time.
    operand = _operand_dtype(weight, acc)
    cols = min(slab, _BACKWARD_COLS)
    buffer = new(min(rows, n_tokens) * vocab)
    for t0 in range(0, n_tokens, rows):
        t1 = min(t0 + rows, n_tokens)
        pick = lambda t: None if t is None else t[t0:t1]  # noqa: E731
        logits, slope = _chunk_logits(hidden[t0:t1], weight, bias_acc, head.logit_scale, head.softcap, slab, buffer)
        lp, ent, stats, _ = _ops.logprobs_forward(
            row_view(logits), head.labels[t0:t1], pick(head.temps), head.temp_scalar, ignore_index, with_entropy, True,
            False, head.backend,
        )  # fmt: skip
        logprob[t0:t1] = lp
        if with_entropy:
            entropy[t0:t1] = ent
        grad_logprob, grad_entropy = token_gradients(t0, t1, lp, ent if with_entropy else None)
        grad = logits  # dL/dlogits written over them
        _ops.logprobs_backward(
            row_view(logits), head.labels[t0:t1], pick(head.temps), head.temp_scalar, ignore_index, stats,
            ent if grad_entropy is not None else None, grad_logprob, grad_entropy, row_view(grad), 0, vocab,
            head.backend,
        )  # fmt: skip
        _through_cap(grad, slope, head.logit_scale)
        if want_bias:
            grad_bias += grad.sum(dim=0)
        hidden_op = hidden[t0:t1].to(operand) if want_weight else None
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            grad_op = _as_operand(grad[:, v0:v1], operand)
            if want_hidden:
                _mm(grad_op, weight[v0:v1].to(operand), grad_hidden[t0:t1], accumulate=v0 > 0)
            if want_weight:
                _mm(grad_op.T, hidden_op, grad_weight[v0:v1], accumulate=t0 > 0)
    return logprob, entropy, grad_hidden, grad_weight, grad_bias


class _GradientsFromForward(torch.autograd.Function):
    """A loss whose gradients w.r.t. (hidden, weight, bias) its forward formed
    at an upstream gradient of 1 (float32 / float64): the backward scales them
    by the upstream gradient and rounds them to the inputs' dtypes, a slab of
    rows at a time (no full-size float32 temporary); never in place, so a
    second backward (retain_graph) finds them unchanged."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
        ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss):
        _ops.refuse_double_backward()

        def scaled(grad, dtype):
            if grad is None or dtype == grad.dtype:
                return None if grad is None else grad * grad_loss.to(grad.dtype)
            out = torch.empty(grad.shape, dtype=dtype, device=grad.device)
            step = max(1, _SLAB_BYTES // max(1, grad[0].numel() * grad.element_size()))
            for r0 in range(0, grad.shape[0], step):
                out[r0 : r0 + step] = grad[r0 : r0 + step] * grad_loss.to(grad.dtype)
            return out

        grads = [scaled(g, dtype) for g, dtype in zip(ctx.saved_tensors, ctx.dtypes, strict=True)]
        return None, *grads, None, None, None


@_validation.keyword_only_options
def policy_loss_from_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    with_entropy: bool | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    chunk_bytes: int | None = None,
    group: object = None,
    vocab_start: int | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`fastrl.policy_loss` straight from the hidden states ``[..., L, H]`` and
    the LM head (Liger's fused-linear GRPO loss, with veRL's loss options): the
    log-probs (and the entropy, when ``entropy_coef != 0`` or ``with_entropy=True``)
    of :func:`linear_logprobs_and_entropy`, so the ``[..., L, V]`` logits are
    never held; gradients reach ``hidden``, ``weight`` and ``bias``. ``options`` are
    :func:`fastrl.policy_loss`'s keyword arguments (not ``entropy``). Returns
    ``(loss, metrics)`` as :func:`fastrl.policy_loss`.

    With token-level ratios (``ratio_level="token"``, every mode but GSPO) a
    token's loss gradient depends on that token alone, so the gradients are
    formed in the forward while each chunk's logits are at hand: three GEMMs in
    all, as the unfused path, where the log-probs' own backward forms the logits
    again (four). The weight's gradient is then summed over the chunks in a
    float32 [V, H] accumulator, held until the backward (for a bf16 / fp16 head:
    twice the head's size). GSPO's sequence ratio, ``torch.compile``, no
    gradient and a bf16 / fp16 head on CPU (whose GEMMs widen it a slab at a
    time: the widening a chunk would cost more than the GEMM saved) take the
    composition ``policy_loss(linear_logprobs_and_entropy(...))``, and so
    does a vocabulary-sharded head (``group`` / ``vocab_start`` as
    :func:`linear_logprobs_and_entropy` takes them; every rank computes the same
    loss).

    ``chunk_bytes=None`` is 256 MiB, or 1 GiB when the gradients are formed in the
    forward on a GPU: each chunk of C tokens then reads and writes the float32
    accumulator (8 V H bytes) for the 2 C V H flops of its weight-gradient GEMM,
    which stays compute-bound on an H100 (~300 flops a byte) from C ~ 1200 on; at
    441 tokens (256 MiB at V = 151936) that traffic would cost about the GEMM
    saved (a static estimate, not yet measured on a GPU).
    """
    if with_entropy is None:
        with_entropy = options.get("entropy_coef", 0.0) != 0

    def loss_of(head, log_probs, entropy):
        return policy.policy_loss(log_probs.view(head.token_shape), old_log_probs, advantages, response_mask,
                                  entropy=None if entropy is None else entropy.view(head.token_shape), **options)  # fmt: skip

    def stand_ins(head):
        """Per-token log-probs and entropy standing in for those not formed yet."""
        log_probs = old_log_probs.detach().to(head.acc).reshape(-1).clone()
        return log_probs, torch.zeros_like(log_probs) if with_entropy else None

    def check_loss_arguments(head):
        """Every argument checked (by policy_loss itself, on stand-ins) before any
        GEMM; returns the loss's options, which sharded ranks must agree on."""
        if "entropy" in options:
            raise TypeError("policy_loss_from_hidden computes the entropy from the hidden states; pass "
                            "with_entropy=True")  # fmt: skip
        _validation.check_per_token(old_log_probs, "old_log_probs")
        if old_log_probs.shape != head.token_shape:
            raise ValueError(f"old_log_probs must have the token shape hidden.shape[:-1] = {tuple(head.token_shape)}; "
                             f"got {tuple(old_log_probs.shape)}")  # fmt: skip
        policy.check_current_policy(head.hidden if head.hidden.requires_grad else head.weight,
                                    "hidden states and LM head", old_log_probs)  # fmt: skip
        with torch.no_grad():
            loss_of(head, *stand_ins(head))
        return policy.options_to_agree(options)

    head, shard = _prepare(hidden, weight, labels, bias, temperature, ignore_index, with_entropy, logit_scale,
                           softcap, chunk_size, DEFAULT_CHUNK_BYTES if chunk_bytes is None else chunk_bytes, group,
                           vocab_start, check_loss_arguments)  # fmt: skip
    wants = tuple(t is not None and t.requires_grad for t in head.inputs)
    forms_gradients = (
        torch.is_grad_enabled() and any(wants) and options.get("ratio_level", "token") == "token"
        and head.backend != "reference" and labels.numel() and not torch.compiler.is_compiling()
        # A head whose GEMMs widen it (bf16 / fp16 on CPU) would be widened once more a
        # chunk for dL/dhidden: more than the GEMM saved costs there (measured).
        and _slab_rows(head.weight, head.acc) >= head.weight.shape[0]
        and shard is None  # (a vocabulary shard's head takes the composition)
    )  # fmt: skip
    if chunk_bytes is None:
        chunk_bytes = _GPU_GRADIENT_CHUNK_BYTES if forms_gradients and head.hidden.is_cuda else DEFAULT_CHUNK_BYTES
    if not forms_gradients:
        log_probs, entropy = _logprobs_of(head, labels, ignore_index, with_entropy, chunk_bytes, chunk_size, shard)
        return policy.policy_loss(log_probs, old_log_probs, advantages, response_mask, entropy=entropy, **options)

    # The stand-ins' values do not reach a formed token's gradient.
    acc = head.acc
    log_probs, entropy = stand_ins(head)
    entropy_term = options.get("entropy_coef", 0.0) != 0

    def token_gradients(t0, t1, lp, ent):
        log_probs[t0:t1] = lp
        if entropy is not None:
            entropy[t0:t1] = ent
        with torch.enable_grad():
            leaves = [log_probs.detach().requires_grad_()]
            if entropy_term:
                leaves.append(entropy.detach().requires_grad_())
            loss, _ = loss_of(head, leaves[0], leaves[1] if entropy_term else entropy)
            grads = torch.autograd.grad(loss, leaves)
        return grads[0][t0:t1].contiguous(), grads[1][t0:t1].contiguous() if entropy_term else None

    rows = _chunk_rows(head.hidden.shape[0], head.weight.shape[0], acc, head.softcap, chunk_bytes, chunk_size)
    with torch.no_grad():
        log_probs_out, entropy_out, *grads = _forward_with_gradients(
            head, ignore_index, with_entropy, rows, token_gradients, wants
        )
        loss, metrics = loss_of(head, log_probs_out, entropy_out if with_entropy else None)
    return _GradientsFromForward.apply(loss, *head.inputs, *grads), metrics
