"""Mutation check of the fast test tier: plant one plausible bug at a time and require the fast
tier (``python3 -m pytest -q``, the default selection) to fail on each.

Each :class:`Mutation` names a file, an exact text that must occur in it exactly once, its
replacement, and the real bug it stands for. For every mutation the repository's tracked files
(as they are in the working tree) are copied into a temporary directory, the text is replaced
there, and the fast tier runs in that copy with ``-x`` and ``PYTHONPATH`` pointing at the copy's
``python/`` and ``sgl-kernel/python/`` (ahead of any installed ``unimem``). A mutation is
*killed* when pytest exits 1 (a test failed); exit 0 means it *survived*; any other exit (a
collection error, nothing collected, an internal error) is *broken*: the mutation must be a bug
the tests can see, not a crash at import.

A site that is not found exactly once stops the check before anything runs: a refactor that
moves a site must move it here too (``test/test_mutation_sites.py`` checks this in the fast
tier, without running pytest).

Usage::

    python3 tools/mutation_check.py              # every mutation; exit 1 if one is not killed
    python3 tools/mutation_check.py --list       # the mutations, their sites checked
    python3 tools/mutation_check.py --only accept_prefix --baseline

Prints one row per mutation: its name, the outcome, the first failing test and the seconds the
run took.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """Replace ``old`` (which must occur exactly once in ``path``) with ``new``."""

    name: str
    path: str  # relative to the repository root
    old: str
    new: str
    models: str  # the real bug this stands for


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        name="kernel_store_stride",
        path="sgl-kernel/python/unimem_kernel/kv_store.py",
        old="vc = vc_ptr + page * vc_sp + off * vc_so + offs_h * vc_sh + offs_v",
        new="vc = vc_ptr + page * vc_sp + off * vc_so + offs_h * kc_sh + offs_v",
        models="kernel arithmetic: the paged K/V store writes V's heads at K's head stride "
        "(a copy-paste address bug inside the Triton kernel)",
    ),
    Mutation(
        name="allocator_free_count",
        path="python/unimem/memory/id_space.py",
        old="self.free += n\n        return pushed",
        new="self.free += n - 1\n        return pushed",
        models="allocator bookkeeping: unbinding n ids counts one too few back on the free "
        "stack (an id leaks)",
    ),
    Mutation(
        name="metadata_last_page",
        path="sgl-kernel/python/unimem_kernel/metadata.py",
        old='n_pages = torch.div(total + page_size - 1, page_size, rounding_mode="floor")',
        new='n_pages = torch.div(total, page_size, rounding_mode="floor")',
        models="metadata translation: the page table's page count rounds down, dropping a "
        "request's partial last page (the torch reference the CPU engine runs)",
    ),
    Mutation(
        name="accept_prefix",
        path="python/unimem/speculative/accept.py",
        old="accepted = match.to(torch.int32).cumprod(dim=1).sum(dim=1, dtype=torch.int32)",
        new="accepted = match.to(torch.int32).sum(dim=1, dtype=torch.int32)",
        models="accept logic: greedy acceptance counts every matching draft instead of the "
        "matching prefix",
    ),
    Mutation(
        name="scheduler_admission_limit",
        path="python/unimem/engine/scheduler.py",
        old="room = self.max_running - len(self.running)",
        new="room = self.max_running - len(self.running) + 1",
        models="scheduler: admission lets one request more than max_running run",
    ),
)


def site_errors(root: Path = ROOT, mutations: tuple[Mutation, ...] = MUTATIONS) -> list[str]:
    """One message per mutation whose ``old`` text is not found exactly once in its file under
    ``root`` (or whose file is missing, or whose replacement changes nothing); empty when every
    site is in place."""
    errors = []
    names = [m.name for m in mutations]
    for dup in sorted({n for n in names if names.count(n) > 1}):
        errors.append(f"mutation name {dup!r} is used twice")
    for m in mutations:
        file = root / m.path
        if m.old == m.new:
            errors.append(f"{m.name}: the replacement equals the original")
        if not file.is_file():
            errors.append(f"{m.name}: {m.path} does not exist")
            continue
        count = file.read_text().count(m.old)
        if count != 1:
            errors.append(f"{m.name}: the site occurs {count} times in {m.path} (must be once)")
    return errors


def copy_tracked(root: Path, dest: Path) -> None:
    """Copy the files git tracks under ``root`` (their working-tree contents) into ``dest``."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = root / rel
        if not src.is_file():  # deleted in the working tree, or a submodule
            continue
        out = dest / rel
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, out)


