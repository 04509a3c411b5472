"""What the launchers of several kernel modules share: the accumulation dtype
(``acc_dtypes``: fastrl._rows.compute_dtype's rule, float64 for float64 input and
float32 for every other dtype), a row's tile and block, the floating-point
contraction a launch names, how a float scalar travels to a kernel (its
float64 bits, ``float_scalar_arg`` / ``float_scalar``), and the policy on the
installed Triton's version (``triton_histogram_is_slow``): the kernels own it,
the API layer (``python -m fastrl info``) reads it from here.
"""

from __future__ import annotations

import functools
import struct

import torch
import triton
import triton.language as tl

from fastrl._rows import compute_dtype, row_layout, segment_length

# Elements of a row handled per loop iteration. It depends on V only, never on
# the number of rows, which keeps results batch invariant.
_MAX_BLOCK_V = 8192
# Rows of at most this many elements (Llama-2's 32000, GPT-2's 50257) are short:
# at most 8 iterations of the largest block, so what a program spends outside
# its loop (the lanes' merge, the partial tile, its start) weighs on the row.
# Their programs take half the block and half the warps, so that twice as many
# share an SM and one's epilogue overlaps another's stream (sm_90 model, H100:
# logprobs fwd bf16 V = 50257 88% -> 94% of copy bandwidth, fwd+bwd 85% -> 93%;
# logprobs+entropy fwd fp32 V = 32000 91% -> 94%).
_SHORT_ROW = 65536
# Elements each thread of the forward handles per iteration (REPS x VEC: REPS
# 128-bit loads on rows of whole 16-byte lines, 16 one-element loads on others).
_THREAD_ELEMS = 16
# Warps per row of the forward: with no reduction across threads in its loop, a
# CTA's warps need not be many; at 8 a CTA's merge and partial tile after the
# loop cost the SM less than at 16 (sm_90 model: logprobs+entropy fwd, bf16
# V = 151936, 89% -> 93% of copy bandwidth; 4 warps would predict 97% but leave
# a small batch of long rows with a quarter of the threads per row).
_FORWARD_MAX_WARPS = 8
# Lanes of a segment (reduce.segment_stats) on a row of TP segments: 16 (a
# half warp; eight segments are 4 warps), half that on short rows (2 warps).
# Each lane holds 16 elements a tile, as in the one-segment forward. sm_90
# model, H100, triton 3.9, bf16 16384 x 151936 forward with entropy: 32 lanes
# (8 warps) 90.1% of copy bandwidth, 16 lanes 95.1%, 8 lanes 97.8%; fp32
# 4096 x 32000: 16 lanes 88.1%, 8 lanes 92.7%. (Fewer lanes per row leave a
# small batch of long rows fewer threads; 16 keeps half the old forward's.)
_SEGMENT_LANES = 16
# Every launch names its floating-point contraction (triton 3.9 warns when it is
# left to the default, which triton 3.10 turns off). These kernels contract
# a * b + c into one rounding (FFMA), as they were benchmarked; their tests bound
# the error either way. The sampler's forward compiles without (sampling._EXACT).
CONTRACTED = {"enable_fp_fusion": True}

_TRITON_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64}


def acc_dtypes(t: torch.Tensor) -> tuple[torch.dtype, tl.dtype]:
    """The accumulation dtype of ``t``'s values (fastrl._rows.compute_dtype), as a
    torch dtype and as a Triton one."""
    acc = compute_dtype(t)
    return acc, triton_acc(acc)


def triton_acc(acc: torch.dtype) -> tl.dtype:
    """The Triton dtype of an accumulation dtype (float32 or float64)."""
    return _TRITON_DTYPES[acc]


