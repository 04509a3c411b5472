"""The static sm_90 model's two halves: what a compiled kernel is (``analyse_*``:
resources, loops, instructions on each loop's hot path) and how long one launch
of it is *predicted* to take on a device (``predict``). ``tools.sass``
states the model and its assumptions; every figure here is a prediction.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from pathlib import Path

from . import parse as sp

# ---------------------------------------------------------------------------
# Devices and the model's constants (see tools.sass for why each is what it is)


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    copy_bw: float  # bytes/s, device-to-device copy
    sms: int = 132
    clock_hz: float = 1.755e9  # sustained SM clock under a streaming load (H100 boost is 1.98 GHz)
    schedulers: int = 4  # warp schedulers per SM, one instruction issued per cycle each
    regs_per_sm: int = 65536
    smem_per_sm: int = 228 * 1024
    smem_reserved_per_cta: int = 1024
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    l2_bytes: int = 50 * 1024 * 1024
    l2_bw: float = 7.0e12  # bytes/s, L2 hits
    sm_max_bytes_per_cycle: float = 64.0  # what one SM can pull from L2 / DRAM per cycle
    dram_latency_cycles: float = 800.0
    l2_latency_cycles: float = 270.0
    barrier_cycles: float = 30.0  # a bar.sync with the shared-memory round trip of a block reduction
    # A warp issues at most once every warp_cpi cycles (the sm_90 ALU / FMA latency
    # on a dependent chain): what one warp a scheduler costs. Calibrated on the first
    # H100 run (triton 3.6): the split tiles launch, one warp a scheduler, ran its
    # 8238 SASS in 54k cycles (6.6 a SASS, vote / popcount heavy); its rows launch
    # (1478 SASS, one CTA) in 7.4k cycles with three DRAM latencies (~3.4).
    warp_cpi: float = 4.0
    xu_cycles: float = 8.0  # a quarter-rate (parse.XU_OPCODES) warp instruction on one scheduler
    launch_s: float = 2.0e-6  # launch and ramp-up of one kernel


H100 = Device("H100 SXM", copy_bw=3.0e12)
H200 = Device("H200 SXM", copy_bw=4.3e12)
DEVICES = {"H100": H100, "H200": H200}

FLOAT_TYPES = {"bf16", "f16", "f32", "f64", "fp8e4nv", "fp8e5"}
ELEMENT_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "i64": 8, "i32": 4, "i16": 2, "i8": 1, "u8": 1, "i1": 1}


# ---------------------------------------------------------------------------
# Analysis of one compiled kernel


# The prefix of a guard a loop is in the else of (LoopInfo.guards).
ELSE = "else: "


@dataclasses.dataclass
class LoopInfo:
    source: tuple[str, int] | None
    text: str  # the source line of the loop
    guards: list[str]  # source lines of the runtime ifs around it; "else: <line>" for an if it is in the else of
    lower: int | None
    upper: str | None  # the kernel argument bounding it (V, L, ...), or None
    upper_const: int | None
    step: int | None  # elements per iteration (per CTA)
    hot: dict  # sp.summarise of the cheapest path through one iteration
    longest_sass: int  # instructions on the dearest path (a rare branch taken)
    float_load_bits: list[int]  # widths of the loads of floating-point data on the hot path
    load_args: list[str]  # kernel arguments it loads from
    depth: int
    mapped: bool  # matched to a TTGIR loop (its bound and step are known)
    whole_tiles: bool = False  # runs over the floor(upper / tile) whole tiles (the partial tile is straight-line code)
    tile: int | None = None  # elements of a whole tile: step, or a divisor of it (tiles taken several an iteration)


@dataclasses.dataclass
class KernelAnalysis:
    name: str
    arch: int
    regs: int
    shared: int  # bytes per CTA
    local: int  # bytes per thread of local memory: spills (what Triton reports as n_spills on a GPU)
    spill_instrs: int  # LDL / STL on a loop's hot path (local memory traffic per element)
    num_warps: int
    loops: list[LoopInfo]
    straight: dict  # summary of the code outside loops (entry to exit)
    straight_bytes: int  # bytes one CTA moves outside its loops (less the edge tiles below)
    straight_float_load_bits: list[int]  # as LoopInfo's, of the code outside loops
    loads: list[str]  # kernel arguments read
    stores: list[str]  # kernel arguments written
    stack: int = 0  # bytes of call stack (registers saved around a CALL, e.g. an fp64 division's slow path)
    notes: list[str] = dataclasses.field(default_factory=list)
    # Per row argument a whole-tiles loop reads or writes: the bytes per element of
    # its masked loads and stores outside the loops, the edge tiles that take the
    # remainder of a row (V % step elements, and a head of under 16 bytes), which
    # move that remainder, not the whole tiles their shapes have.
    edge_bytes_per_element: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def threads(self) -> int:
        return 32 * self.num_warps

    @property
    def spills(self) -> int:
        return self.local + self.spill_instrs

    def brief(self) -> dict:
        return {"kernel": self.name, "arch": f"sm_{self.arch}", "registers": self.regs, "spill_bytes": self.local,
                "spill_instructions": self.spill_instrs, "shared_bytes": self.shared, "warps": self.num_warps}  # fmt: skip


def _loop_summary(cfg: sp.CFG, loop: sp.Loop) -> tuple[list[sp.Instr], int]:
    hot = cfg.path(loop.body, loop.header, set(loop.latches), loop.children)
    cold = cfg.path(loop.body, loop.header, set(loop.latches), loop.children, shortest=False)
    return cfg.instrs_of(hot), len(cfg.instrs_of(cold))


def _straight_line(cfg: sp.CFG) -> list[sp.Instr]:
    """The cheapest path from the entry to the last EXIT, loops standing as single nodes."""
    exits = [b.index for b in cfg.blocks if any(i.base == "EXIT" for i in b.instrs)]
    last = max(exits, key=lambda k: cfg.blocks[k].instrs[-1].addr) if exits else len(cfg.blocks) - 1
    top = [lp for lp in cfg.loops if lp.parent is None]
    return cfg.instrs_of(cfg.path(set(range(len(cfg.blocks))), 0, {last}, top))


def analyse_triton(compiled: dict, arch: int, param_names: list[str]) -> KernelAnalysis:
    """A Triton kernel from its cubin and TTGIR; ``param_names`` are the kernel's
    non-constexpr parameters in order (TTGIR's arguments, which Triton 3.6 names
    %arg0, %arg1, ...)."""
    cubin = compiled["cubin"]
    usage = next(iter(sp.resource_usage(cubin).values()))
    instrs = next(iter(sp.split_functions(sp.disassemble(cubin)).values()))
    cfg = sp.CFG(instrs)
    ir = sp.parse_ttgir(compiled["ttgir"])
    rename = dict(zip(ir.args, param_names))

    def arg_name(token: str) -> str | None:
        name = token.lstrip("%")
        name = rename.get(name, name)
        return name if name in param_names else None

    def const(token: str) -> int | None:
        if re.fullmatch(r"-?\d+", token):
            return int(token)
        return ir.constants.get(token)

    # Which element type each source line loads (to tell row data from masks).
    load_types: dict[tuple[str, int], set[str]] = {}
    for op in ir.memops:
        if op.source is not None and op.kind == "load":
            load_types.setdefault(op.source, set()).add(op.elem)

    def types_of(source: tuple[str, int] | None) -> set[str]:
        """The element types a SASS load's source line loads. ptxas may place a
        load on the line of its first use, a line or two below the load's own
        (``a = tl.load(p)`` over ``if a != 0:``): a line with no load takes
        those of the nearest line above it, at most two lines up, that has one."""
        if source is None:
            return {"?"}
        for up in range(3):
            types = load_types.get((source[0], source[1] - up))
            if types:
                return types
        return {"?"}

    def float_load_bits(instrs: list[sp.Instr]) -> list[int]:
        """Widths of the loads of floating-point data (or of unknown type) among ``instrs``."""
        bits = []
        for ins in instrs:
            if ins.base == "LDG":
                types = types_of(ins.source)
                if types & FLOAT_TYPES or "?" in types:
                    bits.append(sp.access_bits(ins))
        return bits

    sass_loops = cfg.all_loops()
    notes = []
    pairs = _match_loops(sass_loops, cfg, ir.loops,
                         lambda il: None not in (const(il.lower), const(il.upper), const(il.step)))  # fmt: skip
    if len(sass_loops) != len(ir.loops):
        notes.append(f"{len(sass_loops)} SASS loops for {len(ir.loops)} TTGIR loops")
    loops = []
    for sloop, iloop in pairs:
        hot, longest = _loop_summary(cfg, sloop)
        latch = cfg.blocks[max(sloop.latches)].instrs[-1]
        source = iloop.source if iloop is not None else latch.source
        float_bits = float_load_bits(hot)
        index = ir.loops.index(iloop) if iloop is not None else None
        load_args = sorted({op.arg for op in ir.memops if op.kind == "load" and op.loop == index and op.arg})
        loops.append(LoopInfo(
            source=source, text=sp.source_text(source),
            guards=[sp.source_text(g) for g in (iloop.guards if iloop else [])]
            + [ELSE + sp.source_text(g) for g in (iloop.else_guards if iloop else [])],
            lower=const(iloop.lower) if iloop else None, upper=arg_name(iloop.upper) if iloop else None,
            upper_const=const(iloop.upper) if iloop else None, step=const(iloop.step) if iloop else None,
            hot=sp.summarise(hot), longest_sass=longest, float_load_bits=float_bits, load_args=load_args,
            depth=iloop.depth if iloop else 0, mapped=iloop is not None,
            whole_tiles=iloop.whole_tiles if iloop else False,
            tile=const(iloop.tile) if iloop and iloop.tile else None,
        ))  # fmt: skip
    straight = _straight_line(cfg)
    tiled = [i for i, lp in enumerate(ir.loops) if lp.whole_tiles]
    tiled_args = {op.arg for op in ir.memops if op.loop in tiled and op.arg}
    edge = [op for op in ir.memops if op.loop is None and op.tensor and op.arg in tiled_args]
    # A TTGIR loop of constant bounds with no SASS loop was unrolled by the
    # backend: its loads and stores are straight-line code, each made trips times.
    matched = {id(il) for _, il in pairs if il is not None}
    unrolled = {}
    for index, il in enumerate(ir.loops):
        bounds = [const(il.lower), const(il.upper), const(il.step)]
        if id(il) not in matched and None not in bounds and bounds[2] > 0:
            unrolled[index] = max(0, -(-(bounds[1] - bounds[0]) // bounds[2]))
    if unrolled:
        notes.append(f"TTGIR loops unrolled in SASS (index: trips): {unrolled}")
    straight_bytes = sum(op.elements * ELEMENT_BYTES.get(op.elem, 4) * (1 if op.loop is None else unrolled[op.loop])
                         for op in ir.memops
                         if (op.loop is None or op.loop in unrolled) and op not in edge)  # fmt: skip
    edge_bytes = {op.arg: ELEMENT_BYTES.get(op.elem, 4) for op in edge}
    return KernelAnalysis(
        name=compiled["name"], arch=arch, regs=usage.get("REG", 0),
        shared=max(compiled.get("shared", 0), usage.get("SHARED", 0)), local=usage.get("LOCAL", 0),
        spill_instrs=sum(lp.hot["local"] for lp in loops), num_warps=compiled["num_warps"], stack=usage.get("STACK", 0),
        loops=loops, straight=sp.summarise(straight), straight_bytes=straight_bytes,
        straight_float_load_bits=float_load_bits(straight), edge_bytes_per_element=edge_bytes,
        loads=sorted({op.arg for op in ir.memops if op.kind == "load" and op.arg}),
        stores=sorted({op.arg for op in ir.memops if op.kind == "store" and op.arg}), notes=notes,
    )  # fmt: skip


def _match_loops(sass_loops: list[sp.Loop], cfg: sp.CFG, ir_loops: list[sp.IRLoop],
                 constant: Callable[[sp.IRLoop], bool] = lambda loop: False):  # fmt: skip
    """(SASS loop, TTGIR loop or None) pairs: in program order when the counts
    agree, or agree once the TTGIR loops of constant bounds (``constant``), which
    the backend may unroll, are left out (triton 3.6 unrolls the sampler's 32
    binary-search steps, 3.9 does not); else each SASS loop to the first unused
    TTGIR loop of its latch's source line."""

    def line(loop: sp.Loop):
        src = cfg.blocks[max(loop.latches)].instrs[-1].source
        return (Path(src[0]).name, src[1]) if src else None

    def ir_line(loop: sp.IRLoop):
        return (Path(loop.source[0]).name, loop.source[1]) if loop.source else None

    used, by_line = set(), []
    for sl in sass_loops:
        match = next((k for k, il in enumerate(ir_loops) if k not in used and ir_line(il) == line(sl)), None)
        if match is not None:
            used.add(match)
        by_line.append((sl, ir_loops[match] if match is not None else None))
    rolled = [il for il in ir_loops if not constant(il)]
    for candidates in (ir_loops, rolled):
        if len(sass_loops) == len(candidates):
            in_order = list(zip(sass_loops, candidates))
            # ptxas may lay a branch's blocks out in another order than the source (the
            # sampler's else before its then): program order holds only where the
            # lines agree, and where they do not, the lines pair every loop
            if all(line(sl) is None or line(sl) == ir_line(il) for sl, il in in_order) or None in (
                    il for _, il in by_line):
                return in_order
            return by_line
    return by_line


