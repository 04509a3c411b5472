"""Sampling and truncated log-probs of vocabulary-sharded logits (tensor parallelism): the
ranks agree on each row's max and kept threshold, then each reads its shard once (the method
below); the ranks' agreement and collectives: fastrl._distributed."""

from __future__ import annotations

import torch

from .. import _ops, reference
from .._backend import select_backend
from .._distributed import LABELED, Shard, agree, all_reduce_sum, gather_ranks, label_range, logits_layout
from .._rows import exact_mass_limbs, mass_logs, row_view
from .._validation import check_sampler_vocab
from .logprobs import in_vocabulary_order, whole_segments

# The processed distribution's kept set is {x >= tau} (with min-p's per-token test; sampling.py),
# so the ranks agree on the row's max M and on tau, then each reads its shard once:
#
#   1. one all-gather of the shards' maxima: M, and the rows with nothing to sample (NaN, +inf, all -inf);
#      on Triton, where every shard is whole segments of the row, of the shards' segments' statistics
#      instead (_row_sums: M with the unsharded kernel's float row sum s and log s);
#   2. top-k: a radix select of the k-th largest order key (the kernels' keys) over the whole row,
#      8 bits a round, over the bits the logits' dtype sets (2 rounds for bf16, 3 fp16, 4 fp32, 8
#      fp64): each rank counts its tokens of each digit under the prefix found so far (the kernel
#      shard_digit_histogram, or plain torch), one all-reduce (int64, exact in any order) sums the
#      counts;
#   3. top-p: the same descent weighted by mass, among the top-k tokens: the largest key u with
#      mass(key >= u) >= p * mass(top-k set) (on Triton, a row without top-k: p * s, as its unsharded
#      kernel weighs it, where step 1 gave s), masses in the unsharded kernels' integer fixed point
#      (native, and Triton's float64 rows: e * 2^(62 - bits of V) rounded to an int64, so that V of
#      them cannot overflow; Triton's float32 rows: its own 2^-42 units; kernels/sampling/compact.py,
#      _weight_units), exact sums in any order, with their counts, one all-reduce a round;
#   4. the shard pass (kernel): the shard's masses s and s_kept and its kept tokens' u = sum e (-d)
#      as exact integer sums (csrc/sampling.cpp, ExactMass; Triton: its units, compact._mass_units), and
#      the exponential race over its kept tokens with the global index as Philox counter, so each
#      rank's best score is the unsharded race's over those tokens (the same d = (x - M) / T, the
#      same variates); one all-gather of 80 bytes a row, and every rank takes the best score (ties:
#      the lowest index), adds the masses as integers and finishes them by the unsharded kernel's
#      formula (_ops.sample_mass_logs: log S, log S_kept, and the processed entropy
#      log S_kept + U / S_kept).
#
# With the same masses, threshold and race, the outputs are the unsharded sampler's bits on any split
# of the vocabulary (issue 39), and every rank gets them. On Triton, what its unsharded kernel weighs
# against the float row sum s (the raw log-prob's log s, a top-p target without top-k) is its bits
# where step 1 folds the segments (an even split of a V that is a multiple of 64 over 1, 2, 4 or 8
# ranks), else agrees to rounding.


def _weight_scale(vocab: int) -> float:
    """The fixed-point scale of a token's mass e = exp(d) in [0, 1] (step 3) on the native kernels
    (csrc/sampling.cpp, top_p_unit_scale) and Triton's float64 rows: V masses of at most
    2^(62 - bits of V) + 1/2 each sum below 2^63. (Triton's float32 rows weigh in the unsharded
    kernel's own units, whatever the scale: kernels/sampling/shard.py.)"""
    return 2.0 ** (62 - vocab.bit_length())


# Tokens a histogram pass reads at once (its int64 temporaries: 16 MiB each).
_CHUNK_ELEMENTS = 1 << 21


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' order-preserving keys of float32 / float64 logits (csrc/sampling.cpp
    order_key), as int64 holding the key's bits: 32-bit keys in [0, 2^32), 64-bit ones
    reinterpreted (so compare them only bit-wise, as the radix select does)."""
    x = x + 0.0  # -0.0 and +0.0 share a key
    if x.dtype == torch.float32:
        bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        return torch.where(bits >= 2**31, bits ^ 0xFFFFFFFF, bits | 2**31)
    bits = x.view(torch.int64)
    return torch.where(bits < 0, ~bits, bits ^ -(2**63))


def _key_values(keys: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The logits whose keys (``_order_keys``'s int64 bits) are ``keys``."""
    if dtype == torch.float32:
        bits = torch.where(keys >= 2**31, keys & 0x7FFFFFFF, ~keys & 0xFFFFFFFF)
        return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
    return torch.where(keys < 0, keys ^ -(2**63), ~keys).view(torch.float64)


