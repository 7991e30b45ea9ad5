"""Put the M buckets of a routing table measured in context over the packaged one (`tokenspeed/ops/gemv_table.json`).

`gemv_h200.py --producer-cycles C --table PATH` times the GEMV configs as a decode step runs them: after a
latency-bound PDL producer kernel, cold L2, with whole-slice configs (the program's whole weight slice loaded before
the PDL wait) in the sweep. Its table covers only the shapes and M buckets it swept. This merges it bucket by bucket:
an (N, K) entry's other buckets stay, an (N, K) the packaged table lacks is added, and every merged bucket records
where it came from (`source`, ignored by the parser like the timings). The step A/B
(`step_profile_h200.py --pdl-configs "...;1:regs:0:table=PATH"`) reads the same merge.

    python benchmarks/gemv_table_merge.py benchmarks/results/gemv_table_ctx_h200_<commit>.json \
        --source "gemv_h200.py --producer-cycles 20000, <commit>"          # rewrites the packaged table
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PACKAGED = Path(__file__).resolve().parents[1] / "tokenspeed" / "ops" / "gemv_table.json"


def merge(base: dict, extra: dict, source: str | None = None) -> dict:
    """base's JSON table with extra's (N, K) -> M-bucket entries put over it bucket by bucket (neither mutated);
    `source`, when given, is recorded in each bucket taken from extra."""
    entries = {nk: dict(per_m) for nk, per_m in base.get("entries", {}).items()}
    for nk, per_m in extra.get("entries", {}).items():
        for m, e in per_m.items():
            entries.setdefault(nk, {})[m] = {**e, "source": source} if source else dict(e)
    return {**base, "entries": entries}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("extra", help="the table gemv_h200.py --table wrote")
    ap.add_argument("--source", required=True, help="recorded in every merged bucket (command, commit)")
    ap.add_argument("--out", default=str(PACKAGED), help="default: the packaged table, rewritten")
    args = ap.parse_args()
    merged = merge(json.loads(PACKAGED.read_text()), json.loads(Path(args.extra).read_text()), args.source)
    Path(args.out).write_text(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {args.out}: {sum(len(v) for v in merged['entries'].values())} buckets")


if __name__ == "__main__":
    main()
