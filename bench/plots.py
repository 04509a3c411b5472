"""PNG plots of a benchmark results file: per op, the median time and the
percentage of the copy bandwidth of every implementation across shapes.

    python -m bench --plot DIR           (after a run)
    python -m bench.plots RESULTS.json DIR
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from . import copy_bandwidth_label, percent_of_copy, results_label


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def write_plots(payload: dict, out_dir: Path) -> list[Path]:
    """One PNG per op of ``payload`` (the JSON the suite writes) in ``out_dir``,
    named <device slug>-<op slug>.png (the device with the CPU level, see
    ``results_label``); returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    copy_gbps = payload["copy_bandwidth_gbps"]
    measured = [r for r in payload["rows"] if "median_ms" in r]
    device = results_label(payload)
    paths = []
    for op in dict.fromkeys(r["op"] for r in measured):
        rows = [r for r in measured if r["op"] == op]
        labels = list(dict.fromkeys(f"{'x'.join(map(str, r['shape']))} {r['dtype']}" for r in rows))
        fig, (ax_time, ax_bw) = plt.subplots(1, 2, figsize=(13, 4.8))
        for impl in dict.fromkeys(r["impl"] for r in rows):
            points = {f"{'x'.join(map(str, r['shape']))} {r['dtype']}": r for r in rows if r["impl"] == impl}
            xs = [i for i, label in enumerate(labels) if label in points]
            style = {"linewidth": 2.8, "color": "black", "zorder": 3} if impl == "fastrl" else {"linewidth": 1.3}
            ax_time.plot(xs, [points[labels[i]]["median_ms"] for i in xs], marker="o", label=impl, **style)
            ax_bw.plot(xs, [percent_of_copy(points[labels[i]], copy_gbps) for i in xs], marker="o", label=impl, **style)
        ax_time.set_yscale("log")
        ax_time.set_ylabel("median time (ms, log scale)")
        ax_bw.set_ylabel("% of device copy bandwidth")
        ax_bw.axhline(100, color="grey", linestyle=":", linewidth=1)
        for ax in (ax_time, ax_bw):
            ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
            ax.grid(True, alpha=0.3)
        ax_bw.legend(fontsize=7, loc="best")
        fig.suptitle(f"{op} on {device} (copy bandwidth {copy_bandwidth_label(payload, rows)}; bytes: {rows[0]['bytes_formula']})", fontsize=10)
        fig.tight_layout()
        path = out_dir / f"{_slug(device)}-{_slug(op)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plots", description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a results JSON written by python -m bench")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    for path in write_plots(json.loads(args.results.read_text()), args.out_dir):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