def _row_chunks(rows: torch.Tensor):
    """(first row, [c, V_r] chunk in the compute dtype) over the flat rows of a row view, a copy of
    at most _CHUNK_ELEMENTS logits each."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    step = max(1, _CHUNK_ELEMENTS // max(vocab, 1))
    acc = reference.compute_dtype(rows)
    for first in range(0, n_rows, step):
        index = torch.arange(first, min(first + step, n_rows), device=rows.device)
        yield first, rows[index // inner, index % inner].to(acc)


# The key bits a logit dtype can set (sign, exponent, mantissa of its float32 or float64 value): bf16's
# float32 keys vary in their top 16 bits only (the low 16 are all zeros, or all ones for negative
# values), fp16's in their top 19: the search's rounds stop at the lowest digit that varies.
_KEY_BITS = {torch.bfloat16: 16, torch.float16: 19, torch.float32: 32, torch.float64: 64}


def _digit_shifts(dtype: torch.dtype) -> range:
    """The shifts of the 8-bit digits the threshold search finds, most significant first."""
    width = 64 if dtype == torch.float64 else 32
    return range(width - 8, width - _KEY_BITS[dtype] - 8, -8)


def _completed_key(prefix: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``prefix`` (the digits found) with the bits below them as every key of ``dtype`` has them:
    zeros for positive values (key's top bit set), ones for negative ones."""
    low = _digit_shifts(dtype)[-1]
    if low == 0:
        return prefix
    top = prefix < 0 if dtype == torch.float64 else prefix >= 2**31
    return torch.where(top, prefix, prefix | ((1 << low) - 1))


def _digit_histograms(rows, shard: Shard, prefix, shift, backend, params, floor=None, m=None) -> torch.Tensor:
    """[N, 256] counts (or with ``floor``, [N, 2, 256] counts and mass units of the tokens x >=
    floor) of the keys' 8-bit digit at ``shift`` among the row's keys that share ``prefix``'s bits
    above it, summed over the ranks (csrc/sampling.h, shard_digit_histogram; plain torch, chunked,
    on the reference backend)."""
    n_rows = prefix.shape[0]
    acc = reference.compute_dtype(rows)
    if backend != "reference":
        given = None if floor is None else torch.stack([m, floor], -1)
        hist = _ops.shard_digit_histogram(rows, prefix.contiguous(), shift, given,
                                          *_ops.split_row_param(params["temperature"]), _weight_scale(shard.vocab),
                                          backend)  # fmt: skip
    else:
        hist = torch.zeros(n_rows, 1 if floor is None else 2, 257, dtype=torch.int64, device=prefix.device)
        t = reference._per_row(params["temperature"], (n_rows,), acc, prefix.device)[:, 0]
        inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 1.0)
        for first, x in _row_chunks(rows):
            last = first + x.shape[0]
            keys = _order_keys(x)
            member = torch.ones_like(keys, dtype=torch.bool)
            if shift + 8 < (64 if acc == torch.float64 else 32):
                member = ((keys ^ prefix[first:last, None]) >> (shift + 8)) == 0
            if floor is not None:
                member &= x >= floor[first:last, None]
            digit = torch.where(member, (keys >> shift) & 255, 256)  # (bin 256: not counted)
            hist[first:last, 0].scatter_add_(1, digit, torch.ones_like(digit))
            if floor is not None:
                e = torch.exp((x - m[first:last, None]) * inv_t[first:last, None]).clamp(max=1.0)
                hist[first:last, 1].scatter_add_(1, digit, (e * _weight_scale(shard.vocab)).round().to(torch.int64))
        hist = hist[..., :256].contiguous()
    hist = all_reduce_sum(hist, shard)
    return hist[:, 0] if floor is None else hist


