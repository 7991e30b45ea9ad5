"""PNG plots of sweeps: the throughput-latency frontier and throughput over time (matplotlib, imported lazily).

Frontier: x = TPS/user (default; or P90 interactivity), y = output tok/s/GPU (default; or total, or TPM/GPU), one
curve per result file, each point labelled with its concurrency; optionally the value interpolated at a stated x.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

AXES = {
    "tps_user": "TPS/user (1000 / mean TPOT, tok/s)",
    "p90_interactivity": "P90 interactivity (1000 / p90 ITL, tok/s/user)",
    "p90_e2e_interactivity": "P90 E2E-normalised interactivity (tok/s/user)",
    "output_tok_s_per_gpu": "output tok/s/GPU",
    "total_tok_s_per_gpu": "total (prompt + output) tok/s/GPU",
    "tpm_per_gpu_output": "TPM/GPU (output)",
    "tpm_per_gpu_total": "TPM/GPU (prompt + output)",
}
Curve = tuple[str, Sequence[dict]]  # (label, points as in the sweep JSON)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def interpolate(points: Sequence[dict], x: str, y: str, at: float) -> float | None:
    """y at x = `at`, linear between the two neighbouring points (sorted by x); None outside the measured range."""
    xy = sorted((p["summary"][x], p["summary"][y]) for p in points)
    for (x0, y0), (x1, y1) in zip(xy, xy[1:]):
        if x0 <= at <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    return None


def plot_frontier(curves: Sequence[Curve], path: str | Path, x: str = "tps_user", y: str = "output_tok_s_per_gpu",
                  at: float | None = None, title: str | None = None) -> Path:
    """One curve per result; points labelled with their concurrency; a marker at x = `at` when given."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    for label, points in curves:
        pts = sorted(points, key=lambda p: p["concurrency"])
        xs = [p["summary"][x] for p in pts]
        ys = [p["summary"][y] for p in pts]
        (line,) = ax.plot(xs, ys, marker="o", label=label)
        for p, xv, yv in zip(pts, xs, ys):
            ax.annotate(str(p["concurrency"]), (xv, yv), textcoords="offset points", xytext=(5, 5), fontsize=8,
                        color=line.get_color())
        if at is not None and (yi := interpolate(pts, x, y, at)) is not None:
            ax.plot([at], [yi], marker="x", markersize=10, color=line.get_color())
            ax.annotate(f"{yi:,.1f} @ {at:g}", (at, yi), textcoords="offset points", xytext=(6, -12), fontsize=8,
                        color=line.get_color())
    if at is not None:
        ax.axvline(at, color="grey", linestyle=":", linewidth=1)
    ax.margins(x=0.08, y=0.12)  # room for the labels of the outermost points
    ax.set_xlabel(AXES.get(x, x))
    ax.set_ylabel(AXES.get(y, y))
    ax.set_title(title or "Throughput-latency frontier (labels: concurrency)")
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_timeline(curves: Sequence[Curve], path: str | Path, title: str | None = None) -> Path:
    """Output tok/s/GPU over time, one line per run (label, concurrency); dashed: each run's average."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 5), dpi=110)
    for label, points in curves:
        for p in sorted(points, key=lambda p: p["concurrency"]):
            tl = p.get("timeline") or {}
            if not tl.get("t_s"):
                continue
            (line,) = ax.step(tl["t_s"], tl["output_tok_s_per_gpu"], where="post",
                              label=f"{label} c={p['concurrency']}")
            ax.axhline(p["summary"]["output_tok_s_per_gpu"], color=line.get_color(), linestyle="--", linewidth=0.8)
    ax.set_xlabel("time since the first scored request (s)")
    ax.set_ylabel("output tok/s/GPU")
    ax.set_title(title or "Output throughput over time (dashed: run average incl. ramp and drain)")
    ax.grid(True, alpha=0.3)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
