"""Corpus recipe of the default model: the Python standard library's own source, no downloads.

Every `*.py` file under `sysconfig.get_paths()["stdlib"]` (site-packages, __pycache__ and the machine-specific
`_sysconfigdata_*` excluded; files that are not valid UTF-8, a few deliberate encoding tests, skipped), in sorted
POSIX path order. A file is held out when the first 8 bytes of sha256(relative path), as an integer, fall in the
lowest HELDOUT_PER_10K / 10000 of the range: the split depends on the path only, so it is stable across Python
versions and machines. The corpus itself differs between Python versions; `manifest()` fingerprints it.

    python scripts/default_model/corpus.py            # summary + build/default_model/corpus.json (the manifest)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

HELDOUT_PER_10K = 200  # 2 %
EXCLUDED_DIRS = {"site-packages", "__pycache__"}
REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "build" / "default_model"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    """Held out by the hash of the relative POSIX path (about 2 % of files)."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return h % 10_000 < HELDOUT_PER_10K


def iter_files(root: Path | None = None) -> Iterator[tuple[str, str]]:
    """(relative POSIX path, text) of every corpus file, in sorted path order."""
    root = root or stdlib_root()
    paths = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_DIRS & set(rel.parts[:-1]) or rel.name.startswith("_sysconfigdata"):
            continue
        paths.append(rel.as_posix())
    for rel in sorted(paths):
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text.strip():
            yield rel, text


def split_files(root: Path | None = None) -> dict[str, list[tuple[str, str]]]:
    """{"train": [...], "heldout": [...]} of (relpath, text), each in sorted path order."""
    out: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": []}
    for rel, text in iter_files(root):
        out["heldout" if is_heldout(rel) else "train"].append((rel, text))
    return out


def manifest(splits: dict[str, list[tuple[str, str]]]) -> dict:
    """Sizes and a sha256 fingerprint of each split (over path + content, in order)."""
    info: dict = {"python": sys.version.split()[0], "stdlib": str(stdlib_root()),
                  "heldout_per_10k": HELDOUT_PER_10K}
    for name, files in splits.items():
        h = hashlib.sha256()
        for rel, text in files:
            h.update(rel.encode() + b"\0" + text.encode() + b"\0")
        info[name] = {"files": len(files), "chars": sum(len(t) for _, t in files),
                      "bytes": sum(len(t.encode()) for _, t in files), "sha256": h.hexdigest()}
    info["heldout_files"] = [rel for rel, _ in splits["heldout"]]
    return info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=BUILD / "corpus.json")
    args = ap.parse_args()
    info = manifest(split_files())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(info, indent=2))
    for name in ("train", "heldout"):
        s = info[name]
        print(f"{name:8s} {s['files']:5d} files {s['bytes'] / 1e6:7.2f} MB  sha256 {s['sha256'][:16]}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