def _top_k_threshold(rows, shard: Shard, k: torch.Tensor, backend, params) -> torch.Tensor:
    """The k-th largest logit of each row over all shards (radix select, module comment)."""
    dtype = rows.dtype
    prefix = torch.zeros_like(k)
    need = k.clamp(min=1)
    for shift in _digit_shifts(dtype):
        hist = _digit_histograms(rows, shard, prefix, shift, backend, params)
        at_or_above = hist.flip(-1).cumsum(-1).flip(-1)  # tokens in this digit or a higher one
        # the highest digit from which down the count reaches `need` (0 if none: a row not selecting)
        digit = ((at_or_above >= need.unsqueeze(-1)).sum(-1) - 1).clamp(min=0)
        need = need - (at_or_above.gather(1, digit.unsqueeze(-1)) - hist.gather(1, digit.unsqueeze(-1))).squeeze(-1)
        prefix = prefix | (digit << shift)
    return _key_values(_completed_key(prefix, dtype), reference.compute_dtype(rows))


def _top_p_threshold(rows, shard: Shard, p, floor, m, backend, params, row_mass=None) -> torch.Tensor:
    """The largest logit u with mass(x >= u) >= p * mass(x >= floor) among the tokens x >= floor
    (the top-k set), per row over all shards; the lowest such logit when rounding leaves every
    mass short of the target (as csrc/sampling.cpp's mass_threshold_key). ``row_mass`` [N]
    (float64, NaN for a row that weighs its units): the mass against which a row without top-k
    weighs p instead, the Triton sampler's float row sum s (_row_sums), as its unsharded kernel
    does."""
    dtype = rows.dtype
    prefix = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)
    above = torch.zeros_like(prefix)  # mass units strictly above the current prefix's range
    target = None
    digits = torch.arange(256, device=p.device)
    for shift in _digit_shifts(dtype):
        counts, units = _digit_histograms(rows, shard, prefix, shift, backend, params, floor, m).unbind(1)
        if target is None:
            target = p.double() * units.sum(-1).double()
            if row_mass is not None:  # (in the units: a power of 2 times s, exact)
                scale = 2.0**42 if rows.dtype != torch.float64 else _weight_scale(shard.vocab)
                target = torch.where(row_mass.isnan(), target, p.double() * row_mass * scale)
        reached = above.unsqueeze(-1) + units.flip(-1).cumsum(-1).flip(-1)  # mass of this digit and up
        present = counts > 0
        ok = present & (reached.double() >= target.unsqueeze(-1))
        highest_ok = torch.where(ok, digits, -1).amax(-1)
        lowest_present = torch.where(present, digits, 256).amin(-1).clamp(max=255)
        digit = torch.where(highest_ok >= 0, highest_ok, lowest_present)
        above = (reached.gather(1, digit.unsqueeze(-1)) - units.gather(1, digit.unsqueeze(-1))).squeeze(-1)
        prefix = prefix | (digit << shift)
    return _key_values(_completed_key(prefix, dtype), reference.compute_dtype(rows))


def _kept(x, d, tau, min_p):
    """The kept tokens of [N, V_r] logits ``x`` with d = (x - M) / T, given each row's threshold
    ``tau`` [N, 1] and ``min_p`` [N]: x >= tau and d >= log(min_p) (sampling.py's kept set)."""
    return (x >= tau) & ((d >= torch.log(min_p).unsqueeze(-1)) | (min_p <= 0).unsqueeze(-1))


