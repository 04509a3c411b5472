"""Plain PyTorch references: the specification of every fastrl op.

Each function is written for clarity, not speed, and is correct in any floating
dtype: float64 inputs are computed in float64 (this is what the tests compare the
kernels against), every other dtype is computed in float32, as the kernels do.
They are differentiable with ordinary autograd and are also the ``reference``
backend. They assume validated arguments (the public API checks them).
"""

from __future__ import annotations

import torch


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    """float64 stays float64; bf16 / fp16 / fp32 are computed in float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _per_row(value, rows_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or a tensor broadcastable to the row shape, as a [..., 1] tensor."""
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value)
    return t.to(dtype=dtype, device=device).expand(rows_shape).unsqueeze(-1)


def scaled_logits(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """d = (logits - max(logits)) / T per row, in the compute dtype.

    log_softmax and the entropy do not change when a row is shifted, so every
    op here works on d instead of logits / T: taking the difference on the raw
    logits before dividing keeps it exact in float32 even for |logits| ~ 1e4.
    A tensor temperature holds one value per row (broadcastable to
    ``logits.shape[:-1]``). A row that is all -inf gives NaN."""
    x = logits.to(compute_dtype(logits))
    d = x - x.amax(dim=-1, keepdim=True).detach()  # the shift has zero gradient anyway
    if isinstance(temperature, torch.Tensor):
        return d / _per_row(temperature, logits.shape[:-1], d.dtype, d.device)
    return d / temperature


def _entropy_of_scaled(d: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p(v) log p(v) with p = softmax(d), written as
    H = log s - sum_v e_v d_v / s with e = exp(d), s = sum e (the same quantity):
    with max(d) = 0 this keeps a peaked row's small entropy accurate in float32,
    where -sum p log p loses it. -inf entries (p = 0) add nothing."""
    e = d.exp()
    s = e.sum(dim=-1)
    # masked_fill (not where) so that e * d has a finite gradient where e = 0.
    d_finite = d.masked_fill(torch.isneginf(d), 0.0)
    return s.log() - (e * d_finite).sum(dim=-1) / s


def _logprobs_of_scaled(d: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """log_softmax(d)[label], 0 where label == ignore_index."""
    logp = torch.log_softmax(d, dim=-1)
    keep = labels != ignore_index
    index = torch.where(keep, labels, 0).long().unsqueeze(-1)
    chosen = torch.gather(logp, -1, index).squeeze(-1)
    return torch.where(keep, chosen, torch.zeros_like(chosen))


def entropy_from_logits(logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per row; -inf logits (masked vocabulary)
    have p = 0 and add nothing."""
    return _entropy_of_scaled(scaled_logits(logits, temperature))


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """log_softmax(logits / T)[label] per token; 0 where label == ignore_index."""
    return _logprobs_of_scaled(scaled_logits(logits, temperature), labels, ignore_index)


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of the same distribution. z is
    computed once, so a low-precision input gets one rounded gradient, not two."""
    z = scaled_logits(logits, temperature)
    return _logprobs_of_scaled(z, labels, ignore_index), _entropy_of_scaled(z)


# ---- sampling -------------------------------------------------------------------------------


def truncated_log_distribution(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probabilities of the processed (truncated, renormalised) distribution
    that ``fastrl.sample`` draws from; -inf outside the kept set. The definition,
    applied per row:

    1. z = logits / T. T == 0 is greedy: the lowest-index argmax gets log-prob 0.
    2. top-k (k >= 1, < V): keep the tokens whose logit is >= the k-th largest
       logit (ties at the threshold are kept).
    3. top-p (p < 1): with q = softmax(z) renormalised over the top-k set, keep a
       token if the mass of the tokens strictly above it (larger logit) is < p.
    4. min-p (> 0): keep the tokens with prob >= min_p * max prob, i.e.
       z - max(z) >= log(min_p).
    5. Renormalise softmax(z) over the tokens kept by all three.

    Each step keeps every token at or above a threshold logit, so the kept set is
    {logit >= the largest of the three thresholds}. Off: top_k None or 0,
    top_p None or 1, min_p None or 0. Written with a sort for clarity; the
    kernels find the same thresholds without one.
    """
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    rows, vocab, dev = x.shape[:-1], x.shape[-1], x.device
    t = _per_row(temperature, rows, dtype, dev)
    greedy = t == 0
    z = (x - x.amax(dim=-1, keepdim=True)) / torch.where(greedy, 1.0, t)  # shifted: max(z) = 0
    keep = torch.ones_like(z, dtype=torch.bool)
    if top_k is not None:
        k = _per_row(top_k, rows, torch.int64, dev)
        k = torch.where((k <= 0) | (k >= vocab), vocab, k)
        kth = torch.sort(x, dim=-1, descending=True).values.gather(-1, k - 1)
        keep &= x >= kth
    if top_p is not None:
        p = _per_row(top_p, rows, dtype, dev)
        q = torch.softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
        zk = z.masked_fill(~keep, float("-inf"))
        order = torch.sort(zk, dim=-1, descending=True)
        cum = torch.cumsum(q.gather(-1, order.indices), dim=-1)
        # Mass strictly above token i: the cumulative mass of all tokens ranked
        # before the first token with i's value (ties share it).
        n_above = torch.searchsorted(-order.values.contiguous(), -zk.contiguous(), side="left")
        mass_above = torch.where(n_above > 0, cum.gather(-1, (n_above - 1).clamp(min=0)), 0.0)
        keep &= (mass_above < p) | (p >= 1)
    if min_p is not None:
        mp = _per_row(min_p, rows, dtype, dev)
        keep &= (z >= torch.log(mp)) | (mp <= 0)
    logq = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    first_max = torch.zeros_like(keep).scatter_(-1, x.argmax(dim=-1, keepdim=True), True)
    greedy_logq = torch.zeros_like(z).masked_fill(~first_max, float("-inf"))
    return torch.where(greedy, greedy_logq, logq)


def truncated_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of ``labels`` under the processed distribution of
    :func:`truncated_log_distribution` (-inf for a label outside the kept set)."""
    logq = truncated_log_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return logq.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def raw_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[label] over the full vocabulary, what a trainer
    recomputes. A greedy row (T == 0) takes the T -> 0 limit: -log(number of
    logits equal to the max) for a maximal label, -inf otherwise."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    t = _per_row(temperature, x.shape[:-1], dtype, x.device)
    greedy = t == 0
    z = (x - x.amax(dim=-1, keepdim=True)) / torch.where(greedy, 1.0, t)
    logp = torch.log_softmax(z, dim=-1)
    is_max = z == 0
    n_max = is_max.sum(dim=-1, keepdim=True).to(dtype)
    limit = torch.where(is_max, -torch.log(n_max), float("-inf"))
    return torch.where(greedy, limit, logp).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


_MASK32 = 0xFFFFFFFF


def _mulhilo32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for 32-bit a (int64 tensor) and b,
    split so that no int64 product overflows."""
    a_lo, a_hi = a & 0xFFFF, a >> 16
    t0 = a_lo * b  # < 2^48
    t1 = a_hi * b  # < 2^48
    mid = t0 + ((t1 & 0xFFFF) << 16)
    return (t1 >> 16) + (mid >> 32), mid & _MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10 (Salmon et al., SC'11) on 32-bit values held in int64 tensors."""
    c0, c1, c2, c3 = (torch.as_tensor(c) & _MASK32 for c in (c0, c1, c2, c3))
    k0, k1 = torch.as_tensor(k0) & _MASK32, torch.as_tensor(k1) & _MASK32
    for _ in range(10):
        hi0, lo0 = _mulhilo32(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo32(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def exponential_variate(w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    """Exp(1) variate -log(1 - U) from two random words, U = w0 2^-32 +
    (w1 + 1/2) 2^-64 in (0, 1], resolved to 2^-65 near 0 so that the race below
    reaches tokens of any probability above ~1e-15 at their exact rate (float32,
    as the kernels compute it)."""
    u = w0.to(torch.float32) * 2.0**-32 + (w1.to(torch.float32) + 0.5) * 2.0**-64
    series = u
    for n in range(2, 9):  # U + U^2/2 + ... + U^8/8, where 1 - U would lose U's low bits
        series = series + u**n / n
    return torch.where(u >= 0.0625, -torch.log1p(-u), series)


def sample(
    logits: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    seed: int | torch.Tensor = 0,
    offset: int | torch.Tensor = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tokens, logprobs, raw_logprobs): one draw per row from the processed
    distribution of :func:`truncated_log_distribution`.

    The draw is an exponential race: token = argmax_v log q(v) - log E_v over
    the kept set, E_v ~ Exp(1) independent, which picks v with probability q(v).
    E_v comes from Philox4x32-10 with key = the row's seed (64 bits) and counter
    (v, salt, offset low, offset high), salt = the row index for one batch-wide
    seed and 0 for per-row seeds (so a row with its own seed draws the same
    token wherever it sits in a batch). Greedy rows (T == 0) take the first argmax.
    """
    logq = truncated_log_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    rows, vocab, dev = logits.shape[:-1], logits.shape[-1], logits.device
    n_rows = int(torch.tensor(rows).prod()) if len(rows) else 1
    if isinstance(seed, torch.Tensor):
        seeds = seed.to(torch.int64).expand(rows).reshape(-1, 1)
        salt = torch.zeros(n_rows, 1, dtype=torch.int64, device=dev)
    else:
        seeds = torch.full((n_rows, 1), seed, dtype=torch.int64, device=dev)
        salt = torch.arange(n_rows, device=dev).unsqueeze(-1)
    off = int(offset) if not isinstance(offset, torch.Tensor) else int(offset.reshape(-1)[0])
    index = torch.arange(vocab, device=dev).unsqueeze(0)
    w0, w1, _, _ = philox4x32_10(index, salt, off & _MASK32, off >> 32, seeds & _MASK32, (seeds >> 32) & _MASK32)
    race = logq.reshape(n_rows, vocab) - torch.log(exponential_variate(w0, w1)).to(logq.dtype)
    tokens = race.argmax(dim=-1).reshape(rows)
    t = _per_row(temperature, rows, compute_dtype(logits), dev).squeeze(-1)
    tokens = torch.where(t == 0, logits.argmax(dim=-1), tokens)
    logprobs = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, logprobs, raw_logprobs(logits, tokens, temperature)