# ---------------------------------------------------------------------------
# Prediction of one launch


@dataclasses.dataclass
class LoopRun:
    """A loop as one launch runs it."""

    loop: LoopInfo
    trips: int  # iterations per CTA
    elements_per_thread: float  # row elements per thread per iteration
    row: bool  # a pass over a row (bounded by the row length)
    cached: float  # share of its reads served by L2 (a repeat pass over rows still there)
    executed: bool
    span: int = 0  # elements between its bounds (the row length for a row loop)
    store_share: float = 1.0  # share of its stores' bytes written (a compaction's, cases.Case.compaction)


def occupancy(k: KernelAnalysis, dev: Device) -> dict:
    """CTAs per SM and what limits them (registers allocated per warp in units of
    256, shared memory with 1 KB reserved per CTA, threads, CTA slots)."""
    regs_per_warp = math.ceil(max(k.regs, 1) * 32 / 256) * 256
    limits = {
        "threads": dev.max_threads_per_sm // k.threads,
        "registers": dev.regs_per_sm // (regs_per_warp * k.num_warps),
        "shared": dev.smem_per_sm // (k.shared + dev.smem_reserved_per_cta),
        "slots": dev.max_ctas_per_sm,
    }
    ctas = max(0, min(limits.values()))
    limiter = min(limits, key=limits.get)
    return {"ctas_per_sm": ctas, "limiter": limiter, "occupancy": ctas * k.threads / dev.max_threads_per_sm}