def _reference_shard_pass(rows, given, temps, temp_scalar, min_p, shard: Shard, seed=None, offset=0, labels=None):
    """The shard pass (csrc/sampling.h, sample_shard_pass) in plain torch: the reference backend's."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    acc = given.dtype
    x = rows.reshape(n_rows, vocab).to(acc)
    t = reference._per_row(temps if temps is not None else temp_scalar, (n_rows,), acc, x.device)[:, 0]
    mp = reference._per_row(min_p, (n_rows,), acc, x.device)[:, 0]
    m, tau = given[:, :1], given[:, 1:]
    greedy = (t == 0).unsqueeze(-1)
    d = (x - m) * torch.where(greedy, 1.0, 1.0 / t.unsqueeze(-1))
    kept = _kept(x, d, tau, mp)
    e = torch.exp(d).double()
    at_max = x == m
    columns = torch.arange(vocab, device=x.device) + shard.start
    sums = torch.zeros(n_rows, 5, dtype=torch.float64, device=x.device)
    picks = torch.full((n_rows, 2), -1, dtype=torch.int64, device=x.device)
    sums[:, 0] = torch.where(greedy.squeeze(-1), at_max.sum(-1).double(), e.sum(-1))
    sums[:, 1] = torch.where(greedy.squeeze(-1), 0.0, torch.where(kept, e, 0.0).sum(-1))
    # (a kept -inf logit, d = -inf, has e = 0 and adds 0, never 0 * inf)
    sums[:, 4] = torch.where(greedy.squeeze(-1), 0.0, torch.where(kept & (e > 0), -e * d.double(), 0.0).sum(-1))
    picks[:, 1] = torch.where(at_max.any(-1), columns[at_max.to(torch.int8).argmax(-1)], -1)
    if labels is None:
        if isinstance(seed, torch.Tensor):
            seeds, salt = seed.unsqueeze(-1), torch.zeros(n_rows, 1, dtype=torch.int64, device=x.device)
        else:
            seeds = torch.full((n_rows, 1), seed, dtype=torch.int64, device=x.device)
            salt = torch.arange(n_rows, device=x.device).unsqueeze(-1)
        off = int(offset) if not isinstance(offset, torch.Tensor) else int(offset.reshape(-1)[0])
        mask = 0xFFFFFFFF
        w0, w1, _, _ = reference.philox4x32_10(columns.unsqueeze(0), salt, off & mask, off >> 32, seeds & mask,
                                               (seeds >> 32) & mask)  # fmt: skip
        score = torch.where(kept, d - torch.log(reference.exponential_variate(w0, w1).to(acc)), -torch.inf)
        best, winner = score.max(-1)  # (ties: the first index)
        won = best > -torch.inf
        sums[:, 2] = torch.where(greedy.squeeze(-1), 0.0, best.double())
        sums[:, 3] = torch.where(greedy.squeeze(-1), 0.0, d.gather(1, winner.unsqueeze(-1)).squeeze(-1).double())
        picks[:, 0] = torch.where(won & ~greedy.squeeze(-1), winner + shard.start, -1)
    else:
        local = labels.long() - shard.start
        here = (local >= 0) & (local < vocab)
        at = local.clamp(0, vocab - 1).unsqueeze(-1)
        d_label = torch.where(kept.gather(1, at), d.gather(1, at), -torch.inf).squeeze(-1)
        sums[:, 2] = torch.where(greedy.squeeze(-1), 0.0, torch.where(here, d_label.double(), torch.nan))
    bad = ~(torch.isfinite(given[:, 0]))
    sums[bad] = torch.nan
    picks[bad] = -1
    hi, lo = exact_mass_limbs(sums[:, [0, 1, 4]].nan_to_num(0.0))
    return sums[:, 2:4].contiguous(), torch.stack([hi, lo], -1).reshape(n_rows, 6), picks


def _shard_pass(rows, given, params, shard: Shard, backend, seed=None, offset=0, labels=None):
    """This shard's (scores [N, 2] float64, masses [N, 6] int64, picks [N, 2] int64)
    (csrc/sampling.h, sample_shard_pass)."""
    temps, temp_scalar = _ops.split_row_param(params["temperature"])
    min_p_rows, min_p = _ops.split_row_param(params["min_p"])
    if backend == "reference":
        return _reference_shard_pass(rows, given, temps, temp_scalar, params["min_p"], shard, seed, offset, labels)
    seed_rows, seed_scalar = _ops.split_row_param(0 if seed is None else seed)
    offset_tensor, offset_scalar = _ops.split_row_param(offset)
    return _ops.sample_shard_pass(rows, given, temps, temp_scalar, min_p_rows, min_p, shard.start, seed_rows,
                                  seed_scalar, offset_tensor, offset_scalar, labels, backend)  # fmt: skip


def _row_sums(rows, params, shard: Shard, backend) -> torch.Tensor | None:
    """(m, s, log s) [N, 3] float64 of the whole rows as the unsharded Triton sampler's statistics
    pass gives them (kernels/sampling/sample.py, _select: its raw log-prob's log s, and the mass a
    row without top-k weighs its top-p target against), from every rank's segments
    (_ops.sample_segments, one all-gather of 24 bytes a segment) folded in vocabulary order
    (_ops.sample_segments_fold): bitwise the unsharded ones, where every shard is whole segments
    (fastrl._rows.segment_length: an even split of a V that is a multiple of 64 over 1, 2, 4 or 8
    ranks). None elsewhere: on the native backend, whose sampler weighs exact masses that the shard
    passes add up, and on another split (then to rounding)."""
    whole = whole_segments(shard)
    if backend != "triton" or whole is None:
        return None
    segment, counts = whole
    temps, temp = _ops.split_row_param(params["temperature"])
    n_rows = rows.shape[0] * rows.shape[1]
    local = torch.zeros(n_rows, max(counts) * 3, dtype=torch.float64, device=rows.device)
    local[:, : shard.local // segment * 3] = _ops.sample_segments(rows, temps, temp, shard.vocab, backend).reshape(
        n_rows, -1)  # fmt: skip
    in_order = in_vocabulary_order(gather_ranks(local, shard), counts, 3, shard)
    return _ops.sample_segments_fold(in_order, reference.compute_dtype(rows), temps, temp, backend)


def _kept_threshold(rows, params, shard: Shard, top_k_on: bool, top_p_on: bool, backend):
    """(given [N, 2] = (M, tau) in the compute dtype, bad [N], row sums [N, 3] or None): the row's
    global max and kept threshold (module comment, steps 1-3), the rows with nothing to sample or
    an invalid parameter, and _row_sums' (m, s, log s)."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    acc = reference.compute_dtype(rows)
    check_sampler_vocab(shard.vocab, backend)  # (the whole row's V, agreed: every rank raises)
    sums = _row_sums(rows, params, shard, backend)
    if sums is None:
        maxima = gather_ranks(rows.amax(-1).reshape(n_rows).to(acc), shard)
        m, nan = maxima.amax(0), maxima.isnan().any(0)
    else:  # (a NaN makes s NaN: kernels/reduce.py)
        m, nan = sums[:, 0].to(acc), sums[:, 1].isnan()
    t, k, p, mp = (reference._per_row(params[name], (n_rows,), dtype, rows.device)[:, 0]
                   for name, dtype in (("temperature", acc), ("top_k", torch.int64), ("top_p", acc), ("min_p", acc)))  # fmt: skip
    t_ok = (t == 0) | ((t > 0) & torch.isfinite(t) & torch.isfinite(1.0 / t))
    valid = t_ok & (k >= 0) & (p > 0) & (p <= 1) & (mp >= 0) & (mp <= 1)
    bad = nan | m.isnan() | ~torch.isfinite(m) | ~valid
    active = ~bad & (t > 0)
    m_safe = torch.where(bad, 0.0, m)
    tau = torch.full_like(m, -torch.inf)
    k_on = torch.zeros_like(active)
    if top_k_on:
        k_on = active & (k > 0) & (k < shard.vocab)
        tau = torch.where(k_on, _top_k_threshold(rows, shard, torch.where(k_on, k, 1), backend, params), tau)
    if top_p_on:
        p_on = active & (p < 1)
        # a row without top-k weighs p against the unsharded kernel's s where the ranks have it
        row_mass = None if sums is None else torch.where(k_on, torch.nan, sums[:, 1])
        tau = torch.where(p_on, _top_p_threshold(rows, shard, p, tau, m_safe, backend, params, row_mass), tau)
    return torch.stack([torch.where(bad, torch.nan, m), tau], -1), bad, sums


