"""Row reductions shared by the Triton kernels.

``softmax_stats`` is the one-read online softmax statistic that every
log-prob-like kernel starts from: for z = x * inv_t over a row of V logits,

    m = max_j z_j,   s = sum_j exp(z_j - m),   w = sum_j exp(z_j - m) (z_j - m)

so that logsumexp(z) = m + log s and the entropy is log s - w / s. The row is
read once, BLOCK_V elements at a time; when a block raises the running max from
m to m', the sums move to the new reference point:

    s' = a s,   w' = a (w + (m - m') s),   a = exp(m - m').

w is kept relative to the max (not as sum p z) so that large logits with a small
entropy do not cancel. -inf logits (masked vocabulary) add exactly nothing, and
a row that is all -inf gives s = 0 (so logsumexp = -inf); NaN propagates.
"""

import triton
import triton.language as tl


@triton.jit
def softmax_stats(row_ptr, V, inv_t, WITH_W: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    """(m, s, w) of z = row * inv_t; w is 0 unless WITH_W."""
    neg_inf = float("-inf")
    m = tl.full([], neg_inf, ACC)
    s = tl.zeros([], ACC)
    w = tl.zeros([], ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC) * inv_t
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # While every logit so far is -inf, use 0 as the reference point so that
        # no -inf - -inf appears; exp(-inf - 0) = 0 is then exact.
        ref = tl.where(m_new == neg_inf, 0.0, m_new).to(ACC)
        a = tl.exp(m - ref)
        shift = tl.where(m == neg_inf, 0.0, m - ref).to(ACC)
        d = z - ref
        e = tl.exp(d)
        if WITH_W:
            d_finite = tl.where(z == neg_inf, 0.0, d)  # e = 0 there; avoid 0 * -inf
            w = a * (w + shift * s) + tl.sum(e * d_finite, axis=0)
        s = a * s + tl.sum(e, axis=0)
        m = m_new
    return m, s, w