def mva(customers: int, queues: list[float], delay: float) -> float:
    """Throughput (customer iterations per cycle) of a closed queueing network by
    exact mean-value analysis: ``customers`` cycling through single-server
    queues of the given service demands and a pure delay."""
    q = [0.0] * len(queues)
    x = 0.0
    for n in range(1, customers + 1):
        r = [d * (1 + qi) for d, qi in zip(queues, q)]
        x = n / (delay + sum(r))
        q = [x * ri for ri in r]
    return x


def issue_slots(sass: float, xu: float, dev: Device) -> float:
    """Scheduler cycles of a warp's ``sass`` instructions, ``xu`` of them on the
    quarter-rate unit, which holds the scheduler's share of it xu_cycles each."""
    return max(sass, xu * dev.xu_cycles)


def _phase_cycles(k: KernelAnalysis, dev: Device, ctas_here: int, resident: int, trips: int, sass: float,
                  xu: float, bytes_dram: float, bytes_l2: float, latency: float, barriers: int, bw_dram_cyc: float,
                  bw_l2_cyc: float) -> float:  # fmt: skip
    """Cycles one SM spends on ``ctas_here`` CTAs (at most ``resident`` at once)
    each running ``trips`` iterations of a phase (``sass`` warp instructions, ``xu``
    of them quarter-rate, and ``bytes_*`` per CTA-iteration)."""
    if trips <= 0 or ctas_here <= 0:
        return 0.0
    # Warps that meet at a barrier every iteration move as one customer (the CTA);
    # without barriers each warp is its own customer.
    per_customer = k.num_warps if barriers > 0 else 1
    parallel = min(per_customer, dev.schedulers)
    slots = issue_slots(sass, xu, dev)
    issue = slots * per_customer / dev.schedulers  # the SM's schedulers as one server
    # Seidmann's multi-server correction: a customer of fewer warps than
    # schedulers cannot use all of them, the rest of its issue time is delay.
    delay = latency + barriers * dev.barrier_cycles + slots * per_customer * (1 / parallel - 1 / dev.schedulers)
    # A warp's own dependent chain: at least warp_cpi cycles a SASS; what the
    # issue server and the correction above leave of that is delay too.
    delay += max(0.0, sass * dev.warp_cpi - slots * per_customer / parallel)
    share = per_customer / k.num_warps
    memory = share * (bytes_dram / bw_dram_cyc + bytes_l2 / bw_l2_cyc)
    cycles, left = 0.0, ctas_here
    while left > 0:
        wave = min(resident, left)
        customers = wave * (k.num_warps // per_customer)
        cycles += customers * trips / mva(customers, [issue, memory], delay)
        left -= wave
    return cycles


def predict(k: KernelAnalysis, runs: list[LoopRun], grid: int, dev: Device, straight_latencies: int) -> dict:
    """Predicted time of one launch of ``k`` with ``grid`` CTAs on ``dev`` (see
    tools.sass for the model)."""
    occ = occupancy(k, dev)
    resident = max(occ["ctas_per_sm"], 1)
    active = min(grid, dev.sms)
    per_sm = math.ceil(grid / dev.sms)
    f = dev.clock_hz
    bw_dram_cyc = min(dev.copy_bw / active / f, dev.sm_max_bytes_per_cycle)
    bw_l2_cyc = min(dev.l2_bw / active / f, dev.sm_max_bytes_per_cycle)
    threads = k.threads

    cycles = 0.0
    issue_instr = 0.0  # warp instructions of the whole grid
    dram = l2 = 0.0
    for run in runs:
        if not run.executed or run.trips <= 0:
            continue
        hot = run.loop.hot
        cta_bytes = (hot["ld_bits"] + hot["st_bits"] * run.store_share) * threads / 8
        ld_bytes = hot["ld_bits"] * threads / 8
        b_l2 = ld_bytes * run.cached
        b_dram = cta_bytes - b_l2
        latency = run.cached * dev.l2_latency_cycles + (1 - run.cached) * dev.dram_latency_cycles
        cycles += _phase_cycles(k, dev, per_sm, resident, run.trips, hot["sass"], hot["xu"], b_dram, b_l2, latency,
                                hot["barriers"], bw_dram_cyc, bw_l2_cyc)  # fmt: skip
        issue_instr += issue_slots(hot["sass"], hot["xu"], dev) * k.num_warps * run.trips * grid
        dram += b_dram * run.trips * grid
        l2 += b_l2 * run.trips * grid
    s = k.straight
    s_bytes = k.straight_bytes
    cycles += _phase_cycles(k, dev, per_sm, resident, 1, s["sass"], s["xu"], s_bytes, 0.0,
                            straight_latencies * dev.dram_latency_cycles, s["barriers"], bw_dram_cyc, bw_l2_cyc)  # fmt: skip
    issue_instr += issue_slots(s["sass"], s["xu"], dev) * k.num_warps * grid
    dram += s_bytes * grid

    t_mem = dram / dev.copy_bw + l2 / dev.l2_bw
    t_issue = issue_instr / (dev.schedulers * dev.sms * f)
    t_run = cycles / f
    t = t_run + dev.launch_s
    if t_mem >= 0.8 * t_run:
        bound = "memory"
    elif t_issue >= 0.8 * t_run:
        bound = "issue"
    else:
        bound = "latency"
    return {
        "time_s": t, "memory_s": t_mem, "issue_s": t_issue, "issue_memory_ratio": t_issue / t_mem if t_mem else None,
        "dram_bytes": dram, "l2_bytes": l2, "bound": bound, "ctas_per_sm": occ["ctas_per_sm"],
        "occupancy": occ["occupancy"], "occupancy_limiter": occ["limiter"], "active_sms": active,
        "waves": grid / (dev.sms * resident),
    }  # fmt: skip
