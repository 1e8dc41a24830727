"""Marks the records older than ../shared/RECORDS.md's format `"legacy": true` (once, when the
format came; tests/test_bench_records.py holds every other record to it). A record is only given
that one key, after `bench`: every other key, value and figure stays as it was (the files are read
and written back with the same key order and layout, and the rewrite is checked to be the old text
plus that line). Records already complete, or already marked, are left alone; files that are not
records (benchmarks/results/kernels/, a kernel's own figures) too.

    python benchmarks/mark_legacy.py [--dry-run]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from record_check import check_record  # noqa: E402


def marked(text: str) -> str:
    """The record's text with `"legacy": true` after its `bench` (the layout json.dump(indent=1)
    gave it), refused unless the result is the old text plus that line."""
    record = json.loads(text)
    out = {}
    for key, value in record.items():
        out[key] = value
        if key == "bench":
            out["legacy"] = True
    if "legacy" not in out:
        out = {"legacy": True, **record}
    new = json.dumps(out, indent=1) + ("\n" if text.endswith("\n") else "")
    if new.replace(' "legacy": true,\n', "", 1) != text:
        raise ValueError("its layout is not json.dump(indent=1)'s: marking it would move figures")
    return new


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(HERE, "results"))
    ap.add_argument("--dry-run", action="store_true", help="name the records, change nothing")
    args = ap.parse_args()
    changed = 0
    for path in sorted(glob.glob(os.path.join(args.results, "**", "*.json"), recursive=True)):
        with open(path) as f:
            text = f.read()
        record = json.loads(text)
        if not isinstance(record.get("arms"), list) or record.get("legacy") is True:
            continue
        if not check_record(record, path):
            continue
        try:
            new = marked(text)
        except ValueError as e:
            print(f"error: {path}: {e}", file=sys.stderr)
            return 2
        print(f"legacy: {os.path.relpath(path, args.results)}")
        changed += 1
        if not args.dry_run:
            with open(path, "w") as f:
                f.write(new)
    print(f"{changed} record(s) {'to mark' if args.dry_run else 'marked'} legacy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
