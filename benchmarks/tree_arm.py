"""--tree-arm: one more strata arm run by an older tree of this project, in the same record as the
current tree's arms (issue 52: an "after / before" ratio of two arms of one record on one machine,
not of two records taken at different times).

The older tree is a `git archive <commit>` tarball (plain, or compressed as tarfile reads it:
`git archive <commit> | xz > before.tar.xz`). git archive writes the commit into the tar's pax
global header (`comment`), so the arm names the commit it measured without being told. The tree
is unpacked into a temporary directory, removed when the benchmark exits, and the arm's
`strata-launch` runs with that directory as its working directory: `python -m launcher.cli` puts
the working directory first on sys.path, and the launcher starts its ranks
(`python -m strata_dist.rank.main`, launcher/spawn.py) with the working directory it inherited,
so every process of the arm imports the older tree's code. PYTHONPATH is pointed there too, so
a module the older tree lacks is not taken from the current one.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import sys
import tarfile
import tempfile

from records import ROOT, fail

COMMIT = re.compile(r"[0-9a-f]{40}")


def archived_commit(path: str) -> str:
    """The commit a `git archive` tarball was made of (its pax global header's `comment`);
    refused, naming the file, when it is not a readable tar or the header holds no commit."""
    if not os.path.isfile(path):
        fail(f"--tree-arm {path}: no such file")
    try:
        with tarfile.open(path) as tar:
            comment = str(tar.pax_headers.get("comment", ""))
    except (tarfile.TarError, OSError, EOFError) as e:
        fail(f"--tree-arm {path}: not a readable tar ({e})")
    if not COMMIT.fullmatch(comment):
        fail(f"--tree-arm {path}: its pax header names no commit (comment {comment!r}); make it "
             f"with `git archive <commit> | xz > before.tar.xz`")
    return comment


class OlderTree:
    """The tarball unpacked into a temporary directory (removed at exit) and the commit it is."""

    def __init__(self, path: str):
        self.tarball = os.path.abspath(path)
        self.commit = archived_commit(self.tarball)
        self.short = self.commit[:7]
        self.dir = tempfile.mkdtemp(prefix=f"tree-arm-{self.short}-")
        atexit.register(shutil.rmtree, self.dir, ignore_errors=True)
        # must_show.sh runs each benchmark under `timeout` (SIGTERM): exit through atexit then,
        # so the unpacked tree goes too
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        with tarfile.open(self.tarball) as tar:
            # the "data" filter (Python >= 3.11.4): no member lands outside the directory
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(self.dir, **extra)
        if not os.path.isfile(os.path.join(self.dir, "launcher", "cli.py")):
            fail(f"--tree-arm {path}: commit {self.short} holds no launcher/cli.py (not a tree "
                 f"of this project)")

    def env(self) -> dict:
        """The environment's changes for a process of the older tree: its directory in place of
        the current tree on PYTHONPATH (other entries, such as installed wheels, kept)."""
        here = os.path.realpath(ROOT)
        kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.realpath(p) != here]
        return {"PYTHONPATH": os.pathsep.join([self.dir, *kept])}

    def fields(self) -> dict:
        """What the record's arm says of the tree it ran."""
        return {"name": f"strata {self.short}", "tree_commit": self.commit}

    def ratio_line(self, ours: float, theirs: float, what: str = "") -> str:
        """The "after / before" line: this tree's figure over the older tree's."""
        return f"strata (this tree) / strata {self.short}{what}: {ours / theirs:.3f}x"


def first_difference(a: list, b: list) -> int | None:
    """The first index where token lists a and b differ (one ending early counts), else None."""
    at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return None if at == len(a) == len(b) else at


def compare_tokens(arm: dict, tokens: list, first_arm_tokens: list) -> None:
    """An arm's greedy tokens against the first arm's: whether they are the same, and where they
    part (None: they never do; a late first difference reads as a near-tie, an early one as a
    wrong result)."""
    arm["tokens_identical_to_first_arm"] = tokens == first_arm_tokens
    arm["first_token_differing"] = first_difference(tokens, first_arm_tokens)


def tokens_said(arm: dict) -> str:
    """The printed words of compare_tokens' fields."""
    return (f"tokens identical to the first arm's: {arm['tokens_identical_to_first_arm']}"
            + ("" if arm["first_token_differing"] is None
               else f" (first differing at token {arm['first_token_differing']})"))
