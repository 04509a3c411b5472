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

Accuracy on peaked rows, where users watch the entropy collapse: s = n + t,
with n the count of terms at the max (each exactly 1) and t the tail of tiny
terms, and the entropy of such a row is about t (1 + gap). A float32 sum that
holds a 1 drops every term below half an ulp of 1 (6e-8), which at V = 32000,
T = 1 is the whole tail (entropy 1e-7, off by 3%); even in float64, n + t
rounds t away past a gap of about 33 (1e-6 of the entropy, 2% at a gap of 45).
So n and t are kept apart to the end: each block sums its terms below the max
on their own (in ACC, a tree) and counts those at the max, the running n and t
are float64 scalars, and log s = log n + log1p(t / n) (``log_sum``).

Guards test the term, not the logit: (x - m) * inv_t overflows to -inf for
finite logits too (finfo.min masking at T < 1, or +-3e38 in one row), so a
term with exp(d) = 0 adds exactly 0 to w (never 0 * -inf), and a rescale with
a = 0 drops the old sums (c may be -inf). -inf logits (masked vocabulary) add
exactly nothing; a row that is all -inf gives s = 0 (log-probs NaN, as
log_softmax gives); NaN propagates into s (a block of only NaN has no max but
its terms are still summed, from the reference point 0).
"""

import triton
import triton.language as tl


@triton.jit
def row_start(base_ptr, row, inner, outer_stride, inner_stride):
    """Pointer to row ``row`` (int64) of an [outer, inner, V] strided view: rows
    are numbered row-major over the two leading dims (csrc/rows.h), so a sliced
    layout such as ``logits[:, :-1]`` is read in place."""
    return base_ptr + (row // inner) * outer_stride + (row % inner) * inner_stride


@triton.jit
def rebase(m, block_max, inv_t, ACC: tl.constexpr):
    """A running max m meeting a block's max: (m', ref, c, a) with m' the new max,
    ref the reference point the block's terms are taken from (m', or 0 while the
    row is all -inf so far, so that no -inf - -inf appears), c = (m - ref) inv_t
    the shift of the old terms' exponents (0 while m is -inf; -inf when the max
    rose beyond the float range) and a = exp(c) their scale (0 while m is -inf:
    there is nothing to rescale). a is evaluated in ACC and returned as float64:
    its rounding scales only the old terms, so it moves log s by an ulp of their
    share, which is small where the entropy is small (a float64 exp would cost
    the loop more than its sums)."""
    neg_inf = float("-inf")
    m_new = tl.maximum(m, block_max)
    ref = tl.where(m_new == neg_inf, 0.0, m_new).to(ACC)
    c = tl.where(m == neg_inf, 0.0, (m - ref) * inv_t).to(ACC)
    a = tl.where(m == neg_inf, 0.0, tl.exp(c)).to(tl.float64)
    return m_new, ref, c, a


@triton.jit
def shift_sums(s, w, c, a):
    """(s', w') = (a s, a (w + c s)): sums of e^d and of e^d times a quantity
    that grows with d by c, moved to the new reference point; a = 0 leaves
    nothing of the old terms (tested, so that 0 * -inf never appears)."""
    return a * s, tl.where(a == 0, 0.0, a * (w + c * s))


@triton.jit
def softmax_stats(row_ptr, V, inv_t, WITH_W: tl.constexpr, BLOCK_V: tl.constexpr, ACC: tl.constexpr):
    """(m, n, t, w) of the row as defined above (n, t, w in float64; s = n + t);
    w is 0 unless WITH_W."""
    neg_inf = float("-inf")
    m = tl.full([], neg_inf, ACC)
    n = tl.zeros([], tl.float64)
    t = tl.zeros([], tl.float64)
    w = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=neg_inf).to(ACC)
        block_max = tl.max(x, axis=0)
        m_new, ref, c, a = rebase(m, block_max, inv_t, ACC)
        d = (x - ref) * inv_t
        e = tl.exp(d)
        # When the max rose, the terms at the old max join the tail (c and a are
        # 0 and 1, or 0 and 0 while m is -inf, when it did not).
        grew = m_new > m
        t_shifted, w = shift_sums(n + t, w, c, a)
        t = tl.where(grew, t_shifted, t)
        n = tl.where(grew, 0.0, n)
        # For w, d is clamped to the lowest finite value: where d = -inf, e = 0 and
        # the term is 0 * finite = 0, never 0 * -inf (one instruction, no select).
        if WITH_W:
            w += tl.sum(e * tl.maximum(d, -3.4028234663852886e38), axis=0).to(tl.float64)
        if block_max >= m_new:
            # The block reaches the running max, whose terms are exactly 1: they are
            # counted apart (e - [d == 0] is the tail term), so that a peaked row's
            # tail is summed on its own, not into a 1 that drops it. Only such
            # blocks pay for the count (on a random row, about 3 of V / BLOCK_V).
            at_max = (d == 0).to(ACC)
            t += tl.sum(e - at_max, axis=0).to(tl.float64)
            n += tl.sum(at_max, axis=0).to(tl.float64)
        else:
            t += tl.sum(e, axis=0).to(tl.float64)
        m = m_new
    return m, n, t, w


@triton.jit
def log_sum(n, t):
    """log(n + t) for softmax_stats' float64 n and t, without rounding t away:
    log n + log1p(t / n), log1p by Goldberg's identity log1p(q) = log(u) q / (u - 1)
    with u = 1 + q (a few ulps; q where u rounds to 1). n = 0 (a row of only
    -inf, or NaN) gives log t."""
    q = t / n
    u = 1.0 + q
    log1p_q = tl.where(u == 1.0, q, tl.log(u) * (q / (u - 1.0)))
    return tl.where(n > 0, tl.log(n) + log1p_q, tl.log(t))