def _combine_shard_passes(scores, masses, picks, shard: Shard, backend, float64: bool):
    """Every rank's shard pass, gathered once ([world, N, 10] float64, the masses' int64
    bits among them) and combined: (token or the first max [N] int64, d of it, logs [N, 3]
    float64 = (log s, log s_kept, entropy), label d [N] float64, first max [N] int64), of
    float64 logits or not (``float64``). The masses are integers, so their sum is the same in
    any order (csrc/sampling.cpp, ExactMass; the Triton sampler's units,
    kernels/sampling/shard.py), and sample_mass_logs finishes them by the unsharded kernels'
    formula."""
    gathered = gather_ranks(torch.cat([scores, masses.view(torch.float64), picks.double()], -1), shard)
    score, d_win = gathered[..., 0], gathered[..., 1]
    winner, first = gathered[..., 8], gathered[..., 9]
    total_masses = gathered[..., 2:8].contiguous().view(torch.int64).sum(0)
    if backend == "reference":
        logs = mass_logs(total_masses)
    else:
        logs = _ops.sample_mass_logs(total_masses, float64, backend)
    first_max = torch.where(first >= 0, first, torch.inf).amin(0)
    best = score.amax(0)
    won = (score == best) & (winner >= 0)
    token = torch.where(won, winner, torch.inf).amin(0)
    d = torch.where(won & (winner == token), d_win, -torch.inf).amax(0)
    # Every kept draw lost (E = inf, ~2^-25 each): the first max, as the unsharded race.
    lost = torch.isinf(token)
    token = torch.where(lost, first_max, token)
    d = torch.where(lost, 0.0, d)
    # A label's d: from the shard holding it (the others' entry is NaN).
    label_d = torch.where(torch.isnan(score), -torch.inf, score).amax(0)
    label_d = torch.where(torch.isnan(score).all(0), torch.nan, label_d)
    first_max = torch.where(torch.isinf(first_max), -1, first_max).long()
    return torch.where(torch.isinf(token), -1, token).long(), d, logs, label_d, first_max


