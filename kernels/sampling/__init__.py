"""Sampling with log-probs, and truncated log-probs: Triton kernels and launchers.

One program per row; the processed distribution is the spec's
(fastrl/reference.py, truncated_log_distribution). Every filter keeps the tokens
at or above a threshold logit, and the thresholds are found without sorting the
row:

    keys      unsigned order-preserving integers of the logits (key(a) < key(b)
              iff a < b), the same keys as csrc/sampling.cpp;
    top-k     the largest key u with #{key >= u} >= k (the k-th largest key);
    top-p     the largest key u with mass(key >= u) >= p * (top-k mass), among the
              top-k keys; the kept set {key >= u} is exactly the tokens whose mass
              strictly above is < p * (top-k mass);
    min-p     kept iff (x - m) / T >= log(min_p), per token;
    sample    an exponential race over the kept tokens, argmax (x - m) / T - log E
              with E ~ Exp(1) from Philox (kernels/random.py), which picks a token
              with its processed probability; ties go to the lowest index.

A row is read twice (``sample._select``): its softmax statistics
(reduce.segment_stats: 8 segments of V / 8 where V is a multiple of 64, folded
along a fixed tree, as a vocabulary shard's ranks fold theirs) with the maxima
of its sub-lanes from the same loads,
and the compaction into the row's candidate list of the tokens at or above the
floor those maxima give (``select._lane_floor``: the lowest max of enough
sub-lanes to hold k tokens, or p of the mass; for greedy rows the max), on
every Triton, with no histogram. Where the maxima give no floor (top-p over a
mass spread wider than they hold) the row is read once more between the two,
for a window histogram below its max (``select._window_floor``). A split row
(a small batch, ``_split_selection``) takes a histogram in its tiles'
statistics pass instead: of its keys' top 12 bits (``select._top_p_floor``),
or where triton's tl.histogram is slow (< 3.8), of the window, in launches of
their own. The thresholds (a radix selection for top-k,
``select._kth_largest_key32``; a 16-way descent for top-p and for float64 keys,
``select._largest_key_reaching``), then the kept mass, the first argmax and the
race in one pass, read the list of at most list_capacity(V) entries, so Philox
runs for the candidates only. A row with more candidates than that (a top tie
wider than the list, top-p over a flat row) runs the same steps with the row as
its list; rows with min-p or temperature alone (nothing to list) and float64
rows skip the compaction and read the row once more, for the kept mass and the
race together.

The package, by concern:

    params    a row's parameters: a per-row tensor or a scalar each;
    keys      the order-preserving keys, their top digits, the race's Philox key;
    compact   the candidate list: its compaction, entries and fixed-point sums;
    select    the list's floor (from the sub-lanes' maxima, or a histogram:
              of the keys' top digits, or of the window below the max),
              and the thresholds over the list;
    split     a row's reads split over many programs, for a small batch;
    sample    a row's selection (_select) and the kernels that use it: the
              draw, the truncated log-prob and its backward;
    shard     a vocabulary shard's kernels (fastrl._sharded.sampling);

and this module the launchers: their meta-parameters and workspace, and
which path a launch takes (split or not, which histogram).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fastrl._rows import row_count, row_layout, segment_length

from .._launch import (
    CONTRACTED,
    acc_dtypes,
    float_scalar_arg,
    rows_aligned,
    tile_config,
    triton_acc,
    triton_histogram_is_slow,
    whole_row_tile_config,
)
from .compact import list_capacity
from .keys import _BINS
from .params import _params
from .sample import _sample_kernel, _truncated_bwd_kernel, _truncated_fwd_kernel
from .select import _WINDOW_BINS
from .shard import (
    _digit_histogram_kernel,
    _mass_logs_kernel,
    _segments_fold_kernel,
    _shard_fold_kernel,
    _shard_segments_kernel,
    _shard_tile_kernel,
    _tile_record,
)
from .split import (
    _FOLD_GROUP,
    _SPLIT_RECORD,
    _split_compact_kernel,
    _split_rows_kernel,
    _split_tiles_kernel,
    _split_window_kernel,
)

_MAX_BLOCK_V = 4096
# The digit search tests 16 pivots per element, a [block, 16] tile: a smaller
# block keeps it in registers.
_MAX_SEARCH_BLOCK = 512
# A program's warps. The forward holds far more than a log-prob forward (a
# 4096-bin histogram, the digit search, the race): 16 warps.
_WARPS = 16
# The registers of the final launch's threads (_sample_kernel,
# _truncated_fwd_kernel): 64 (no spills in the sm_90 and sm_80 cubins, against
# 94 uncapped) fits two programs an SM, so that one's histogram barriers overlap
# the other's loads (sm_90 model, sample top-k 50 at B = 1024: ~10% faster).
_MAXNREG = 64
# Entries a pass over the list reads at once.
_LIST_BLOCK = 1024
# A split row's programs (_split_selection): 4 warps read a quarter of a tile's
# lanes, so that a row of 19 tiles (V = 151936 bfloat16) fills 76 SMs at B = 1.
_SLICE_WARPS = 4
# Rows are split while the batch is at most this share of the SMs (_split_parts):
# one program a row leaves the other half idle.
_SPLIT_SM_SHARE = 0.5
# The sampler's forward launches compile without fused multiply-adds: a split
# row's statistics must round as one program's (reduce.fold_lanes), and a
# contraction depends on the code around it.
_EXACT = {"enable_fp_fusion": False}
# The tile of the tensor-parallel shard pass (_shard_tile_kernel) and threshold search
# (_digit_histogram_kernel), a program each, over 4 warps: 8 bf16 (128 bits) a thread.
_SHARD_PASS_BLOCK = 1024
# The shard pass's registers (_shard_tile_kernel): 72 fits 7 CTAs of 4 warps an SM, as
# before its tiles summed the processed entropy's terms, which took it to 75 and 6 under
# triton 3.6 (sm_90 model, sample shard top-k 50 at 1024 x 75968: 376 -> 403 us).
_SHARD_TILE_MAXNREG = 72


@functools.cache
def _row_block(vocab: int) -> int:
    return min(triton.next_power_of_2(vocab), _MAX_BLOCK_V)


def _launch_config(logits: torch.Tensor) -> dict:
    """The forward kernels' meta-parameters for rows of ``logits`` (V, dtype and
    alignment only, never the batch): the statistics and compaction passes'
    tile (_launch.tile_config, whose num_warps the launch takes) and the
    statistics pass's segments (_segments), the block of the passes over the
    candidate list, and of the digit search."""
    tile = tile_config(logits, num_warps=_WARPS)
    return tile | _segments(logits.shape[-1], tile["LANES"]) | _list_config(logits.shape[-1])


@functools.cache
def _segments(vocab: int, lanes: int) -> dict:
    """The statistics pass's segments (reduce.segment_stats, FOLD_TILES) of a row
    of ``vocab`` logits read by ``lanes`` lanes: SEGS segments of SEG logits
    (fastrl._rows.segment_length: 8 of V / 8 where V is a multiple of 64, else
    the row), SEG_LANES = lanes / SEGS lanes each (with the tile's REPS and
    VEC). A function of V and the dtype alone, so that a vocabulary shard of
    whole segments reduces each to the same bits (sample_segments)."""
    seg = segment_length(vocab)
    segs = vocab // seg
    return {"SEG": seg, "SEGS": segs, "SEG_LANES": lanes // segs}


@functools.cache
def _list_config(vocab: int) -> dict:
    """_launch_config's blocks over the candidate list, and its capacity."""
    block = _row_block(vocab)
    return {"LIST_BLOCK": min(block, _LIST_BLOCK), "SEARCH_BLOCK": min(block, _MAX_SEARCH_BLOCK),
            "LIST_CAP": list_capacity(vocab)}  # fmt: skip


