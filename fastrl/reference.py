"""Plain PyTorch references: the specification of every fastrl op.

Each function is written for clarity, not speed, and is correct in any floating
dtype: float64 inputs are computed in float64 (this is what the tests compare the
kernels against), every other dtype is computed in float32, as the kernels do.
They are differentiable with ordinary autograd and are also the ``reference``
backend. They assume validated arguments (the public API checks them).
"""

from __future__ import annotations

import math

import torch

from ._rows import compute_dtype


def _per_row(value, rows_shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or a tensor broadcastable to the row shape, as a [..., 1] tensor
    of ``dtype``; a Python scalar is rounded once, straight to ``dtype`` (a float64
    reference must not see a float32 rounding of it)."""
    t = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=dtype)
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


def _log_sum_exp_of_scaled(d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log s, s) per row for s = sum_v e^{d_v}, where max(d) = 0.

    s = n + t: n terms at the max are exactly 1, and t sums the rest. log s is
    taken as log n + log1p(t / n), not log(n + t): on a peaked row t is tiny
    (V e^{-gap}: 1e-10 for a gap of 33 at V = 32000) and n + t rounds most of it
    away even in float64, while the entropy of such a row is about t (1 + gap),
    so log(n + t) would lose it (2% off for a gap of 45). n is summed from the
    terms at the max themselves (each e = 1), so the gradient of log s is e / s
    for them too. A row without a 0 (a NaN, or all -inf) gives NaN."""
    e = d.exp()
    at_max = d == 0
    n = torch.where(at_max, e, 0.0).sum(dim=-1)
    t = torch.where(at_max, 0.0, e).sum(dim=-1)
    return n.log() + torch.log1p(t / n), n + t


def _entropy_of_scaled(d: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p(v) log p(v) with p = softmax(d), written as
    H = log s - sum_v e_v d_v / s with e = exp(d), s = sum e (the same quantity):
    with max(d) = 0 this keeps a peaked row's small entropy accurate in float32,
    where -sum p log p loses it. -inf entries (p = 0) add nothing."""
    log_s, s = _log_sum_exp_of_scaled(d)
    # masked_fill (not where) so that e * d has a finite gradient where e = 0.
    d_finite = d.masked_fill(torch.isneginf(d), 0.0)
    return log_s - (d.exp() * d_finite).sum(dim=-1) / s


def _quiet_rows(d: torch.Tensor, *outputs: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Gives a row of ``d`` into which no output's gradient flows a +0 gradient
    whatever its values: a padding row (an ignore_index label, an entropy the
    loss leaves out) may hold NaN or only -inf, and autograd's chain would give
    it 0 * NaN = NaN, which would reach every weight the gradient does. Each
    output (per row, computed from ``d``) comes with the rows it depends on d in
    (None: all; the log-prob: the rows whose label is not ignored); its
    gradient flows into a row where it is not 0 (a NaN flows). A row it flows
    into keeps autograd's gradient (NaN in, NaN out). Tensor hooks: the outputs'
    record where their gradients flow before d's gradient is summed; they
    compose with create_graph."""
    if not d.requires_grad:
        return
    flows = []

    def quiet(grad):
        moving = torch.stack(flows).any(0) if flows else None
        flows.clear()
        if grad is None:
            return None
        if moving is None:
            return torch.zeros_like(grad)
        return grad.masked_fill(~moving.to(grad.device).unsqueeze(-1), 0.0)

    def record(grad, rows):
        if grad is not None:  # (an undefined gradient flows nowhere)
            flows.append(grad != 0 if rows is None else (grad != 0) & rows)

    for y, rows in outputs:
        if y.requires_grad:
            y.register_hook(lambda grad, rows=rows: record(grad, rows))
    d.register_hook(quiet)


def _logprobs_of_scaled(d: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """log_softmax(d)[label] = d[label] - log s, 0 where label == ignore_index."""
    keep = labels != ignore_index
    index = torch.where(keep, labels, 0).long().unsqueeze(-1)
    chosen = torch.gather(d, -1, index).squeeze(-1) - _log_sum_exp_of_scaled(d)[0]
    return torch.where(keep, chosen, torch.zeros_like(chosen))


def entropy_from_logits(logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per row; -inf logits (masked vocabulary)
    have p = 0 and add nothing. A row with a zero incoming gradient gets a zero
    gradient (_quiet_rows)."""
    d = scaled_logits(logits, temperature)
    out = _entropy_of_scaled(d)
    _quiet_rows(d, (out, None))
    return out


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> torch.Tensor:
    """log_softmax(logits / T)[label] per token; 0 where label == ignore_index. A
    row with a zero incoming gradient gets a zero gradient (_quiet_rows)."""
    d = scaled_logits(logits, temperature)
    out = _logprobs_of_scaled(d, labels, ignore_index)
    _quiet_rows(d, (out, labels != ignore_index))
    return out


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_from_logits, entropy_from_logits) of the same distribution. z is
    computed once, so a low-precision input gets one rounded gradient, not two. A
    row whose two outputs get zero incoming gradients gets a zero gradient
    (_quiet_rows)."""
    z = scaled_logits(logits, temperature)
    out = _logprobs_of_scaled(z, labels, ignore_index), _entropy_of_scaled(z)
    _quiet_rows(z, (out[0], labels != ignore_index), (out[1], None))
    return out


def sum_pi_squared(logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """sum_v p(v)^2 of softmax(logits / T) per row (veRL's Σπ², for its
    optimal-token baseline), as exp(logsumexp(2 d) - 2 logsumexp(d)): d <= 0 with
    its max at 0, so both sums are at least 1 and a peaked row's value just below
    1 keeps its deficit. -inf logits (p = 0) add nothing; a row of only -inf
    gives NaN (as its log-probs)."""
    d = scaled_logits(logits, temperature)
    out = torch.exp(_log_sum_exp_of_scaled(2 * d)[0] - 2 * _log_sum_exp_of_scaled(d)[0])
    _quiet_rows(d, (out, None))
    return out


# ---- fused LM head ---------------------------------------------------------------------------


def lm_head_logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """(hidden @ weight.T + bias) * logit_scale, then softcap * tanh(x / softcap)
    when a softcap is given (Gemma's final-logit soft-capping), in the compute
    dtype of ``hidden`` (float32 for bf16 / fp16: the GEMM's accumulators, never
    rounded back to the input dtype). ``hidden`` [..., H], ``weight`` [V, H],
    ``bias`` [V]; the result is [..., V]."""
    acc = compute_dtype(hidden)
    x = hidden.to(acc) @ weight.to(acc).T
    if bias is not None:
        x = x + bias.to(acc)
    x = x * logit_scale
    if softcap is not None:
        x = softcap * torch.tanh(x / softcap)
    return x


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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs, entropy or None) of the logits of :func:`lm_head_logits`, as
    :func:`logprobs_and_entropy` gives them. Materialises the [..., V] logits:
    the specification, not the way to run it."""
    logits = lm_head_logits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    if with_entropy:
        return logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index)
    return logprobs_from_logits(logits, labels, temperature=temperature, ignore_index=ignore_index), None


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
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss_from_logits` on the logits of :func:`lm_head_logits`."""
    logits = lm_head_logits(hidden, weight, bias, logit_scale=logit_scale, softcap=softcap)
    return policy_loss_from_logits(logits, labels, old_log_probs, advantages, response_mask, temperature=temperature,
                                   ignore_index=ignore_index, with_entropy=with_entropy, **options)  # fmt: skip


# ---- sampling -------------------------------------------------------------------------------


def _unsampleable(logits: torch.Tensor) -> torch.Tensor:
    """The rows [...] with nothing to sample from: a NaN, a +inf (softmax(z) is
    NaN there: inf - inf), or only -inf. Their log-probs are NaN, their token -1."""
    return logits.isnan().any(-1) | (logits == math.inf).any(-1) | (logits == -math.inf).all(-1)


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
    top_p None or 1, min_p None or 0. A row with NaN or +inf, or of only -inf, is
    NaN throughout. Written with a sort for clarity; the kernels find the same
    thresholds without one.
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
    return torch.where(greedy, greedy_logq, logq).masked_fill(_unsampleable(x).unsqueeze(-1), math.nan)


def truncated_logprobs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    top_k: int | torch.Tensor | None = None,
    top_p: float | torch.Tensor | None = None,
    min_p: float | torch.Tensor | None = None,
    kept: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-prob of ``labels`` under the processed distribution of
    :func:`truncated_log_distribution` (-inf for a label outside the kept set).

    ``kept`` (instead of top_k / top_p / min_p): the kept set given, token ids
    [..., K] with -1 as padding (a repeated id counts once); the distribution is
    softmax(logits / T) renormalised over exactly those ids (T > 0). NaN for a
    row whose kept logits are all -inf or hold NaN or +inf, or that keeps none."""
    if kept is not None:
        x = logits.to(compute_dtype(logits))
        ids, vocab, index = kept.long(), x.shape[-1], labels.long().unsqueeze(-1)
        counts = torch.zeros(x.shape, dtype=torch.int64, device=x.device)
        member = counts.scatter_add_(-1, ids.clamp(0, vocab - 1), ((ids >= 0) & (ids < vocab)).long()) > 0
        kept_x = torch.where(member, x, float("-inf"))
        # shifted by the kept max before scaling (scaled_logits' reason: x / T overflows at T < 1)
        m = kept_x.amax(dim=-1, keepdim=True).detach()
        z = (kept_x - m) / _per_row(temperature, x.shape[:-1], x.dtype, x.device)
        logq = torch.log_softmax(torch.where(member, z, float("-inf")), dim=-1)
        bad_ids = ((ids < -1) | (ids >= vocab)).any(-1)  # (NaN: an id outside the vocabulary)
        out = logq.gather(-1, index).squeeze(-1)
        # a label not kept: -inf, with a zero gradient (not log_softmax's at a -inf entry)
        out = torch.where(member.gather(-1, index).squeeze(-1) | out.isnan(), out, float("-inf"))
        return out.masked_fill(bad_ids, math.nan)
    logq = truncated_log_distribution(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return logq.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


def raw_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """log_softmax(logits / T)[label] over the full vocabulary, what a trainer
    recomputes. A greedy row (T == 0) takes the T -> 0 limit: -log(number of
    logits equal to the max) for a maximal label, -inf otherwise. NaN for a row
    with nothing to sample (``_unsampleable``), greedy or not."""
    dtype = compute_dtype(logits)
    x = logits.to(dtype)
    t = _per_row(temperature, x.shape[:-1], dtype, x.device)
    greedy = t == 0
    z = (x - x.amax(dim=-1, keepdim=True)) / torch.where(greedy, 1.0, t)
    logp = torch.log_softmax(z, dim=-1)
    is_max = z == 0
    n_max = is_max.sum(dim=-1, keepdim=True).to(dtype)
    limit = torch.where(is_max, -torch.log(n_max), float("-inf"))
    logp = torch.where(greedy, limit, logp).masked_fill(_unsampleable(x).unsqueeze(-1), math.nan)
    return logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)


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
    """Philox4x32-10 (Salmon et al., SC'11) on 32-bit values held in int64 tensors
    (broadcast together; the four output words have their shape)."""
    # Python ints go to the tensors' device: broadcast, a CPU scalar would stay a
    # CPU tensor of the full shape, which a CUDA operand cannot meet.
    device = next((v.device for v in (c0, c1, c2, c3, k0, k1) if isinstance(v, torch.Tensor)), None)
    words = torch.broadcast_tensors(*(torch.as_tensor(v, device=device) & _MASK32 for v in (c0, c1, c2, c3, k0, k1)))
    shape, flat = words[0].shape, [w.reshape(-1) for w in words]
    out = [torch.empty(flat[0].numel(), dtype=torch.int64, device=flat[0].device) for _ in range(4)]
    # On a CPU, in pieces of 2^16 counters: the ten rounds' int64 temporaries stay
    # in its cache (5.8x faster than whole [N, V] tensors at N V = 6.4M). Each
    # counter's words depend on that counter alone. Elsewhere, and when traced by
    # torch.compile (no loop over a symbolic size), in one piece.
    n = flat[0].numel()
    step = 1 << 16 if flat[0].device.type == "cpu" and not torch.compiler.is_compiling() else max(n, 1)
    for start in range(0, n, step):
        piece = slice(start, start + step)
        for o, w in zip(out, _philox_rounds(*(f[piece] for f in flat))):
            o[piece] = w
    return tuple(o.view(shape) for o in out)


def _philox_rounds(c0, c1, c2, c3, k0, k1) -> tuple[torch.Tensor, ...]:
    """Philox4x32-10's ten rounds on equal-shaped 32-bit words."""
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
    """(tokens, logprobs, raw_logprobs, entropy): one draw per row from the
    processed distribution of :func:`truncated_log_distribution`, and that
    distribution's entropy -sum_v q(v) log q(v) over its kept tokens (0 for a
    greedy row's point mass).

    The draw is an exponential race: token = argmax_v log q(v) - log E_v over
    the kept set, E_v ~ Exp(1) independent, which picks v with probability q(v).
    E_v comes from Philox4x32-10 with key = the row's seed (64 bits) and counter
    (v, salt, offset low, offset high), salt = the row index for one batch-wide
    seed and 0 for per-row seeds (so a row with its own seed draws the same
    token wherever it sits in a batch). Greedy rows (T == 0) take the first argmax.
    A row with nothing to sample (``_unsampleable``) gets token -1, NaN log-probs
    and a NaN entropy.
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
    # E is drawn in float32 (as the kernels draw it); its log is taken in the compute dtype, as theirs.
    race = logq.reshape(n_rows, vocab) - torch.log(exponential_variate(w0, w1).to(logq.dtype))
    tokens = race.argmax(dim=-1).reshape(rows)
    t = _per_row(temperature, rows, compute_dtype(logits), dev).squeeze(-1)
    tokens = torch.where(t == 0, logits.argmax(dim=-1), tokens)
    logprobs = logq.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # NaN on a bad row, whatever its token
    return (tokens.masked_fill(_unsampleable(logits), -1), logprobs, raw_logprobs(logits, tokens, temperature),
            distribution_entropy(logq))  # fmt: skip


def distribution_entropy(logq: torch.Tensor) -> torch.Tensor:
    """-sum_v q(v) log q(v) over the last dimension of log-probabilities ``logq``
    (:func:`truncated_log_distribution`'s): a token outside the kept set (logq =
    -inf) adds 0, never 0 * -inf; a NaN row stays NaN; a point mass gives +0.0."""
    return -torch.where(logq == -math.inf, 0.0, logq.exp() * logq).sum(-1) + 0.0  # (+ 0.0: no -0.0)


# ---- KL and policy loss ---------------------------------------------------------------------
#
# Per-token tensors are [..., L]: the last dimension is a sequence's tokens, the
# leading ones index sequences. A token outside the mask is ignored entirely: its
# inputs may hold anything (NaN included), it adds nothing to any sum and gets
# zero gradient. Every division whose denominator counts tokens or sequences
# gives 0 when that count is 0, so an all-zero mask gives a loss of 0, never NaN.

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
RATIO_LEVELS = ("token", "sequence")
CORRECTION_MODES = ("truncate", "mask")

# Clamps, as veRL applies them: the token log-ratio of the PPO ratio, the
# sequence log-ratio of GSPO (above only), the k3 estimator's log-ratio and its
# result, and the log of a rollout-correction weight.
LOG_RATIO_CLAMP = 20.0
SEQ_LOG_RATIO_MAX = 10.0
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0
CORRECTION_LOG_CLAMP = 20.0


def _acc(t: torch.Tensor) -> torch.Tensor:
    return t.to(compute_dtype(t))


def _safe_div(num: torch.Tensor, den) -> torch.Tensor:
    """num / den with x / 0 := 0 (den counts tokens or sequences)."""
    den = torch.as_tensor(den, dtype=num.dtype, device=num.device)
    return torch.where(den == 0, torch.zeros_like(num), num / torch.where(den == 0, 1.0, den))


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values where mask, else 0 (NaN outside the mask cannot leak, even into gradients)."""
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return _safe_div(_masked(values, mask).sum(), mask.sum())


def _exp_minus_one_minus_identity(c: torch.Tensor) -> torch.Tensor:
    """e^c - 1 - c, accurate near c = 0 where e^c - c - 1 cancels (relative error
    ~ eps / c^2): for |c| <= 1 it is c^2/2 q(c), q = 1 + c/3 (1 + c/4 (1 + ... (1 + c/top)))
    the Taylor series of (e^c - 1 - c) / (c^2/2) summed from the inside, with top
    (10 in float32, 18 in float64) such that the first term left out is below
    half an ulp (csrc/kl.h, expm1_parts, has the error analysis). Its autograd
    derivative is e^c - 1, as accurate."""
    small = c.abs() <= 1
    x = torch.where(small, c, 0.0)  # the series only where it converges fast; finite gradients elsewhere
    q = torch.ones_like(c)
    for n in range(18 if c.dtype == torch.float64 else 10, 2, -1):
        q = 1 + x * q / n
    return torch.where(small, 0.5 * x * x * q, c.exp() - 1 - c)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "low_var_kl") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs,
    with d = log_probs - ref_log_probs (J. Schulman, "Approximating KL divergence"):

        "kl" / "k1"          d
        "abs"                |d|
        "mse" / "k2"         d^2 / 2
        "low_var_kl" / "k3"  clamp(e^c - c - 1, -10, 10),  c = clamp(-d, -20, 20)
                             (e^c - c - 1 evaluated without cancellation near c = 0)

    A trailing "+" (e.g. "k3+") is the straight-through variant: the value of the
    named estimator with the gradient of k2 (whose expected gradient is the true
    KL gradient). Elementwise, no mask; fp32 (fp64 for fp64 input)."""
    straight_through = estimator.endswith("+")
    base = estimator[:-1] if straight_through else estimator
    d = _acc(log_probs) - _acc(ref_log_probs)
    if base in ("kl", "k1"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * d.square()
    else:
        c = (-d).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        value = _exp_minus_one_minus_identity(c).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)
    if not straight_through or base in ("mse", "k2"):
        return value
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value.detach()


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    *,
    dp_size: int = 1,
    batch_num_tokens: int | float | torch.Tensor | None = None,
    global_batch_size: int | float | torch.Tensor | None = None,
    loss_scale_factor: int | float | None = None,
) -> torch.Tensor:
    """Aggregates a [..., L] per-token loss over the valid tokens to a 0-d tensor,
    as veRL's ``core_algos.agg_loss`` does (S = the masked sum):

        token-mean               S / N * dp        N = batch_num_tokens, default: valid tokens here
        token-sum                S * dp
        seq-mean-token-sum       sum_i S_i / G * dp        S_i: sequence i's masked sum
        seq-mean-token-mean      sum_i (S_i / n_i) / G * dp    n_i: its valid tokens
        seq-mean-token-sum-norm  seq-mean-token-sum / loss_scale_factor (default L)

    G = global_batch_size, default: the sequences here with a valid token; dp =
    dp_size (the global N and G are then required, as in veRL). Sequences with
    no valid token add nothing; a zero N, G or L gives 0."""
    mask = loss_mask.bool()
    values = _masked(_acc(loss_mat), mask)
    if loss_agg_mode == "token-mean":
        n = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return _safe_div(values.sum(), n) * dp_size
    if loss_agg_mode == "token-sum":
        return values.sum() * dp_size
    seq_tokens = mask.sum(dim=-1)
    seq_sums = values.sum(dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        seq_sums = _safe_div(seq_sums, seq_tokens)
    g = (seq_tokens > 0).sum() if global_batch_size is None else global_batch_size
    loss = _safe_div(seq_sums.sum(), g) * dp_size
    if loss_agg_mode == "seq-mean-token-sum-norm":
        loss = _safe_div(loss, loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)  # L may be 0
    return loss


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    ratio_level: str = "token",
    loss_agg_mode: str = "token-mean",
    rollout_is_weights: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "low_var_kl",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    dp_size: int = 1,
    batch_num_tokens=None,
    global_batch_size=None,
    loss_scale_factor=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The PPO / GRPO / GSPO policy loss of veRL's ``compute_policy_loss_vanilla``
    (``ratio_level="token"``) or ``compute_policy_loss_gspo`` (``"sequence"``),
    aggregated by :func:`agg_loss`, plus the KL and entropy terms veRL's actor adds:

        u     = log_probs - old_log_probs
        token:     log r = clamp(u, -20, 20)
        sequence:  log r = min(log_probs - sg[log_probs] + sg[mean_i(u)], 10)
                   (mean_i over sequence i's valid tokens; sg = stop-gradient)
        l1 = -A r,  l2 = -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high),  l = max(l1, l2)
        dual clip (clip_ratio_c given, A < 0):  l = min(l, -A clip_ratio_c)
        l *= rollout_is_weights (when given)
        loss = agg(l) + kl_coef agg(kl_penalty(log_probs, ref_log_probs)) - entropy_coef agg(entropy)

    Gradients reach ``log_probs`` and ``entropy``; the other inputs are constants.
    Metrics (0-d fp32, detached): pg_loss = agg(l); pg_clipfrac = mean(l2 > l1);
    pg_clipfrac_lower = mean(A < 0 and max(l1, l2) > -A clip_ratio_c) (0 without
    dual clip); ppo_kl = mean(-log r) at token level, mean(-u) at sequence level;
    kl = agg(kl_penalty) and entropy = agg(entropy) when given. Means are over
    the valid tokens."""
    mask = response_mask.bool()
    dtype = compute_dtype(log_probs)
    take = lambda t: _masked(t.to(dtype), mask)  # noqa: E731
    logp, old, adv = take(log_probs), take(old_log_probs), take(advantages)
    u = logp - old
    if ratio_level == "token":
        log_ratio = u.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ppo_kl = _masked_mean(-log_ratio, mask)
    else:
        seq_mean = _safe_div(u.sum(dim=-1, keepdim=True), mask.sum(dim=-1, keepdim=True))
        # logp - sg[logp] is exactly 0: the value is the sequence's mean log-ratio.
        log_ratio = (logp - logp.detach() + seq_mean.detach()).clamp(max=SEQ_LOG_RATIO_MAX)
        ppo_kl = _masked_mean(-u, mask)
    ratio = log_ratio.exp()
    l1 = -adv * ratio
    l2 = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_tok = torch.maximum(l1, l2)
    clipfrac = _masked_mean((l2 > l1).to(dtype), mask)
    clipfrac_lower = torch.zeros((), dtype=dtype, device=logp.device)
    if clip_ratio_c is not None:
        l3 = -adv * clip_ratio_c
        clipfrac_lower = _masked_mean(((loss_tok > l3) & (adv < 0)).to(dtype), mask)
        loss_tok = torch.where(adv < 0, torch.minimum(loss_tok, l3), loss_tok)
    if rollout_is_weights is not None:
        loss_tok = loss_tok * take(rollout_is_weights)

    def agg(values):
        return agg_loss(
            values, mask, loss_agg_mode, dp_size=dp_size, batch_num_tokens=batch_num_tokens,
            global_batch_size=global_batch_size, loss_scale_factor=loss_scale_factor,
        )  # fmt: skip

    pg_loss = agg(loss_tok)
    loss = pg_loss
    metrics = {"pg_loss": pg_loss, "pg_clipfrac": clipfrac, "pg_clipfrac_lower": clipfrac_lower, "ppo_kl": ppo_kl}
    if ref_log_probs is not None:
        kl = agg(kl_penalty(logp, take(ref_log_probs), kl_estimator))
        loss = loss + kl_coef * kl
        metrics["kl"] = kl
    if entropy is not None:
        ent = agg(take(entropy))
        loss = loss - entropy_coef * ent
        metrics["entropy"] = ent
    return loss, {name: value.detach().float() for name, value in metrics.items()}


def _masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """max (or min) of values where mask, 0 when nothing is valid (an empty tensor included)."""
    fill = -math.inf if largest else math.inf
    flat = torch.cat([values.masked_fill(~mask, fill).reshape(-1), values.new_full((1,), fill)])
    extreme = flat.max() if largest else flat.min()
    return torch.where(mask.any(), extreme, torch.zeros_like(extreme))


def rollout_correction(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    clip_max: float = 2.0,
    clip_min: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Importance weights pi_old / pi_rollout that correct for the rollout engine's
    mismatch with the trainer (veRL's ``compute_rollout_correction_weights``):

        token:     w = exp(clamp(u, -20, 20)),        u = old_log_probs - rollout_log_probs
        sequence:  w = exp(clamp(S_i, -20, 20))       on every valid token of sequence i, S_i = sum_i u
        truncate:  w = clamp(w, clip_min, clip_max)   (TIS; no lower bound when clip_min is None)
        mask:      w = w if clip_min <= w <= clip_max else 0   (IcePop; clip_min None: no lower bound)

    and 0 outside the mask. Returns (weights fp32 detached, metrics of 0-d fp32
    tensors), with veRL's definitions (``compute_is_metrics``), low = clip_min, or
    1 / clip_max when clip_min is None:

        rollout_is_mean / _std, rollout_is_eff_sample_size = mean(w)^2 / mean(w^2)
            of the applied weights over the valid tokens (both levels)
        token level:     rollout_is_max / _min of the applied weights, and
                         rollout_is_ratio_fraction_high / _low the fraction of valid
                         tokens whose raw weight (before truncation) is > clip_max / < low
        sequence level:  rollout_is_max = exp(min(max_i S_i, 20)), rollout_is_min =
                         exp(min_i S_i) (the raw sequence weights, before truncation),
                         and the fractions of sequences with exp(S_i) > clip_max / < low
        mode "mask":     rollout_is_masked_fraction, the valid tokens whose weight is set to 0

    A sequence with no valid token is ignored (veRL counts it as one of weight 1)."""
    mask = response_mask.bool()
    dtype = compute_dtype(old_log_probs)
    u = _masked(old_log_probs.to(dtype) - rollout_log_probs.to(dtype), mask)
    seq_log_w = u.sum(dim=-1, keepdim=True)
    log_w = u if level == "token" else seq_log_w.expand_as(u)
    raw = log_w.clamp(-CORRECTION_LOG_CLAMP, CORRECTION_LOG_CLAMP).exp()
    lower = 0.0 if clip_min is None else clip_min
    if mode == "truncate":
        weights = raw.clamp(lower, clip_max)
    else:
        kept = (raw >= lower) & (raw <= clip_max)
        weights = torch.where(kept, raw, 0.0)
    weights = _masked(weights, mask)
    mean = _masked_mean(weights, mask)
    mean_sq = _masked_mean(weights.square(), mask)
    low = 1.0 / clip_max if clip_min is None else clip_min
    if level == "token":
        largest, smallest, units, unit_raw = weights, weights, mask, raw
    else:
        units = mask.any(dim=-1, keepdim=True)  # the sequences, each counted once
        largest, smallest = seq_log_w.clamp(max=CORRECTION_LOG_CLAMP).exp(), seq_log_w.exp()
        unit_raw = smallest
    metrics = {
        "rollout_is_mean": mean,
        "rollout_is_max": _masked_extreme(largest, units, largest=True),
        "rollout_is_min": _masked_extreme(smallest, units, largest=False),
        "rollout_is_std": (mean_sq - mean.square()).clamp(min=0).sqrt(),
        "rollout_is_eff_sample_size": _safe_div(mean.square(), mean_sq),
        "rollout_is_ratio_fraction_high": _masked_mean((unit_raw > clip_max).to(dtype), units),
        "rollout_is_ratio_fraction_low": _masked_mean((unit_raw < low).to(dtype), units),
    }
    if mode == "mask":
        metrics["rollout_is_masked_fraction"] = _masked_mean((~kept).to(dtype), mask)
    return weights.detach().float(), {name: value.float() for name, value in metrics.items()}


def full_kl(logits: torch.Tensor, ref_logits: torch.Tensor, *, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Exact KL(p || p_ref) = sum_v p(v) (log p(v) - log p_ref(v)) per token, with
    p = softmax(logits / T) and p_ref = softmax(ref_logits / T) (the same T).
    Differentiable w.r.t. ``logits``; ``ref_logits`` is a constant. A token with
    p(v) = 0 adds nothing; one with p(v) > 0 = p_ref(v) makes the KL +inf.

    With r_v = (x_v - max x) - (y_v - max y) on the raw logits,
    log p(v) - log p_ref(v) = r_v / T - log s + log s_ref, so
    KL = sum_v (p(v) r_v) / T - log s + log s_ref. Formed in that order, a KL
    that is a float stays one where r_v / T is not: a reference masked with
    finfo.min at T < 1 (the KL is then about 1e38)."""
    x = logits.to(compute_dtype(logits))
    y = ref_logits.detach().to(x.dtype)
    dx = x - x.amax(dim=-1, keepdim=True).detach()  # the shift has zero gradient anyway
    dy = y - y.amax(dim=-1, keepdim=True)
    if isinstance(temperature, torch.Tensor):
        inv_t = 1.0 / _per_row(temperature, logits.shape[:-1], x.dtype, x.device)
    else:
        inv_t = torch.tensor(1.0 / temperature, dtype=x.dtype, device=x.device)
    log_s = torch.logsumexp(dx * inv_t, dim=-1)
    log_s_ref = torch.logsumexp(dy * inv_t, dim=-1)
    p = torch.exp(dx * inv_t - log_s.unsqueeze(-1))
    # masked_fill (not where) keeps the gradient finite where p = 0 and r may be -inf.
    r = (dx - dy).masked_fill(p == 0, 0.0)
    return (inv_t.squeeze(-1) * (p * r).sum(dim=-1)) - log_s + log_s_ref


def policy_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    temperature: float | torch.Tensor = 1.0,
    ignore_index: int = -100,
    with_entropy: bool | None = None,
    **options,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """:func:`policy_loss` on the log-probs (and, when ``entropy_coef != 0`` or
    ``with_entropy``, the entropy) of ``logits`` at temperature T."""
    if with_entropy is None:
        with_entropy = options.get("entropy_coef", 0.0) != 0
    if with_entropy:
        log_probs, entropy = logprobs_and_entropy(logits, labels, temperature=temperature, ignore_index=ignore_index)
    else:
        log_probs = logprobs_from_logits(logits, labels, temperature=temperature, ignore_index=ignore_index)
        entropy = None
    return policy_loss(log_probs, old_log_probs, advantages, response_mask, entropy=entropy, **options)