def _filters_on(params) -> tuple[bool, bool]:
    """Whether the call runs top-k's and top-p's rounds: decided from the arguments' kind, which
    the ranks have agreed on (a per-row tensor, or a scalar that is on), never from values that
    would need a host sync."""
    top_k, top_p = params["top_k"], params["top_p"]
    return isinstance(top_k, torch.Tensor) or top_k > 0, isinstance(top_p, torch.Tensor) or top_p < 1


def sample_sharded(logits, check, group, vocab_start):
    """The sharded form of ``sampling.sample``: (tokens, logprobs, raw_logprobs, entropy) [N] of this rank's
    vocabulary shard ``logits [..., V_r]``, the same on every rank; ``check()`` returns the checked
    (params, seed, offset) as sampling.sample holds them. The seed and offset change from call to
    call, so an agreed configuration leaves them out (fastrl._distributed): ranks whose seeds then
    differ still get the same token, each shard racing with its own rank's variates (an exact draw
    still), only not the unsharded sampler's for one seed."""
    checked = {}

    def layout():
        checked["params"], checked["seed"], checked["offset"] = check()
        return logits_layout(logits, ("seed", "offset"), **checked["params"], seed=checked["seed"],
                             offset=checked["offset"])  # fmt: skip

    shard = agree(group, layout, vocab_start, 0, values=lambda: (*checked["params"].values(), checked["seed"],
                                                                   checked["offset"]))  # fmt: skip
    params, seed, offset = checked["params"], checked["seed"], checked["offset"]
    rows, n_rows = row_view(logits), logits.shape[:-1].numel()
    acc = reference.compute_dtype(logits)
    if n_rows == 0:
        empty = lambda dt: torch.empty(n_rows, dtype=dt, device=logits.device)  # noqa: E731
        return empty(torch.int64), empty(acc), empty(acc), empty(acc)
    backend = select_backend(logits.device)
    given, bad, sums = _kept_threshold(rows, params, shard, *_filters_on(params), backend)
    token, d, logs, _, _ = _combine_shard_passes(*_shard_pass(rows, given, params, shard, backend, seed=seed,
                                                              offset=offset), shard, backend,
                                                 acc == torch.float64)  # fmt: skip
    greedy = reference._per_row(params["temperature"], (n_rows,), acc, logits.device)[:, 0] == 0
    log_s, log_kept, entropy = logs.to(acc).unbind(-1)
    if sums is not None:  # the unsharded Triton sampler's float log s (a greedy row's: the count of maxima)
        log_s = torch.where(greedy, log_s, sums[:, 2].to(acc))
    d = d.to(acc)
    logprob = torch.where(greedy, 0.0, d - log_kept)
    raw = torch.where(greedy, -log_s, d - log_s)
    entropy = torch.where(greedy, 0.0, entropy)
    nan = torch.nan
    return token.masked_fill(bad, -1), logprob.masked_fill(bad, nan), raw.masked_fill(bad, nan), entropy.masked_fill(bad, nan)