def apply(copy: Path, m: Mutation) -> None:
    file = copy / m.path
    text = file.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"{m.name}: the site is not found exactly once in {m.path}")
    file.write_text(text.replace(m.old, m.new))


def first_failure(output: str) -> str:
    """The first ``FAILED``/``ERROR`` node id of pytest's short summary, or ``-``."""
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0]
    return "-"


def run_fast_tier(copy: Path, pytest_args: list[str], timeout: float) -> tuple[int, str]:
    """Run the fast tier in ``copy``; returns pytest's exit status and its output."""
    env = dict(os.environ)
    paths = [str(copy / "python"), str(copy / "sgl-kernel" / "python")]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *pytest_args]
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, out + f"\n[timed out after {timeout:.0f} s]"
    return proc.returncode, proc.stdout + proc.stderr


def outcome(rc: int) -> str:
    return {0: "SURVIVED", 1: "killed"}.get(rc, f"BROKEN (exit {rc})")


def check(mutation: Mutation | None, pytest_args: list[str], timeout: float, keep: bool):
    """Copy, mutate (``None``: the baseline, unmutated), run; ``(rc, first failure, seconds)``."""
    tmp = Path(tempfile.mkdtemp(prefix="unimem-mutation-"))
    try:
        copy_tracked(ROOT, tmp)
        if mutation is not None:
            apply(tmp, mutation)
        start = time.monotonic()
        rc, out = run_fast_tier(tmp, pytest_args, timeout)
        took = time.monotonic() - start
        if rc not in (0, 1):
            sys.stderr.write(out[-3000:] + "\n")
        return rc, first_failure(out), took
    finally:
        if keep:
            print(f"kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the mutations and check sites")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only this mutation (repeatable)")  # fmt: skip
    ap.add_argument("--baseline", action="store_true",
                    help="first run the unmutated fast tier, which must pass")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--keep", action="store_true", help="keep the mutated copies")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)

    errors = site_errors()
    if errors:
        print("mutation sites out of date:\n  " + "\n  ".join(errors), file=sys.stderr)
        return 2
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only) - {m.name for m in MUTATIONS}
    if unknown:
        print(f"unknown mutation(s): {sorted(unknown)}", file=sys.stderr)
        return 2
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.path}\n    {m.models}")
        return 0

    if args.baseline:
        rc, fail, took = check(None, args.pytest_args, args.timeout, args.keep)
        print(f"baseline (unmutated): exit {rc}, {took:.0f} s", flush=True)
        if rc != 0:
            print(f"the unmutated fast tier does not pass (first failure: {fail})")
            return 1
    rows = []
    for m in chosen:
        rc, fail, took = check(m, args.pytest_args, args.timeout, args.keep)
        rows.append((m.name, outcome(rc), fail, took))
        print(f"{m.name}: {outcome(rc)} in {took:.0f} s ({fail})", flush=True)

    w = max(len("mutation"), *(len(r[0]) for r in rows))
    print(f"\n| {'mutation':<{w}} | outcome | first failing test | seconds |")
    print(f"|{'-' * (w + 2)}|---------|--------------------|---------|")
    for name, out, fail, took in rows:
        print(f"| {name:<{w}} | {out} | {fail} | {took:.0f} |")
    survivors = [r for r in rows if r[1] != "killed"]
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
