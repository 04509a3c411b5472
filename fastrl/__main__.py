"""``python -m fastrl info``: version, library versions, available backends, devices."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys

import torch

from . import __version__, _backend


def _version(module: str) -> str:
    try:
        return getattr(importlib.import_module(module), "__version__", "unknown")
    except ImportError:
        return "not installed"


def _native_level(build: dict) -> str:
    """The x86-64 level the native kernels run at, and the CPU's best when
    FASTRL_CPU_ISA chose a lower one."""
    level = build["cpu_isa"]
    best = build.get("cpu_isa_best", level)
    return level if best == level else f"{level}, forced by FASTRL_CPU_ISA; the CPU has {best}"


def _sampler_histogram() -> str:
    """The note on the Triton sampler's histogram where the installed Triton's
    tl.histogram is slow (the kernels' Triton-version policy: fastrl.kernels._launch)."""
    from .kernels import _launch

    if not _launch.triton_histogram_is_slow():
        return ""
    return f" (sampler: split rows take the window histogram, triton < {'.'.join(map(str, _launch.FAST_HISTOGRAM_TRITON))})"


def info_lines() -> list[str]:
    native = _backend.native_module()
    build = native.build_info() if native is not None else None
    cuda = torch.cuda.is_available()
    triton_ok = _backend.triton_importable()
    yes_no = lambda ok, why="": "yes" if ok else f"no{' (' + why + ')' if why else ''}"  # noqa: E731
    lines = [
        f"fastrl {__version__}",
        f"python {platform.python_version()}, torch {torch.__version__}, triton {_version('triton')}",
        "backends:",
        "  native CPU:         "
        + (yes_no(True) + f" ({_native_level(build)}, {build['openmp_threads']} OpenMP threads)" if build else yes_no(False, "fastrl._C not built")),
        "  LM head bf16 GEMM:  "
        + ("native AVX512-BF16 (float32 sums)" if build and build["bf16_gemm"]
           else f"torch float32 on widened bf16 ({'no AVX512-BF16' if build else 'fastrl._C not built'})"),
        "  Triton compiled:    " + yes_no(triton_ok and cuda, "no CUDA device" if triton_ok else "triton not installed")
        + (_sampler_histogram() if triton_ok and cuda else ""),
        "  Triton interpreter: " + yes_no(triton_ok and _backend.triton_interpreter(), "set TRITON_INTERPRET=1" if triton_ok else "triton not installed"),
        "  reference:          yes",
        f"forced backend: {_backend.forced_backend() or 'none'}",
        "devices:",
        f"  cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
    ]
    if cuda:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  cuda:{i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, CUDA {torch.version.cuda}")
    else:
        lines.append("  cuda: none")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastrl")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, available backends and devices")
    parser.parse_args(argv)
    print("\n".join(info_lines()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