class _ShardedTruncated(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, params, shard, backend):
        rows = row_view(logits)
        n_rows = labels.shape[0]
        given, bad, _ = _kept_threshold(rows, params, shard, *_filters_on(params), backend)
        passes = _shard_pass(rows, given, params, shard, backend, labels=labels)
        _, _, logs, label_d, first_max = _combine_shard_passes(*passes, shard, backend, given.dtype == torch.float64)
        acc = given.dtype
        greedy = reference._per_row(params["temperature"], (n_rows,), acc, logits.device)[:, 0] == 0
        log_kept = logs[:, 1].to(acc)
        out = torch.where(greedy, torch.where(labels == first_max, 0.0, -torch.inf).to(acc), label_d.to(acc) - log_kept)
        out = out.masked_fill(bad, torch.nan)
        # (M, log s_kept, tau) as the unsharded backward takes them; a bad row's NaN makes its gradient NaN.
        stats = torch.stack([given[:, 0], log_kept.masked_fill(bad, torch.nan), given[:, 1]], -1)
        label_kept = (out > -torch.inf) & ~greedy
        ctx.save_for_backward(logits, labels, stats, label_kept,
                              *(v for v in params.values() if isinstance(v, torch.Tensor)))  # fmt: skip
        ctx.params, ctx.shard, ctx.backend = params, shard, backend
        return out

    @staticmethod
    def backward(ctx, grad_out):
        """This shard's gradient (sampling.truncated_logprobs's, kept set held fixed) from the
        agreed statistics and whether each label is kept: no collective."""
        _ops.refuse_double_backward()
        logits, labels, stats, label_kept, *_ = ctx.saved_tensors
        rows, params, shard = row_view(logits), ctx.params, ctx.shard
        grad_out = grad_out.to(stats.dtype).contiguous()
        if ctx.backend == "reference":
            grad = _reference_truncated_backward(rows, labels, stats, label_kept, grad_out, params, shard)
        else:
            grad = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
            truncation = tuple(x for name in ("temperature", "top_k", "top_p", "min_p")
                               for x in _ops.split_row_param(params[name]))  # fmt: skip
            _ops.truncated_backward(rows, labels, stats, grad_out, grad, *truncation, shard.start, label_kept,
                                    ctx.backend)  # fmt: skip
        return grad.reshape(logits.shape), None, None, None, None


def _reference_truncated_backward(rows, labels, stats, label_kept, grad_out, params, shard: Shard):
    """(1/T) g ([j == label] - q_j) over the kept tokens of the shard, in plain torch."""
    outer, inner, vocab = rows.shape
    n_rows = outer * inner
    acc = stats.dtype
    x = rows.reshape(n_rows, vocab).to(acc)
    t = reference._per_row(params["temperature"], (n_rows,), acc, x.device)[:, 0]
    mp = reference._per_row(params["min_p"], (n_rows,), acc, x.device)[:, 0]
    inv_t = torch.where(t > 0, 1.0 / torch.where(t > 0, t, 1.0), 0.0).unsqueeze(-1)
    m, log_kept, tau = stats.unbind(-1)
    d = (x - m.unsqueeze(-1)) * inv_t
    kept = _kept(x, d, tau.unsqueeze(-1), mp)
    q = torch.where(kept, torch.exp(d - log_kept.unsqueeze(-1)), 0.0)
    scale = torch.where(label_kept & (t > 0), grad_out * inv_t.squeeze(-1), 0.0)
    scale = torch.where(m.isnan() | log_kept.isnan(), torch.nan, scale).unsqueeze(-1)
    local = labels.long() - shard.start
    onehot = torch.arange(vocab, device=x.device) == local.unsqueeze(-1)
    grad = torch.where(scale == 0, 0.0, scale * (onehot.to(acc) - q))
    return grad.to(rows.dtype)


def truncated_logprobs_sharded(logits, labels, check, group, vocab_start):
    """The sharded form of ``sampling.truncated_logprobs``: the log-prob [N] of global ``labels``
    under the processed distribution of the whole row, the same on every rank; differentiable
    (no collective backward). ``check()`` returns the checked truncation parameters."""
    checked = {}

    def layout():
        checked["params"] = check()
        return logits_layout(logits, **checked["params"])

    shard = agree(group, layout, vocab_start, LABELED, label_range(labels, None),
                  lambda: (labels, *checked["params"].values()))
    if logits.shape[:-1].numel() == 0:  # (the empty result still joins the graph: a backward gives a zero gradient)
        return logits.to(reference.compute_dtype(logits)).sum(-1).reshape(0)
    flat = labels.reshape(-1).contiguous()
    return _ShardedTruncated.apply(logits, flat, checked["params"], shard, select_backend(logits.device))
