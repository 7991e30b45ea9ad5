"""Plot the engine host-overhead runs of `benchmarks/serving_h200.py` (section "engine"): per decode step, the
engine's wall time against the decode graph's GPU time, for each (async scheduling, temperature) run.

    python benchmarks/engine_overhead_plot.py benchmarks/results/serving_h200_48b_engine_async_1594fc8.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json")
    ap.add_argument("--out", default=None, help="PNG path (default: the JSON's, .png)")
    args = ap.parse_args()
    data = json.loads(Path(args.json).read_text())
    runs = data["sections"]["engine"]
    labels = [f"{'async' if r['async_scheduling'] else 'sync'}\n"
              + ("greedy" if not r.get("temperature") else f"T={r['temperature']:g}") for r in runs]
    x = range(len(runs))
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar([i - 0.2 for i in x], [r["step_wall_ms"] for r in runs], 0.4, label="engine step (wall)")
    ax.bar([i + 0.2 for i in x], [r["graph_gpu_ms"] for r in runs], 0.4, label="decode graph (GPU)")
    for i, r in zip(x, runs):
        ax.text(i, r["step_wall_ms"] + 0.3, f"{100 * r['cpu_overhead_fraction']:.1f}%", ha="center", fontsize=8)
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms per decode step")
    env = data["env"]
    ax.set_title(f"{runs[0]['geometry']}, batch {runs[0]['batch']}: host time not hidden\n"
                 f"{env['gpu']}, commit {env['commit']}, {env['date']}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out or str(Path(args.json).with_suffix(".png")), dpi=120)


if __name__ == "__main__":
    main()
