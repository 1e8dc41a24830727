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

Kernel binaries: with $STRATA_KERNEL_CUBINS naming a folder (kernels built ahead with nvcc,
strata_dist/kernels/prebuild.py), the current arm loads nvcc's binaries of its sources from it,
but an older tree's sources hash to other names, so its ranks would compile theirs with NVRTC
through CuPy, which appends -ftz=true and is another compiler build: the two arms would not run
the same machine code for the same source. On 2026-12-06 a Q8_0 decode measured 0.965x its
tree arm (f13c4ab) that way (decode-qwen3-30b-a3b-q8_0-2026-12-06-142937-7faf4b7.json) while
every kernel such a step launches had byte-identical machine code in the two trees under one
compiler. So the older tree's own kernels are built into the same folder (`prebuild_kernels`)
and both trees' binaries are checked there before anything is measured.
"""
from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile

from records import CUBINS_ENV, ROOT, device_arch, fail

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




def cubin_names(tree: str, env: dict, shape: str, arch: str) -> list[str]:
    """The binaries a tree's ranks look for under $STRATA_KERNEL_CUBINS at kernel shape `shape`
    (decode.cu built with its defines, every other source with none: kernels/prebuild.py), as
    that tree's own code names them (its kernels/__init__.py cubin_name)."""
    code = ("import sys; import strata_dist.kernels as k; "
            "from strata_dist.kernels.abi import KernelShape; "
            "d = KernelShape.parse(sys.argv[1]).defines(); "
            "print('\\n'.join(k.cubin_name(s.name, d if s.name == 'decode.cu' else (), "
            "sys.argv[2]) for s in k.sources()))")
    done = subprocess.run([sys.executable, "-c", code, shape, arch], cwd=tree,
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        fail(f"--tree-arm: the kernel binaries' names of {tree} could not be read: "
             f"{done.stderr.strip()[-1500:]}")
    return done.stdout.split()


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
        self.prebuild_kernels()

    def env(self) -> dict:
        """The environment's changes for a process of the older tree: its directory in place of
        the current tree on PYTHONPATH (other entries, such as installed wheels, kept)."""
        here = os.path.realpath(ROOT)
        kept = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and os.path.realpath(p) != here]
        return {"PYTHONPATH": os.pathsep.join([self.dir, *kept])}

    def prebuild_kernels(self) -> None:
        """With $STRATA_KERNEL_CUBINS naming a folder: the older tree's kernels built into it by
        the older tree's own kernels/prebuild.py (for $STRATA_KERNEL_SHAPE too, where set), then
        each tree's binaries looked for there, so that both arms load nvcc's binaries; refused,
        saying why, where either tree's are missing (an arm would compile with NVRTC). Without
        the variable (or with no such folder, where both trees compile with NVRTC) nothing."""
        folder = os.environ.get(CUBINS_ENV, "")
        if not folder or not os.path.isdir(folder):
            return
        # the older tree's prebuild and ranks run in its own directory: one absolute folder
        folder = os.environ[CUBINS_ENV] = os.path.abspath(folder)
        from strata_dist.compute_options import read_environment   # the one reader of the switches
        shape = read_environment().kernel_shape
        arch = device_arch()

        def missing(who: str, tree: str, env: dict) -> None:
            lacks = [n for n in cubin_names(tree, env, shape, arch)
                     if not os.path.isfile(os.path.join(folder, n))]
            if lacks:
                fail(f"--tree-arm: ${CUBINS_ENV}={folder} lacks {who}'s {', '.join(lacks)}: its "
                     f"arm would compile them with NVRTC while the other loads nvcc's binaries. "
                     f"Build them with `python -m strata_dist.kernels.prebuild --out {folder}"
                     f"{' --shape ' + shape if shape else ''} --arch {arch}` in that tree, or "
                     f"unset ${CUBINS_ENV} to measure both trees' NVRTC builds")
        missing("this tree", ROOT, {})           # before anything is built
        if not os.path.isfile(os.path.join(self.dir, "strata_dist", "kernels", "prebuild.py")):
            fail(f"--tree-arm: commit {self.short} has no strata_dist/kernels/prebuild.py to build "
                 f"its kernels into ${CUBINS_ENV}={folder}: its arm would compile them with NVRTC "
                 f"while this tree's load nvcc's. Unset ${CUBINS_ENV} to measure both trees' "
                 f"NVRTC builds")
        cmd = [sys.executable, "-m", "strata_dist.kernels.prebuild", "--out", folder,
               "--arch", arch, "--jobs", str(os.cpu_count() or 2)]
        print(f"tree arm {self.short}: building its kernels into ${CUBINS_ENV} "
              f"(nvcc, as this tree's there)", flush=True)
        done = subprocess.run(cmd + (["--shape", shape] if shape else []), cwd=self.dir,
                              env={**os.environ, **self.env()}, capture_output=True, text=True,
                              timeout=1800)
        if done.returncode != 0:
            fail(f"--tree-arm: building commit {self.short}'s kernels into {folder} failed "
                 f"(exit {done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}")
        missing(f"commit {self.short}", self.dir, self.env())

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