@functools.cache
def launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of ``vocab`` logits."""
    block = min(triton.next_power_of_2(vocab), _MAX_BLOCK_V if vocab > _SHORT_ROW else _MAX_BLOCK_V // 2)
    num_warps = 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


# The log-prob backward's block on short rows (_SHORT_ROW): at most 2048 elements
# over 4 warps, a quarter of the longest block. Every element's gradient is its
# own, so the block changes no bit; a smaller one leaves less of the row's last
# block idle (V = 50257: 943 lanes against 2991 at 4096) and fits more programs an
# SM to overlap one's start and end with another's stream (sm_90 model, H100,
# logprobs fwd+bwd 16384x50257 bf16: 91.0-91.5% -> 94.8-95.2% of copy bandwidth
# under triton 3.6-3.9).
_SHORT_ROW_BACKWARD_BLOCK = 2048


def backward_launch_config(vocab: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the log-prob backward over rows of ``vocab``
    logits: launch_config's, narrowed on short rows."""
    block, num_warps = launch_config(vocab)
    if vocab <= _SHORT_ROW:
        return min(block, _SHORT_ROW_BACKWARD_BLOCK), 4
    return block, num_warps


def tile_config(*rows: torch.Tensor, num_warps: int | None = None) -> dict:
    """The forward's tile (reduce.tile_offsets) over the rows of one or more
    [.., V] tensors read together (same dtype), and its num_warps.

    The partition of a row is a function of V, the dtype and the launch alone,
    never of an address, so that a row gives the same bits wherever it sits:
    alone, in a batch, sliced out of a wider buffer or in a view that starts
    anywhere. Rows of whole 16-byte lines (V a multiple of 8 in 16-bit types, of
    4 in float32) give a lane VEC contiguous elements, REPS times a tile; when
    every row of every tensor also starts on a 16-byte boundary (ALIGNED, the
    common case) the kernels tell the compiler so and each VEC is one 128-bit
    load, otherwise (a view off a boundary, rare) the same elements are loaded
    in narrower pieces. Rows that are not whole lines (V = 50257 bf16: the rows
    of a contiguous batch start at every even byte) give a lane one element,
    REPS = 16 times a tile, LANES apart: scalar loads, coalesced across a warp,
    and sums inside the thread. (Row 32 of a contiguous [33, 4099] bf16 batch,
    alone, once took the 128-bit partition because it happened to start on a
    boundary, and differed from its batch by an ulp: issue 39.) Tiles count
    from each row's first element. Short rows get fewer lanes. ``num_warps``
    overrides the warps (and so the lanes) of a kernel that does more than the
    forward. MAX_IN_STORAGE_TYPE: reduce.lane_max may take the max in the
    logits' own type (compiled, not interpreted: a CPU tensor runs in Triton's
    interpreter)."""
    first = rows[0]
    whole_lines = first.shape[-1] * first.element_size() % 16 == 0
    aligned = whole_lines and all(rows_aligned(t) for t in rows)
    return dict(_tile_config(first.shape[-1], first.element_size(), whole_lines, aligned, first.device.type != "cpu",
                             num_warps))  # fmt: skip


def whole_row_tile_config(vocab: int, shard: torch.Tensor, num_warps: int | None = None) -> dict:
    """tile_config of whole rows of ``vocab`` logits in the dtype and on the
    device of ``shard``, a vocabulary shard of them (its ALIGNED False: the
    shard's own rows say, _launch.rows_aligned): the tile that reduces the
    whole row's segments, which a shard of whole segments reduces them with."""
    whole_lines = vocab * shard.element_size() % 16 == 0
    return dict(_tile_config(vocab, shard.element_size(), whole_lines, False, shard.device.type != "cpu", num_warps))


