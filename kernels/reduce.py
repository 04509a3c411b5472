"""Row reductions shared by the Triton kernels.

``softmax_stats`` is the one-read online softmax statistic that every
log-prob-like kernel starts from. For a row of V logits x at inverse
temperature inv_t = 1/T (T > 0, so the max of x is the max of x / T):

    m = max_j x_j,   d_j = (x_j - m) * inv_t,   s = sum_j exp(d_j),   w = sum_j exp(d_j) d_j

so that logsumexp(x / T) = m * inv_t + log s, log p_j = d_j - log s and the
entropy is log s - w / s. Differences are taken on the raw logits before
scaling, so large logits (|x| ~ 1e4) with T != 1 lose no absolute accuracy, and
w stays relative to the max so that a small entropy does not come from two
cancelling numbers of size |x|.

The row is read once, BLOCK_V elements at a time; when a block raises the
running max from m to m', the sums move to the new reference point:

    s' = a s,   w' = a (w + c s),   c = (m - m') * inv_t,   a = exp(c).

-inf logits (masked vocabulary) add exactly nothing; a row that is all -inf
gives s = 0 (log-probs NaN, as log_softmax gives); NaN propagates into s.
"""

import triton
import triton.language as tl


@triton.jit
def rebase(m, block_max, inv_t, ACC: tl.constexpr):
    """A running max m meeting a block's max: (m', ref, c, a) with m' the new max,
    ref the reference point the block's terms are taken from (m', or 0 while the
    row is all -inf so far, so that no -inf - -inf appears), c = (m - ref) inv_t
    the shift of the old terms' exponents and a = exp(c) their scale (both 0
    while m is -inf: there is nothing to rescale)."""
    neg_inf = float("-inf")
    m_new = tl.maximum(m, block_max)
    ref = tl.where(m_new == neg_inf, 0.0, m_new).to(ACC)
    c = tl.where(m == neg_inf, 0.0, (m - ref) * inv_t).to(ACC)
    a = tl.where(m == neg_inf, 0.0, tl.exp(c)).to(ACC)
    return m_new, ref, c, a


@triton.jit
def softmax_stats(row_ptr, V, inv_t, WITH_W: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    """(m, s, w) of the row as defined above; w is 0 unless WITH_W."""
    neg_inf = float("-inf")
    m = tl.full([], neg_inf, ACC)
    s = tl.zeros([], ACC)
    w = tl.zeros([], ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC)
        m_new, ref, c, a = rebase(m, tl.max(x, axis=0), inv_t, ACC)
        d = (x - ref) * inv_t
        e = tl.exp(d)
        if WITH_W:
            d_finite = tl.where(x == neg_inf, 0.0, d)  # e = 0 there; avoid 0 * -inf
            w = a * (w + c * s) + tl.sum(e * d_finite, axis=0)
        s = a * s + tl.sum(e, axis=0)
        m = m_new
    return m, s, w
