"""Reading compiled kernels for the static sm_90 model (``tools.sass``):
SASS (``nvdisasm -g`` with line info) into a control-flow graph and its loops,
``cuobjdump -res-usage`` into registers / shared / local memory, and Triton's
TTGIR into its ``scf.for`` loops (bound, step, source line, enclosing runtime
``if`` s) and the kernel arguments its loads and stores reach.

Nothing here runs a kernel or needs a GPU: the tools are the ones Triton ships
(``triton/backends/nvidia/bin``) or the CUDA toolkit's.
"""

from __future__ import annotations

import dataclasses
import functools
import linecache
import math
import os
import re
import shutil
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

# ---------------------------------------------------------------------------
# Tools


@functools.cache
def tool(name: str) -> str:
    """Path of a CUDA binary tool (nvdisasm, cuobjdump): Triton's own copy first."""
    try:
        import triton

        path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which(name) or shutil.which(name, path="/usr/local/cuda/bin")
    if found is None:
        raise FileNotFoundError(f"{name} not found (neither in triton/backends/nvidia/bin nor on PATH)")
    return found


def _run_on_cubin(args: list[str], cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([*args, path], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)


def disassemble(cubin: bytes) -> str:
    """``nvdisasm -g -c``: SASS of every function with its source lines."""
    return _run_on_cubin([tool("nvdisasm"), "-g", "-c"], cubin)


def resource_usage(cubin: bytes) -> dict[str, dict[str, int]]:
    """Per function (mangled name): REG, SHARED, LOCAL, STACK from ``cuobjdump -res-usage``."""
    out = _run_on_cubin([tool("cuobjdump"), "-res-usage"], cubin)
    usage, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            usage[name] = {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}
            name = None
    return usage


# ---------------------------------------------------------------------------
# SASS


@dataclasses.dataclass
class Instr:
    addr: int
    guard: str  # "" or the predicate, e.g. "!P0"
    opcode: str  # e.g. "LDG.E.128"
    operands: str
    source: tuple[str, int] | None  # (file, line) from the line info
    label: str | None = None  # branch target label

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    @property
    def parts(self) -> list[str]:
        return self.opcode.split(".")


_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_FILE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_LABEL = re.compile(r"^(\.L\w+|\$?[\w.$]+):\s*$")
_BRANCHES = ("BRA",)
_TERMINATORS = ("EXIT", "RET", "BRX", "JMX", "JMP", "KILL", "BPT")


def split_functions(sass: str) -> dict[str, list[Instr]]:
    """Instructions of each function of an ``nvdisasm -g -c`` listing, in address
    order, with branch labels resolved to addresses (``Instr.label``)."""
    functions: dict[str, list[Instr]] = {}
    labels: dict[str, dict[str, int]] = {}
    current, source, pending = None, None, []
    for raw in sass.splitlines():
        line = raw.strip()
        m = re.match(r"^\.text\.(\S+):$", line)
        if m:
            current = m.group(1)
            functions[current], labels[current], source, pending = [], {}, None, []
            continue
        if current is None:
            continue
        m = _FILE_LINE.search(line)
        if m:
            source = (m.group(1), int(m.group(2)))
            continue
        m = _LABEL.match(line)
        if m and not line.startswith("/*"):
            pending.append(m.group(1))
            continue
        m = _INSTR.match(raw)
        if not m:
            continue
        addr, text = int(m.group(1), 16), m.group(2)
        guard = ""
        if text.startswith("@"):
            guard, text = text[1:].split(None, 1)
        opcode, _, operands = text.partition(" ")
        ins = Instr(addr, guard, opcode, operands.strip(), source)
        lm = re.search(r"`\(([^)]+)\)", operands)
        if lm:
            ins.label = lm.group(1)
        for name in pending:
            labels[current][name] = addr
        pending = []
        functions[current].append(ins)
    for name, instrs in functions.items():
        for ins in instrs:
            if ins.label is not None:
                ins.label = labels[name].get(ins.label, ins.label)
    return functions


def _conditional(ins: Instr) -> bool:
    """A branch or exit that may fall through: guarded by a predicate other than PT,
    or a BRA with a predicate operand (``BRA P1, target``)."""
    if ins.guard and ins.guard != "PT":
        return True
    return ins.base in _BRANCHES and bool(re.match(r"!?U?P[T0-9]", ins.operands))


@dataclasses.dataclass
class Block:
    index: int
    instrs: list[Instr]
    succs: list[int] = dataclasses.field(default_factory=list)
    preds: list[int] = dataclasses.field(default_factory=list)

    @property
    def start(self) -> int:
        return self.instrs[0].addr


@dataclasses.dataclass
class Loop:
    header: int
    latches: list[int]
    body: set[int]
    children: list[Loop] = dataclasses.field(default_factory=list)
    parent: Loop | None = None

    @property
    def innermost(self) -> bool:
        return not self.children


class CFG:
    """The blocks of one function reachable from its entry through branches and
    fall-through (subroutines reached only by CALL, such as the slow paths of
    divisions, and the padding after the last EXIT are left out), its dominators
    and natural loops."""

    def __init__(self, instrs: list[Instr]):
        self.instrs = instrs
        by_addr = {ins.addr: i for i, ins in enumerate(instrs)}
        leaders = {0}
        for i, ins in enumerate(instrs):
            if ins.base in _BRANCHES and isinstance(ins.label, int):
                leaders.add(by_addr[ins.label])
            if ins.base in _BRANCHES or ins.base in _TERMINATORS:
                leaders.add(i + 1)
        starts = sorted(s for s in leaders if s < len(instrs))
        all_blocks = [instrs[s:e] for s, e in zip(starts, [*starts[1:], len(instrs)])]
        start_of = {blk[0].addr: k for k, blk in enumerate(all_blocks)}
        succs: dict[int, list[int]] = {}
        for k, blk in enumerate(all_blocks):
            last, out = blk[-1], []
            falls = k + 1 < len(all_blocks)
            if last.base in _BRANCHES:
                if isinstance(last.label, int) and last.label in start_of:
                    out.append(start_of[last.label])
                if _conditional(last) and falls:
                    out.append(k + 1)
            elif last.base in _TERMINATORS:
                if _conditional(last) and falls and last.base == "EXIT":
                    out.append(k + 1)
            elif falls:
                out.append(k + 1)
            succs[k] = list(dict.fromkeys(out))
        # Keep the blocks reachable from the entry, renumbered in address order.
        seen, stack = set(), [0]
        while stack:
            k = stack.pop()
            if k in seen:
                continue
            seen.add(k)
            stack.extend(succs[k])
        order = sorted(seen)
        new = {old: i for i, old in enumerate(order)}
        self.blocks = [Block(new[k], all_blocks[k], [new[s] for s in succs[k]]) for k in order]
        for b in self.blocks:
            for s in b.succs:
                self.blocks[s].preds.append(b.index)
        self._dominators()
        self.loops = self._loops()

    def _dominators(self) -> None:
        n = len(self.blocks)
        everything = set(range(n))
        dom = [everything.copy() for _ in range(n)]
        dom[0] = {0}
        changed = True
        while changed:
            changed = False
            for b in self.blocks[1:]:
                preds = [dom[p] for p in b.preds]
                new = set.intersection(*preds) if preds else set()
                new = new | {b.index}
                if new != dom[b.index]:
                    dom[b.index], changed = new, True
        self.dom = dom

    def _loops(self) -> list[Loop]:
        """Natural loops, one per header (back edges to a header merged),
        nested by containment; returned outermost first, in address order."""
        latches: dict[int, list[int]] = {}
        for b in self.blocks:
            for s in b.succs:
                if s in self.dom[b.index]:
                    latches.setdefault(s, []).append(b.index)
        loops = []
        for header, tails in sorted(latches.items()):
            body, stack = {header}, list(tails)
            while stack:
                k = stack.pop()
                if k not in body:
                    body.add(k)
                    stack.extend(self.blocks[k].preds)
            loops.append(Loop(header, tails, body))
        for loop in loops:
            enclosing = [o for o in loops if o is not loop and loop.body < o.body]
            if enclosing:
                loop.parent = min(enclosing, key=lambda o: len(o.body))
                loop.parent.children.append(loop)
        return loops

    def all_loops(self) -> list[Loop]:
        return sorted(self.loops, key=lambda lp: self.blocks[lp.header].start)

    # -- paths -------------------------------------------------------------

    def path(self, region: set[int], entry: int, ends: set[int], collapse: list[Loop], shortest: bool = True
             ) -> list[int]:  # fmt: skip
        """The blocks of the hot (or the dearest) path from ``entry`` to any block
        of ``ends`` inside ``region``, never taking an edge back to ``entry``, each
        loop of ``collapse`` standing as one node of no cost (its header) whose
        successors are the loop's exits. The hot path does the most *work* (global
        loads and stores, MUFU.EX2, shared-memory atomics: what every element
        needs; a histogram of a masked block branches around each element's
        atomic, and its common side is to take it), and among those
        paths it is the one of fewest instructions: a data-dependent branch that
        skips the work (a block of only -inf so far) or adds a fix-up (a rescale
        when the running max rises, the count at the max) takes its common side.
        The dearest path has the most instructions."""
        inner_of = {}
        for loop in collapse:
            for k in loop.body:
                inner_of[k] = loop
        nodes = {k for k in region if k not in inner_of or inner_of[k].header == k}

        def succs(k: int) -> list[int]:
            if k in inner_of:
                loop = inner_of[k]
                out = {s for b in loop.body for s in self.blocks[b].succs if s not in loop.body}
            else:
                out = set(self.blocks[k].succs)
            return [s for s in out if s in nodes and s != entry]

        def cost(k: int) -> tuple[int, int]:
            if k in inner_of:
                return (0, 0)
            instrs = self.blocks[k].instrs
            work = sum(1 for i in instrs if i.base in ("LDG", "STG", "ATOMS") or i.opcode.startswith("MUFU.EX2"))
            return (-work, len(instrs)) if shortest else (0, len(instrs))

        # Longest / shortest path on a DAG: order the nodes topologically first.
        order, state = [], {}

        def visit(k: int) -> None:
            stack = [(k, iter(succs(k)))]
            state[k] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    order.append(node)
                    stack.pop()
                elif nxt not in state:
                    state[nxt] = 1
                    stack.append((nxt, iter(succs(nxt))))

        visit(entry)
        order.reverse()
        best = {entry: cost(entry)}
        came: dict[int, int] = {}
        better = (lambda a, b: a < b) if shortest else (lambda a, b: a > b)
        for k in order:
            if k not in best:
                continue
            for s in succs(k):
                if state.get(s) != 2:
                    continue
                c = tuple(x + y for x, y in zip(best[k], cost(s)))
                if s not in best or better(c, best[s]):
                    best[s], came[s] = c, k
        reached = [e for e in ends if e in best]
        if not reached:
            return []
        end = min(reached, key=lambda e: best[e]) if shortest else max(reached, key=lambda e: best[e])
        path = [end]
        while path[-1] != entry:
            path.append(came[path[-1]])
        return [k for k in reversed(path) if k not in inner_of]

    def instrs_of(self, blocks: list[int]) -> list[Instr]:
        return [ins for k in blocks for ins in self.blocks[k].instrs]


# ---------------------------------------------------------------------------
# Instruction statistics

_WIDTHS = {"U8": 8, "S8": 8, "U16": 16, "S16": 16, "64": 64, "128": 128}
_INT_ALU = {"IADD3", "IMAD", "LEA", "ISETP", "SHF", "LOP3", "IADD", "IABS", "IMNMX", "VIADD", "SEL", "UIADD3", "UIMAD",
            "ULEA", "UISETP", "USHF", "ULOP3", "UIMNMX", "USEL", "IMUL"}  # fmt: skip


def access_bits(ins: Instr) -> int:
    """Bits moved per thread by a global load / store (32 unless the opcode says otherwise)."""
    return next((_WIDTHS[p] for p in ins.parts[1:] if p in _WIDTHS), 32)


def is_wide_int(ins: Instr) -> bool:
    """The high half of a 64-bit integer operation (carry / extended / wide forms):
    one per 64-bit add, compare or multiply."""
    if ins.base not in _INT_ALU:
        return False
    parts = set(ins.parts[1:])
    return bool(parts & {"X", "EX", "WIDE", "U64", "S64"}) or "U64.HI" in ins.opcode


# The quarter-rate unit's instructions on sm_90 (16 lanes a cycle an SM, so 8
# cycles a warp instruction on one scheduler's share): transcendentals, population
# count, find-leading-one, bit reverse (CUDA C++ Programming Guide, arithmetic
# instruction throughput, compute capability 9.0).
XU_OPCODES = frozenset({"MUFU", "POPC", "FLO", "BREV"})


def summarise(instrs: list[Instr]) -> dict:
    """Counts over a straight run of instructions (a path)."""
    loads = Counter(access_bits(i) for i in instrs if i.base == "LDG")
    stores = Counter(access_bits(i) for i in instrs if i.base == "STG")
    return {
        "sass": len(instrs),
        "ldg": {str(k): v for k, v in sorted(loads.items())},
        "stg": {str(k): v for k, v in sorted(stores.items())},
        "ld_bits": sum(k * v for k, v in loads.items()),
        "st_bits": sum(k * v for k, v in stores.items()),
        "barriers": sum(1 for i in instrs if i.base == "BAR"),
        "mufu": sum(1 for i in instrs if i.base == "MUFU"),
        "xu": sum(1 for i in instrs if i.base in XU_OPCODES),
        "fp64": sum(1 for i in instrs if i.base in ("DADD", "DMUL", "DFMA", "DSETP", "DMNMX")),
        "int64": sum(1 for i in instrs if is_wide_int(i)),
        "shuffles": sum(1 for i in instrs if i.base == "SHFL"),
        "local": sum(1 for i in instrs if i.base in ("LDL", "STL")),
    }


# ---------------------------------------------------------------------------
# TTGIR


@dataclasses.dataclass
class IRLoop:
    source: tuple[str, int] | None
    lower: str
    upper: str
    step: str
    guards: list[tuple[str, int]]  # the runtime `if`s around it (source lines)
    depth: int
    whole_tiles: bool = False  # bounded by upper - upper % c: the whole tiles of c (c = step, or a divisor of it)
    tile: str | None = None  # that c (whole_tiles)
    else_guards: list[tuple[str, int]] = dataclasses.field(default_factory=list)  # the ifs it is in the else of


@dataclasses.dataclass
class IRMemOp:
    kind: str  # "load" / "store"
    source: tuple[str, int] | None
    elem: str  # bf16, f32, i8, ...
    arg: str | None  # the kernel argument the pointer comes from
    loops: int  # how many loops enclose it
    loop: int | None  # index (in TTGIR.loops) of the innermost loop around it
    tensor: bool  # a block of values (one or more per thread), not a scalar
    elements: int  # values it moves per program (1 for a scalar)


@dataclasses.dataclass
class TTGIR:
    args: list[str]  # kernel arguments in order (non-constexpr)
    constants: dict[str, int]
    loops: list[IRLoop]
    memops: list[IRMemOp]


_LOC_DEF = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$")
_SSA = r"%[\w.\-]+(?:#\d+)?"


def _resolve_locs(text: str) -> dict[str, tuple[str, int] | None]:
    raw = {m.group(1): m.group(2) for m in map(_LOC_DEF.match, text.splitlines()) if m}
    memo: dict[str, tuple[str, int] | None] = {}

    def resolve(body: str, depth: int = 0) -> tuple[str, int] | None:
        if depth > 50:
            return None
        m = re.match(r'^"([^"]+)":(\d+):\d+', body)
        if m:
            return m.group(1), int(m.group(2))
        m = re.match(r"^callsite\(#(loc\d*) at", body)  # the callee's line first
        if m:
            return get(m.group(1), depth + 1)
        m = re.match(r'^"[^"]*"\(#(loc\d*)\)', body)  # a named location
        if m:
            return get(m.group(1), depth + 1)
        m = re.match(r"^fused\[#(loc\d*)", body)
        if m:
            return get(m.group(1), depth + 1)
        return None

    def get(name: str, depth: int = 0):
        if name not in memo:
            memo[name] = resolve(raw.get(name, ""), depth)
        return memo[name]

    return {name: get(name) for name in raw}


def _trailing_loc(line: str, locs: dict) -> tuple[str, int] | None:
    m = re.search(r"loc\(#(loc\d*)\)\s*$", line)
    if m:
        return locs.get(m.group(1))
    m = re.search(r'loc\("([^"]+)":(\d+):\d+\)\s*$', line)
    return (m.group(1), int(m.group(2))) if m else None


def parse_ttgir(text: str) -> TTGIR:
    """The loops, constants and memory operations of a Triton TTGIR module (one kernel)."""
    locs = _resolve_locs(text)
    lines = text.splitlines()
    args: list[str] = []
    for line in lines:
        if "tt.func public" in line:
            args = re.findall(r"(%[\w.\-]+): [^,()]*?(?:\{[^}]*\})? loc\(", line)
            break
    constants: dict[str, int] = {}
    defs: dict[str, tuple[str, list[str]]] = {}
    loops: list[IRLoop] = []
    guard_markers: list[list[tuple[int, bool]]] = []  # per loop: the open ifs around it (marker, in their else)
    if_locs: dict[int, tuple[str, int] | None] = {}
    memops: list[IRMemOp] = []
    stack: list[tuple[str, int]] = []  # ("for", loop index) / ("if" or "else", marker)
    last_yield: dict[int, tuple[str, int] | None] = {}  # stack depth -> loc of the last scf.yield there
    for line in lines:
        s = line.strip()
        m = re.match(rf"^({_SSA}(?:,\s*{_SSA})*)(?::\d+)? = ([\w.]+)\s*(.*)$", s)
        if m:
            results, op, rest = [r.strip() for r in m.group(1).split(",")], m.group(2), m.group(3)
            if op == "arith.constant":
                cm = re.match(r"^(-?\d+) : i\d+", rest)
                if cm:
                    constants[results[0]] = int(cm.group(1))
            operands = re.findall(_SSA, rest.split(" : ")[0]) if op != "scf.for" else []
            for r in results:
                defs[r.split("#")[0]] = (op, operands)
        if re.search(r"\bscf\.for\b", s) and s.endswith("{"):
            fm = re.search(rf"scf\.for ({_SSA}) = ({_SSA}|\d+) to ({_SSA}|\d+) step ({_SSA}|\d+)", s)
            depth = sum(1 for k, _ in stack if k == "for")
            upper, tile = _whole_tiles_bound(fm.group(3), defs, args)
            loops.append(IRLoop(None, fm.group(2), upper, fm.group(4), [], depth, tile is not None, tile=tile))
            guard_markers.append([(marker, k == "else") for k, marker in stack if k in ("if", "else")])
            if "iter_args" in s:
                for im in re.finditer(rf"({_SSA}) = ({_SSA})", s.split("iter_args", 1)[1]):
                    defs[im.group(1)] = ("iter_arg", [im.group(2)])
            stack.append(("for", len(loops) - 1))
            continue
        if re.search(r"\bscf\.(if|while|execute_region)\b", s) and s.endswith("{"):
            stack.append(("if", len(if_locs)))
            if_locs[len(if_locs)] = None
            continue
        if s.startswith("}") and s.endswith("{"):  # } else {  /  } do {
            if s.startswith("} else") and stack and stack[-1][0] == "if":
                stack[-1] = ("else", stack[-1][1])
            continue
        if s.endswith("{"):  # a reduction's combine region, the function, the module
            stack.append(("region", -1))
            continue
        if s.startswith("scf.yield"):
            last_yield[len(stack)] = _trailing_loc(s, locs)
        if s.startswith("}") and stack:
            kind, ref = stack.pop()
            if kind == "region":
                continue
            if kind == "for":
                # A for with results carries its result's name as location; the
                # yield that ends its body keeps the for statement's line.
                loops[ref].source = last_yield.pop(len(stack) + 1, None) or _trailing_loc(s, locs)
            else:
                last_yield.pop(len(stack) + 1, None)
                if_locs[ref] = _trailing_loc(s, locs)
            continue
        mm = re.search(rf"\btt\.(load|store) ({_SSA})", s)
        if mm:
            tm = re.search(r"!tt\.ptr<(\w+)>", s)
            fors = [ref for k, ref in stack if k == "for"]
            shape = re.search(r"tensor<((?:\d+x)+)!tt\.ptr", s.split(" : ", 1)[-1])
            elements = math.prod(int(d) for d in shape.group(1).rstrip("x").split("x")) if shape else 1
            memops.append(IRMemOp(mm.group(1), _trailing_loc(s, locs), tm.group(1) if tm else "?",
                                  _trace_arg(mm.group(2), defs, args), len(fors), fors[-1] if fors else None,
                                  shape is not None, elements))  # fmt: skip
    for loop, markers in zip(loops, guard_markers):
        loop.guards = [if_locs[k] for k, in_else in markers if not in_else and if_locs.get(k) is not None]
        loop.else_guards = [if_locs[k] for k, in_else in markers if in_else and if_locs.get(k) is not None]
    return TTGIR([a.lstrip("%") for a in args], constants, loops, memops)


def _whole_tiles_bound(upper: str, defs: dict, args: list[str]) -> tuple[str, str | None]:
    """(bound, tile): a loop over the whole tiles of a row, ``range(0, n - n % c, step)``
    with n = V or V less a few elements (its partial tile and a head before an
    aligned boundary handled apart), is bounded by V, over floor(V / c) tiles of
    c (step = c, or a multiple of it: tiles taken several an iteration); tile is
    None for any other loop."""
    op, operands = defs.get(upper.split("#")[0], (None, []))
    if op != "arith.subi" or len(operands) != 2:
        return upper, None
    rem_op, rem_operands = defs.get(operands[1].split("#")[0], (None, []))
    if rem_op not in ("arith.remsi", "arith.remui") or rem_operands[:1] != operands[:1] or len(rem_operands) != 2:
        return upper, None
    n = operands[0].split("#")[0]
    while n not in args and defs.get(n, (None,))[0] == "arith.subi":
        n = defs[n][1][0].split("#")[0]
    return (n if n in args else operands[0]), rem_operands[1].split("#")[0]


def _trace_arg(ssa: str, defs: dict, args: list[str]) -> str | None:
    """The kernel argument a pointer value derives from (through addptr, splat,
    broadcast, layout conversions, selects and loop-carried values)."""
    seen = set()
    todo = [ssa.split("#")[0]]
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        if v in args:
            return v.lstrip("%")
        op, operands = defs.get(v, (None, []))
        if op is None:
            continue
        if op in ("tt.addptr", "tt.splat", "tt.broadcast", "ttg.convert_layout", "tt.expand_dims", "tt.reshape",
                  "iter_arg", "tt.trans", "ttg.memdesc_subview"):  # fmt: skip
            todo.extend(operands[:1])
        elif op == "arith.select":
            todo.extend(operands[1:3])
    return None


# The checkout whose kernels the model reads.
_ROOT = Path(__file__).resolve().parents[2]


def source_path(path: str) -> str:
    """The file of this checkout that a compiled kernel's source location names. Triton's cache
    keys a kernel by its code and line numbers, not its file's path, so a cached TTGIR may name
    the file where it was first compiled: another checkout, maybe since removed or changed. The
    longest tail of at least two parts (``kernels/reduce.py``) that is a file here is that file;
    a path with no such tail is kept."""
    parts = Path(path).parts
    for start in range(len(parts) - 1):
        candidate = _ROOT.joinpath(*parts[start:])
        if candidate.is_file():
            return str(candidate)
    return path


def source_text(source: tuple[str, int] | None) -> str:
    """The line a source location names, stripped ("" for none)."""
    return linecache.getline(source_path(source[0]), source[1]).strip() if source else ""