def workspace_bytes(logits: torch.Tensor) -> int:
    """Bytes of the temporaries the forward launches allocate for ``logits``' rows
    (_workspace), with the device's histogram (_uses_window)."""
    n_rows = row_count(logits)
    config = _launch_config(logits)
    split = bool(_split_parts(logits, n_rows, config)[0])
    window = _uses_window(logits.device)
    return sum(t.numel() * t.element_size() for t in _workspace(logits, n_rows, config, split, window, "meta").values())


def _workspace(logits: torch.Tensor, n_rows: int, config: dict, split: bool, window: bool,
               device) -> dict[str, torch.Tensor]:  # fmt: skip
    """The forward launches' temporaries for ``logits``' rows, on ``device``: each
    row's candidate list (_select, _compact: list_capacity int64 entries, 32 KB a
    row at most) and its counter (zero); for split rows (_split_selection) also
    each row's histogram (top-digit, or with ``window`` the window's; zero, in
    one zeroed buffer with the counters), the tiles' lane statistics and the
    rows' records, and with ``window`` each program's max (_split_window_kernel)."""
    vocab = logits.shape[-1]
    bins = (_WINDOW_BINS.value if window else _BINS.value) if split else 0
    zeroed = torch.zeros(n_rows * (bins + 1), dtype=torch.int32, device=device)
    workspace = {
        "lists": torch.empty(n_rows, list_capacity(vocab), dtype=torch.int64, device=device),
        "counters": zeroed[n_rows * bins :],
    }
    if split:
        groups = -(-_tiles(vocab, config) // _FOLD_GROUP.value)
        workspace |= {
            "hist": zeroed[: n_rows * bins],
            "lane_stats": torch.empty(n_rows, groups, 3, _FOLD_GROUP.value, config["LANES"],
                                      dtype=acc_dtypes(logits)[0], device=device),  # fmt: skip
            "records": torch.empty(n_rows, _SPLIT_RECORD.value, dtype=torch.int64, device=device),
        }
        if window and acc_dtypes(logits)[0] != torch.float64:  # (float64 rows never list: _list_floor)
            parts = _split_parts(logits, n_rows, config)[0]
            workspace["part_max"] = torch.empty(n_rows, parts, dtype=torch.float32, device=device)
    return workspace


def _split_parts(logits: torch.Tensor, n_rows: int, config: dict) -> tuple[int, int]:
    """(programs a row takes in _split_selection's launches over it, the lanes
    of each), or (0, 0) for one program a row: a row is split when it spans
    several tiles and the batch is small against the GPU: the split reads
    nothing more, but three more launches, a fold and a histogram a program
    cost a few microseconds (sm_90 model, V = 151936 bfloat16 top-k 50: split
    21.9 / 25.6 / 35.7 / 41.3 / 47.4 / 54.4 us against one program a row
    44.9 / 44.9 / 47.3 / 49.0 / 50.9 / 53.1 at B = 1 / 16 / 48 / 64 / 80 / 100;
    the share stays at half the SMs, short of the crossover, for what the
    model leaves out of the split: its global atomics and workspace traffic).
    The slice of a tile a program reads changes no result (each lane's
    statistics are its own)."""
    lanes = config["LANES"]
    tiles = _tiles(logits.shape[-1], config)
    if tiles < 2 or n_rows > _SPLIT_SM_SHARE * _sm_count(logits.device):
        return 0, 0
    slice_lanes = min(lanes, 32 * _SLICE_WARPS)
    return tiles * (lanes // slice_lanes), slice_lanes


def _tiles(vocab: int, config: dict) -> int:
    """Tiles of the statistics pass (reduce.segment_stats) in each segment of a row:
    also the compaction's tiles of the row (its tile is a segment's tile of each)."""
    return -(-config["SEG"] // (config["REPS"] * config["SEG_LANES"] * config["VEC"]))


@functools.cache
def _sm_count(device: torch.device) -> int:
    """The device's SMs; for the CPU (the interpreter) and the meta tensors of the
    static model (tools.sass), an H100's 132."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _split_selection(logits, n_rows, params, flags, config, acc_tl, parts, slice_lanes, window, workspace):
    """A row's reads over ``parts`` programs each (_select, SPLIT), of
    ``slice_lanes`` lanes (_split_parts): the tiles' lane statistics and the
    top-digit histogram (_split_tiles_kernel), the row's statistics and its
    list's floor (_split_rows_kernel, one program a row); with ``window``
    (_uses_window) the tiles' lane statistics and maxima, the window
    histogram (_split_window_kernel), then the row's statistics and floor;
    last the compaction (_split_compact_kernel), into ``workspace``
    (_workspace)."""
    vocab = logits.shape[-1]
    tiles = _tiles(vocab, config)
    groups = workspace["lane_stats"].shape[1]
    layout = row_layout(logits)
    tile_meta = {k: config[k] for k in ("REPS", "LANES", "VEC")} | {"SLICE_LANES": slice_lanes}
    warps = max(slice_lanes // 32, 1)
    part_max = workspace.get("part_max")
    _split_tiles_kernel[(n_rows, parts)](
        logits, *layout, vocab, config["SEG"], *params, workspace["lane_stats"], workspace["hist"], groups, part_max, **flags,
        **tile_meta, SEG_LANES=config["SEG_LANES"], ALIGNED=config["ALIGNED"],
        MAX_IN_STORAGE_TYPE=config["MAX_IN_STORAGE_TYPE"], WINDOW=window,
        ACC=acc_tl, num_warps=warps, **_EXACT,
    )  # fmt: skip
    if window and acc_tl != tl.float64:  # (float64 rows never list: _list_floor)
        # Its programs read a tile of one rep (half the statistics pass's) while the
        # batch's tile slices leave SMs idle: at B = 1 (V = 151936 bfloat16) 152 of
        # them, 8 tokens a thread, halve the window's chain of ~70 SASS a token under
        # triton 3.6 (sm_90 model, B = 1 top-p 0.9: 30.4 -> 29.3 us).
        reps = 1 if n_rows * parts < _sm_count(logits.device) else config["REPS"]
        window_parts = -(-vocab // (reps * config["LANES"] * config["VEC"])) * (config["LANES"] // slice_lanes)
        _split_window_kernel[(n_rows, window_parts)](
            logits, *layout, vocab, *params, part_max, parts, workspace["hist"], **flags,
            **(tile_meta | {"REPS": reps}), ALIGNED=config["ALIGNED"], PARTS=triton.next_power_of_2(parts),
            ACC=acc_tl, num_warps=warps, **_EXACT,
        )  # fmt: skip
    _split_rows_kernel[(n_rows,)](
        vocab, *params, workspace["lane_stats"], tiles, groups, workspace["hist"],
        workspace["records"], **flags, LANES=config["LANES"], SEGS=config["SEGS"], SEG_LANES=config["SEG_LANES"],
        LIST_CAP=config["LIST_CAP"], WINDOW=window,
        ACC=acc_tl, num_warps=_WARPS, **_EXACT,
    )  # fmt: skip
    _split_compact_kernel[(n_rows, parts)](
        logits, *layout, vocab, workspace["records"], workspace["lists"], workspace["counters"], **tile_meta,
        LIST_CAP=config["LIST_CAP"], num_warps=warps, **_EXACT,
    )  # fmt: skip


def _uses_window(device: torch.device) -> bool:
    """Whether a split row's launches on ``device`` take the window histogram
    (_window_bin: 128 bins from the row's max, a launch of its own after the
    row's statistics) rather than the top-digit histogram (4096 bins, in the
    tiles' statistics launch) when the caller does not choose
    (``window=None``): where tl.histogram is slow, triton < 3.8 on a GPU (and
    the static model's meta tensors: _launch.FAST_HISTOGRAM_TRITON), whose
    cost grows with the bins (the 4096-bin one made the sampler 20-270x
    slower on an H100). Both give the same results: the tests run both on
    one machine, the static model compiles both. One program a row takes
    neither (select._lane_floor)."""
    return device.type != "cpu" and triton_histogram_is_slow()


def _selection_args(logits, n_rows, params, flags, config, acc_tl, window) -> tuple[list, dict]:
    """The final launch's (_select) candidate lists, counters and split records
    (None for one program a row), and its SPLIT flag; ``window``: a split
    row's histogram (None: the device's, _uses_window)."""
    window = _uses_window(logits.device) if window is None else window
    parts, slice_lanes = _split_parts(logits, n_rows, config)
    workspace = _workspace(logits, n_rows, config, bool(parts), window, logits.device)
    if parts:
        _split_selection(logits, n_rows, params, flags, config, acc_tl, parts, slice_lanes, window, workspace)
    records = workspace["records"] if parts else None
    return [workspace["lists"], workspace["counters"], records], {"SPLIT": bool(parts)}


def sample_forward(logits, *, temperature, top_k, top_p, min_p, seed, offset, window=None):
    """One draw per row of ``logits`` [N, V] or [outer, inner, V] (unit stride in V,
    any leading strides: ``fastrl._rows.row_layout``): (tokens int64
    [N], log-probs under the processed distribution [N], raw log-probs [N],
    the processed distribution's entropy [N]).
    Parameters are scalars or flat per-row tensors (accumulation dtype, int64
    for top_k); ``seed`` an int64 or int64 [N] per-row seeds; ``offset`` an int
    or a one-element int64 tensor read on the device. ``window``: whether a
    split row's histogram is the window's or the top digits' (the same results;
    None: the device's, _uses_window)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = acc_dtypes(logits)
    tokens = torch.empty(n_rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(n_rows, dtype=acc, device=logits.device)
    raw = torch.empty(n_rows, dtype=acc, device=logits.device)
    entropy = torch.empty(n_rows, dtype=acc, device=logits.device)
    args, flags = _params(temperature, top_k, top_p, min_p)
    per_row_seed, offset_from_ptr = isinstance(seed, torch.Tensor), isinstance(offset, torch.Tensor)
    config = _launch_config(logits)
    selection, split = _selection_args(logits, n_rows, args, flags, config, acc_tl, window)
    _sample_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, *args,
        seed if per_row_seed else None, 0 if per_row_seed else seed,
        offset if offset_from_ptr else None, 0 if offset_from_ptr else offset,
        tokens, logprobs, raw, entropy, *selection, **flags, **split, PER_ROW_SEED=per_row_seed,
        OFFSET_FROM_PTR=offset_from_ptr, ACC=acc_tl, **config, **_EXACT, maxnreg=_MAXNREG,
    )  # fmt: skip
    return tokens, logprobs, raw, entropy


def truncated_forward(logits, labels, *, temperature, top_k, top_p, min_p, with_stats, window=None):
    """(log-prob of ``labels`` under the processed distribution [N], stats [N, 3]
    = per row (max logit, log kept mass, threshold logit) for the backward, or None);
    ``window`` as sample_forward's."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    acc, acc_tl = acc_dtypes(logits)
    out = torch.empty(n_rows, dtype=acc, device=logits.device)
    stats = torch.empty(n_rows, 3, dtype=acc, device=logits.device) if with_stats else None
    args, flags = _params(temperature, top_k, top_p, min_p)
    config = _launch_config(logits)
    selection, split = _selection_args(logits, n_rows, args, flags, config, acc_tl, window)
    _truncated_fwd_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, labels, *args, out, stats, *selection, **flags, **split,
        WITH_STATS=with_stats, ACC=acc_tl, **config, **_EXACT, maxnreg=_MAXNREG,
    )  # fmt: skip
    return out, stats


def truncated_backward(logits, labels, stats, grad_logprob, grad_out, *, temperature, top_k, top_p, min_p,
                       label_base=0, label_kept=None):  # fmt: skip
    """Writes dL/dlogits into ``grad_out`` (the logits' rows, in its own layout)
    with the kept set held fixed. A vocabulary shard passes where its columns
    start (``label_base``; labels are global ids) and ``label_kept`` (bool [N]:
    whether each row's label is kept, which another shard may hold)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    args, flags = _params(temperature, top_k, top_p, min_p)
    block = _row_block(vocab)
    _truncated_bwd_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, labels, stats, grad_logprob, grad_out, *row_layout(grad_out),
        *args, label_base, label_kept, **flags, LABEL_KEPT_GIVEN=label_kept is not None, ACC=acc_tl,
        BLOCK_V=block, num_warps=8 if block >= 2048 else 4, **CONTRACTED,
    )  # fmt: skip


def shard_digit_histogram(logits, prefix, shift, given=None, *, temperature=1.0, unit_scale=0.0):
    """hist [N, 1 or (with ``given``) 2, 256] int64 of one round of the tensor-parallel sampler's
    threshold search (csrc/sampling.h, shard_digit_histogram): each row's digit counts, and with
    ``given`` (max, floor) [N, 2] the counted tokens' mass units."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    hist = torch.zeros(n_rows, 1 if given is None else 2, 256, dtype=torch.int64, device=logits.device)
    per_row_t = isinstance(temperature, torch.Tensor)
    block = min(triton.next_power_of_2(vocab), _SHARD_PASS_BLOCK)
    _digit_histogram_kernel[(n_rows, triton.cdiv(vocab, block))](
        logits, *row_layout(logits), vocab, prefix, given, temperature if per_row_t else None,
        0 if per_row_t else float_scalar_arg(temperature), float_scalar_arg(float(unit_scale)), hist,
        SHIFT=shift, PER_ROW_T=per_row_t, WEIGHTED=given is not None, BLOCK_V=block, ACC=acc_tl, num_warps=4,
        **_EXACT,
    )  # fmt: skip
    return hist


def sample_shard_pass(logits, given, *, temperature, min_p, column_base, seed=None, offset=0, labels=None):
    """One vocabulary shard's pass of the tensor-parallel sampler (csrc/sampling.h,
    sample_shard_pass): (scores float64 [N, 2], masses int64 [N, 6], picks int64
    [N, 2]) of ``logits`` [N, V_r] (or [outer, inner, V_r]) from ``given`` [N, 2]
    (max, threshold logit) in the accumulation dtype; the race with ``seed`` /
    ``offset`` as sample_forward's, or with ``labels`` (global ids) the
    truncated log-prob's terms.

    The masses (s, s_kept, u), which the ranks add as integers, in the
    unsharded sampler's own fixed point (compact._mass_units, with for
    float64 rows the low limbs, compact._mass_rest: pairs of int64), so that
    s_kept and u are its bits. The unsharded sampler's s is a float sum (its
    segments' statistics, which sample_segments gives the ranks)."""
    n_rows, vocab = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    scores = torch.empty(n_rows, 2, dtype=torch.float64, device=logits.device)
    masses = torch.empty(n_rows, 6, dtype=torch.int64, device=logits.device)
    picks = torch.empty(n_rows, 2, dtype=torch.int64, device=logits.device)
    args, flags = _params(temperature, 0, 1.0, min_p)
    per_row_seed, offset_from_ptr = isinstance(seed, torch.Tensor), isinstance(offset, torch.Tensor)
    block = min(triton.next_power_of_2(vocab), _SHARD_PASS_BLOCK)
    tiles = triton.cdiv(vocab, block)
    tile_masses = torch.empty(n_rows, tiles, _tile_record(acc_tl), dtype=torch.float64, device=logits.device)
    marks = torch.empty(n_rows, tiles, 3, dtype=torch.int32, device=logits.device)
    given_bits = given.view(torch.int64 if acc_tl == tl.float64 else torch.int32)
    _shard_tile_kernel[(n_rows, tiles)](
        logits, *row_layout(logits), vocab, given_bits, *args, column_base,
        seed if per_row_seed else None, 0 if per_row_seed or seed is None else seed,
        offset if offset_from_ptr else None, 0 if offset_from_ptr else offset, tile_masses, marks, tiles,
        **flags, RACE=labels is None, PER_ROW_SEED=per_row_seed, OFFSET_FROM_PTR=offset_from_ptr, BLOCK_V=block,
        ACC=acc_tl, num_warps=4, **_EXACT, maxnreg=_SHARD_TILE_MAXNREG,
    )  # fmt: skip
    _shard_fold_kernel[(n_rows,)](
        logits, *row_layout(logits), vocab, given, *args, column_base, labels, tile_masses, marks, scores, masses,
        picks, tiles, **flags, RACE=labels is None, TILE_BLOCK=triton.next_power_of_2(tiles), ACC=acc_tl,
        num_warps=4, **_EXACT,
    )  # fmt: skip
    return scores, masses, picks


def sample_mass_logs(masses, float64):
    """(log s, log s_kept, entropy) [N, 3] float64 of the tensor-parallel sampler's masses
    [N, 6] summed over the ranks (sample_shard_pass's) by the unsharded kernel's own formula
    (_mass_logs_kernel), in float64 for ``float64`` rows, else float32."""
    n_rows = masses.shape[0]
    logs = torch.empty(n_rows, 3, dtype=torch.float64, device=masses.device)
    block = 128
    _mass_logs_kernel[(triton.cdiv(n_rows, block),)](masses, logs, n_rows, BLOCK=block,
                                                      ACC=tl.float64 if float64 else tl.float32, num_warps=4,
                                                      **_EXACT)  # fmt: skip
    return logs


def sample_segments(logits, *, temperature, vocab):
    """[N, G, 3] float64: the (m, n, t) of each of the G segments of the rows of a
    vocabulary shard ``logits`` [N, V_r] (or [outer, inner, V_r]) of rows of
    ``vocab`` logits, whole segments of them (fastrl._rows.segment_length), as
    the unsharded sampler's statistics pass reduces them (_segments, with the
    whole row's tile), m in the accumulation dtype's value. The ranks gather
    them and fold them with sample_segments_fold: the unsharded sampler's
    (m, s, log s), from which its top-p target (without top-k) and its raw
    log-prob come, bit for bit."""
    n_rows, local = row_count(logits), logits.shape[-1]
    _, acc_tl = acc_dtypes(logits)
    tile = whole_row_tile_config(vocab, logits, _WARPS)
    segments = _segments(vocab, tile["LANES"])
    real = local // segments["SEG"]
    slots = triton.next_power_of_2(real)
    out = torch.empty(n_rows, real, 3, dtype=torch.float64, device=logits.device)
    per_row_t = isinstance(temperature, torch.Tensor)
    _shard_segments_kernel[(n_rows,)](
        logits, *row_layout(logits), local, segments["SEG"], temperature if per_row_t else None,
        0 if per_row_t else float_scalar_arg(temperature), out, PER_ROW_T=per_row_t, REPS=tile["REPS"], SEGS=slots,
        REAL=real, SEG_LANES=segments["SEG_LANES"], VEC=tile["VEC"], ALIGNED=rows_aligned(logits),
        MAX_IN_STORAGE_TYPE=tile["MAX_IN_STORAGE_TYPE"], ACC=acc_tl,
        num_warps=max(1, slots * segments["SEG_LANES"] // 32), **_EXACT,
    )  # fmt: skip
    return out


def sample_segments_fold(segments, acc, *, temperature):
    """[N, 3] float64: each row's (m, s, log s) as the unsharded sampler's
    statistics (sample._select, sample._row_state; log s rounded to the
    accumulation dtype ``acc``) from its segments [N, G, 3] (sample_segments',
    gathered from the ranks in vocabulary order; G a power of 2, at most 8)."""
    n_rows = segments.shape[0]
    stats = torch.empty(n_rows, 3, dtype=torch.float64, device=segments.device)
    per_row_t = isinstance(temperature, torch.Tensor)
    _segments_fold_kernel[(n_rows,)](
        segments.contiguous(), temperature if per_row_t else None, 0 if per_row_t else float_scalar_arg(temperature),
        stats, PER_ROW_T=per_row_t, SEGS=segments.shape[1], ACC=triton_acc(acc),
        num_warps=1, **_EXACT,
    )  # fmt: skip
    return stats
