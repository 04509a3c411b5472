"""The exact full-vocabulary KL of vocabulary-sharded logits: each rank's shard gives its
statistics under both policies and its own KL, one all-gather of 5 numbers a row, and the chain
rule of the KL over the shards (``_combine_kl``); the backward needs no collective."""

from __future__ import annotations

import torch

from .. import _ops, _validation, reference
from .._backend import select_backend
from .._distributed import FULL_KL, agree, gather_ranks, logits_layout
from .._rows import row_view


def _combine_kl(gathered, temps, temp_scalar, acc):
    """(KL [N], (M, log S, M', log S') [N, 4]) from the ranks' [world, N, 5]
    (m, log s, m', log s', KL_r), in float64, the same on every rank. With w_r
    and w'_r the shard masses under p and p_ref (module docstring's l_r - log S),
    the chain rule of the KL: KL = sum_r w_r KL_r + sum_r w_r log(w_r / w'_r)."""
    g = gathered.double()
    m, log_s, m_ref, log_s_ref, kl_r = g.unbind(-1)
    t = temps.double() if temps is not None else temp_scalar
    top, top_ref = m.amax(dim=0), m_ref.amax(dim=0)
    empty = torch.isneginf(m) & torch.isneginf(log_s)  # (as in combine_across_ranks)
    empty_ref = torch.isneginf(m_ref) & torch.isneginf(log_s_ref)
    mass = torch.where(empty, -torch.inf, log_s + torch.where(empty, 0.0, (m - top) / t))
    mass_ref = torch.where(empty_ref, -torch.inf, log_s_ref + torch.where(empty_ref, 0.0, (m_ref - top_ref) / t))
    total, total_ref = torch.logsumexp(mass, dim=0), torch.logsumexp(mass_ref, dim=0)
    log_w, log_w_ref = mass - total, mass_ref - total_ref
    term = torch.exp(log_w) * (kl_r + log_w - log_w_ref)
    term = torch.where(empty, 0.0, torch.where(empty_ref, torch.inf, term))  # p > 0 where p_ref = 0: +inf
    kl = term.sum(dim=0)
    nan_row = (
        torch.isnan(m).any(dim=0) | torch.isnan(m_ref).any(dim=0) | torch.isneginf(top) | torch.isneginf(top_ref)
        | torch.isnan(log_s).any(dim=0) | torch.isnan(log_s_ref).any(dim=0)
    )  # fmt: skip
    kl = torch.where(nan_row, torch.nan, kl)
    stats = torch.stack([top, torch.where(nan_row, torch.nan, total), top_ref, total_ref], dim=-1)
    return kl.to(acc), stats.to(acc)


class _ShardedFullKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ref_rows, temps, temp_scalar, shard, backend):
        rows = row_view(logits)
        acc = reference.compute_dtype(logits)
        n_rows = rows.shape[0] * rows.shape[1]
        local = torch.empty(n_rows, 5, dtype=acc, device=rows.device)
        if backend == "reference":
            x, y = rows.reshape(n_rows, rows.shape[-1]).to(acc), ref_rows.reshape(n_rows, rows.shape[-1]).to(acc)
            t = temps.unsqueeze(-1) if temps is not None else temp_scalar
            for column, z in ((0, x), (2, y)):
                top = z.amax(dim=-1)
                lse = torch.logsumexp((z - top.unsqueeze(-1)) / t, dim=-1)
                local[:, column], local[:, column + 1] = top, torch.where(torch.isneginf(top), -torch.inf, lse)
            local[:, 4] = reference.full_kl(x, y, temperature=temps if temps is not None else temp_scalar)
        else:
            kl_r, stats_r = _ops.full_kl_forward(rows, ref_rows, temps, temp_scalar, True, backend)
            local[:, :4], local[:, 4] = stats_r, kl_r
        kl, stats = _combine_kl(gather_ranks(local, shard), temps, temp_scalar, acc)
        ctx.save_for_backward(logits, ref_rows, temps, stats, kl)
        ctx.temp_scalar, ctx.backend = temp_scalar, backend
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        """dKL/dx = p (log p - log p_ref - KL) / T from the global statistics: no collective."""
        _ops.refuse_double_backward()
        logits, ref_rows, temps, stats, kl = ctx.saved_tensors
        if ctx.backend != "reference":
            return _ops.full_kl_gradient(logits, ref_rows, temps, ctx.temp_scalar, stats, kl, grad_kl, ctx.backend), *(None,) * 5
        rows = row_view(logits)
        grad_kl = grad_kl.to(kl.dtype).contiguous()
        n_rows = rows.shape[0] * rows.shape[1]
        x, y = rows.reshape(n_rows, rows.shape[-1]).to(kl.dtype), ref_rows.reshape(n_rows, rows.shape[-1]).to(kl.dtype)
        t = temps.unsqueeze(-1) if temps is not None else ctx.temp_scalar
        log_p = (x - stats[:, :1]) / t - stats[:, 1:2]
        log_ref = (y - stats[:, 2:3]) / t - stats[:, 3:4]
        p = log_p.exp()
        gap = torch.where(p > 0, log_p - log_ref - kl.unsqueeze(-1), 0.0)
        grad = (grad_kl.unsqueeze(-1) * p * gap / t).to(rows.dtype)
        return grad.reshape(logits.shape), *(None,) * 5


def full_kl_sharded(logits, ref_logits, temperature, group, vocab_start, check_kl_arguments):
    """The sharded form of ``kl.full_kl``: KL [...] of every row over the whole
    vocabulary; ``check_kl_arguments()`` returns the checked temperature."""
    checked = {}

    def check():
        checked["temperature"] = check_kl_arguments()
        return logits_layout(logits, temperature=checked["temperature"])

    shard = agree(group, check, vocab_start, FULL_KL, values=lambda: (checked["temperature"],))
    token_shape = logits.shape[:-1]
    acc = reference.compute_dtype(logits)
    temps, temp_scalar = _ops.split_row_param(_validation.flat_per_row(checked["temperature"], token_shape, acc))
    backend = "reference" if token_shape.numel() == 0 else select_backend(logits.device)
    kl = _ShardedFullKL.apply(logits, row_view(ref_logits.detach()), temps, temp_scalar, shard, backend)
    return kl.view(token_shape)
