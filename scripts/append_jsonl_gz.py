#!/usr/bin/env python
"""Append the lines of JSONL files to a gzipped JSONL file, each id once, atomically.

    python scripts/append_jsonl_gz.py DATA.jsonl.gz NEW.jsonl [NEW.jsonl ...]

Keeps DATA's lines in order, then each NEW line whose id is not there yet (in file order), writes
the whole to a temporary file beside DATA and moves it into place, so DATA is never half written.
Prints how many lines it had, added and now holds. A line without an id is an error (nothing changes).
"""
from __future__ import annotations

import argparse
import gzip
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout without install

from lilicorr.regen import iter_id_lines  # noqa: E402


def append(data: Path, new: list[Path]) -> tuple[int, int]:
    old = list(iter_id_lines(data)) if data.exists() else []
    seen = {i for i, _ in old}
    added = []
    for path in new:
        for i, line in iter_id_lines(path):
            if i not in seen:
                seen.add(i)
                added.append(line)
    tmp = data.with_name(f".{data.name}.tmp")
    with gzip.open(tmp, "wt", encoding="utf-8", compresslevel=9) as f:
        f.writelines(line for _, line in old)
        f.writelines(added)
    os.replace(tmp, data)
    return len(old), len(added)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", type=Path, help="the gzipped JSONL file to grow (made if missing)")
    ap.add_argument("new", type=Path, nargs="+", help="JSONL files (plain or .gz) with the lines to add")
    args = ap.parse_args(argv)
    try:
        had, added = append(args.data, args.new)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.data}: {had} lines, {added} added, {had + added} now")
    return 0


if __name__ == "__main__":
    sys.exit(main())
