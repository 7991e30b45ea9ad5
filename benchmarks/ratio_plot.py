"""The horizontal ratio bars the step A/B plots share (`smem_step_plot.py`, `lowrank_step_plot.py`): one bar per
(label, ratio) row, a line at 1.0, green above it and red below unless the caller colours the bars, and the CLI of
such a script (result JSONs in, one PNG out)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def plot_ratios(rows: list[tuple[str, float]], out: str, *, xlabel: str, title: str, xlim: tuple[float, float],
                colors: list[str] | None = None, width: float = 10.0) -> None:
    """Writes the PNG `out` of `rows` (label, ratio), top to bottom in reverse order of the list."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width, 0.27 * len(rows) + 1.5))
    ax.barh(range(len(rows)), [r for _, r in rows],
            color=colors or ["tab:green" if r > 1 else "tab:red" for _, r in rows])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([lab for lab, _ in rows], fontsize=6)
    ax.set_xlim(*xlim)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out} ({len(rows)} bars)")


def ratio_cli(doc: str, ratios: Callable[[Path], list[tuple[str, float]]]) -> tuple[list[tuple[str, float]], str]:
    """Parses `results... --out PNG` and returns (the rows of every result file by `ratios`, the PNG path)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    return [row for p in args.results for row in ratios(Path(p))], args.out