@functools.cache
def _tile_config(vocab: int, element_size: int, whole_lines: bool, aligned: bool, compiled: bool,
                 num_warps: int | None) -> dict:  # fmt: skip
    """tile_config's meta-parameters, a function of these alone: worked out once
    for each (a launch's host time is what a small batch waits for)."""
    block, warps = launch_config(vocab)
    if num_warps is None:
        num_warps = min(warps, _FORWARD_MAX_WARPS if vocab > _SHORT_ROW else _FORWARD_MAX_WARPS // 2)
    vec = 16 // element_size if whole_lines else 1
    lanes = max(1, min(32 * num_warps, block // vec))
    reps = max(1, min(_THREAD_ELEMS // vec, triton.next_power_of_2(vocab) // (lanes * vec)))
    return {"REPS": reps, "LANES": lanes, "VEC": vec, "ALIGNED": aligned,
            "MAX_IN_STORAGE_TYPE": compiled, "num_warps": num_warps}  # fmt: skip


def segment_config(rows: torch.Tensor, vocab: int, segment: int | None = None) -> tuple[int, dict]:
    """(segment length, meta-parameters of reduce.segment_stats) for ``rows``
    [.., V_r] of whole segments of rows of ``vocab`` logits (V_r = vocab: the
    whole rows), ``segment`` long (default fastrl._rows.segment_length(vocab)).

    A row of TP_SEGMENTS segments (V a multiple of 64) gives each segment
    SEG_LANES lanes (_SEGMENT_LANES) of VEC contiguous elements (one 128-bit
    load), REPS = _THREAD_ELEMS / VEC loads a thread a tile, a function of V
    and the dtype alone, so that a shard of whole segments (fewer warps, the
    same tile) reduces each segment to the same bits; a shard of fewer
    segments than fill a warp reads them again in the rest of it (REAL of
    SEGS slots). Any other row or shard is one segment, read as tile_config
    reads a row (its lanes are the segment's)."""
    local = rows.shape[-1]
    segment = segment_length(vocab) if segment is None else segment
    if segment < vocab and segment > 0 and local % segment == 0:
        config = dict(_segment_config(local // segment, vocab, rows.element_size(), rows.device.type != "cpu"),
                      ALIGNED=rows_aligned(rows))  # fmt: skip
    else:
        segment = local
        tile = tile_config(rows)
        config = {"REPS": tile["REPS"], "SEGS": 1, "REAL": 1, "SEG_LANES": tile["LANES"], "VEC": tile["VEC"],
                  "ALIGNED": tile["ALIGNED"], "MAX_IN_STORAGE_TYPE": tile["MAX_IN_STORAGE_TYPE"],
                  "num_warps": tile["num_warps"]}  # fmt: skip
    config["TILES"] = _tiles_an_iteration(segment, config["REPS"] * config["SEG_LANES"] * config["VEC"], config["VEC"])
    return segment, config


def _tiles_an_iteration(segment: int, tile: int, vec: int) -> int:
    """reduce.segment_stats' TILES: two tiles an iteration where a segment of
    ``segment`` logits has an even count of whole tiles of ``tile`` and each
    thread loads 128 bits at a time (vec > 1), else one. Two tiles in flight a
    warp keep an SM streaming while it holds few programs, as in a grid's last
    wave (sm_90 model, H100, bf16 8192x128256, 63 rows an SM: logprobs fwd
    92.4-93.0% -> 94.5-95.8% of copy bandwidth under triton 3.6-3.9;
    logprobs+entropy fwd under 3.7.1 91.2% -> 94.8%, where its registers also
    rose from 48 to 59: 8 programs an SM, 7 waves of 8 and one of 7). An odd count would
    need a masked tile in the last iteration, a tile's arithmetic for nothing
    (4096x32000 fp32, 31 tiles: 92.5% -> 90.4%); one-element loads (vec = 1)
    already have 16 in flight a thread, and a second tile costs them registers
    (V = 50257: 48 -> 72). A function of the segment, the tile and the dtype
    alone, and either sums the tiles in the same order: the same bits."""
    return 2 if vec > 1 and (segment // tile) % 2 == 0 else 1


@functools.cache
def _segment_config(segments: int, vocab: int, element_size: int, compiled: bool) -> dict:
    """segment_config's meta-parameters of a row of whole segments (but ALIGNED)."""
    vec = 16 // element_size
    seg_lanes = _SEGMENT_LANES if vocab > _SHORT_ROW else _SEGMENT_LANES // 2
    slots = max(segments, 32 // seg_lanes)  # whole warps (reduce.segment_stats)
    return {"REPS": max(1, _THREAD_ELEMS // vec), "SEGS": slots, "REAL": segments, "SEG_LANES": seg_lanes, "VEC": vec,
            "MAX_IN_STORAGE_TYPE": compiled, "num_warps": slots * seg_lanes // 32}  # fmt: skip


def _row_offsets_mod_16(t: torch.Tensor) -> tuple[int, int, int]:
    """(start, outer step, inner step) in bytes, modulo 16, of the rows of ``t`` (row_layout)."""
    _, outer_stride, inner_stride = row_layout(t)
    e = t.element_size()
    return t.data_ptr() % 16, (outer_stride * e) % 16, (inner_stride * e) % 16


def rows_aligned(logits: torch.Tensor) -> bool:
    """Whether every row of ``logits`` (row_layout) starts on a 16-byte boundary."""
    return _row_offsets_mod_16(logits) == (0, 0, 0)


def same_row_alignment(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether row r of ``a`` and row r of ``b`` (same element size) start at the same
    place in a 16-byte line, for every r."""
    return _row_offsets_mod_16(a) == _row_offsets_mod_16(b)


def float_scalar_arg(value: int | float) -> int:
    """A float scalar as the kernels take it: the int64 bits of its float64 value
    (``float_scalar``). Triton passes a Python float as float32, which would round
    a float64 kernel's T (1e-300 to 0: seen on an H100), top-p or min-p; an int
    passes as it is."""
    if isinstance(value, float):
        return struct.unpack("<q", struct.pack("<d", value))[0]
    return value


@triton.jit
def float_scalar(bits, DTYPE: tl.constexpr):
    """The float64 whose bits ``float_scalar_arg`` passed, rounded once to DTYPE
    (as the C++ kernels' cast does)."""
    return tl.full([], bits, tl.int64).to(tl.float64, bitcast=True).to(DTYPE)


def temperature_args(temperature: float | torch.Tensor) -> tuple[torch.Tensor | None, int, bool]:
    """(per-row temperature tensor or None, scalar temperature (float_scalar_arg), PER_ROW_TEMP)."""
    if isinstance(temperature, torch.Tensor):
        return temperature, 0, True
    return None, float_scalar_arg(float(temperature)), False


@triton.jit
def row_inv_temperature(temps_ptr, temp_scalar, row, PER_ROW_TEMP: tl.constexpr, ACC: tl.constexpr):
    """1/T of this row (temperature_args); NaN (poisoning the row) if T is not positive and finite."""
    if PER_ROW_TEMP:
        t = tl.load(temps_ptr + row).to(ACC)
    else:
        t = float_scalar(temp_scalar, ACC)
    usable = (t > 0) & (t < float("inf"))
    return tl.where(usable, 1.0 / t, float("nan")).to(ACC)

# Triton before 3.8 lowers tl.histogram to a vote per key bit and a popcount per
# bin for every element, each thread holding its bins' counts in registers; from
# 3.8 on it counts with shared-memory atomics. At the sampler's 4096 bins that is
# 4056 SASS for 1024 elements (with spills) against 200. Measured on an H100 with
# Triton 3.6: fastrl.sample took 0.5 ms (B = 1, top-k 50) to 88 ms (B = 1024,
# top-p 0.9), 20-270x the static model's prediction for Triton 3.9. With such a
# Triton the sampler takes a 128-bin histogram of its own (sampling._uses_window).
FAST_HISTOGRAM_TRITON = (3, 8)


def version_tuple(version: str) -> tuple[int, ...]:
    """A version string's numbers, for ordering: "3.7.1" -> (3, 7, 1), "3.8.0+git1a2b" ->
    (3, 8, 0) (each part's digits; a part with none counts as 0)."""
    return tuple(int("".join(c for c in part.split("+")[0] if c.isdigit()) or 0) for part in version.split("."))


@functools.cache
def triton_histogram_is_slow() -> bool:
    """Whether the installed Triton's tl.histogram is the slow lowering above."""
    return version_tuple(triton.__version__)[:2] < FAST_HISTOGRAM_TRITON
