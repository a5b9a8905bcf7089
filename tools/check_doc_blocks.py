"""Runs every code block of the README and the user guide, so that what they show keeps working.

    python tools/check_doc_blocks.py                 # README.md and docs/*.md
    python tools/check_doc_blocks.py docs/amp.md     # one page

The rules a page follows (docs/architecture.md says them to contributors):

* A ```python block runs, in the order of the page, in one namespace per page (a block may use what
  an earlier one made), in a scratch directory that is the page's working directory.
* A ```bash block runs in the same directory with ``bash -e`` (``python`` is this interpreter, and
  the repository is on ``PYTHONPATH``), after the page's python blocks before it.
* A ```text block is output, not code: it is not run; nor is a MyST directive (```{toctree}).
* ``<!-- doc-setup ... -->`` holds python that runs at its place in the page without being shown:
  the tiny model and data a snippet assumes, written where a reader of the source sees them.
* ``<!-- not run: REASON -->`` on the line before a block skips it; the reason is required and
  printed (what needs torchrun or a GPU, what installs packages, what CI runs elsewhere).

Any other block (no language, ``sh``, ``console``, ...) is an error until it is labelled ``text``,
made runnable, or marked not run: nothing shown to a user is left unchecked by accident. The lab
notebook (docs/lab, benchmarks/*.md) and the design notes (docs/dev) record what ran, with their
outputs; they are not run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)(?P<info>[^`\n]*)$")
NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(?P<reason>.*?)\s*-->\s*$")
SETUP_START = re.compile(r"^\s*<!--\s*doc-setup\s*$")
RUNNABLE = {"python", "bash"}
OUTPUT = {"text"}


@dataclass
class Block:
    """One thing on a page to run or skip, in page order."""

    path: Path
    line: int  # 1-based, of the opening fence (or of the doc-setup comment)
    language: str  # "python", "bash", "text", "setup", or what the fence says
    code: str
    not_run: str | None = None  # the reason, for a block marked not run


def blocks_of(path: Path) -> list[Block]:
    """The page's fenced blocks and doc-setup comments, in order; a fence left open is an error."""
    lines = path.read_text().split("\n")
    found: list[Block] = []
    i = 0
    while i < len(lines):
        if SETUP_START.match(lines[i]):
            start = i
            i += 1
            body: list[str] = []
            while i < len(lines) and lines[i].strip() != "-->":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise SystemExit(f"{path}:{start + 1}: a doc-setup comment is never closed by a '-->' line")
            found.append(Block(path, start + 1, "setup", textwrap.dedent("\n".join(body))))
            i += 1
            continue
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        start, indent, fence = i, opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0] if opening["info"].strip() else ""
        i += 1
        body = []
        while i < len(lines) and lines[i].strip() != fence:
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise SystemExit(f"{path}:{start + 1}: a code block is never closed")
        previous = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marked = NOT_RUN.match(previous)
        found.append(Block(path, start + 1, language, "\n".join(body), marked["reason"] if marked else None))
        i += 1
    return found


def check_page(path: Path, verbose: bool) -> list[str]:
    """Runs one page's blocks; returns its failures (each names the file and line)."""
    failures: list[str] = []
    namespace: dict[str, object] = {"__name__": "__main__"}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env.setdefault("MPLBACKEND", "Agg")
    ran = skipped = 0
    with tempfile.TemporaryDirectory(prefix="nanscan-doc-") as scratch, tempfile.TemporaryDirectory() as bin_dir:
        # `python` in a block is this one. A script, not a symlink: a link to a venv's python (itself a
        # link to the base interpreter) is not in the venv's folder, so Python would not find the
        # venv's pyvenv.cfg beside it and would start as the base interpreter, without the packages.
        wrapper = os.path.join(bin_dir, "python")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
        os.chmod(wrapper, 0o755)
        env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
        here = os.getcwd()
        os.chdir(scratch)
        try:
            for block in blocks_of(path):
                where = f"{block.path.relative_to(ROOT)}:{block.line}"
                if block.not_run is not None:
                    if not block.not_run:
                        failures.append(f"{where}: 'not run' needs a reason")
                    skipped += 1
                    if verbose:
                        print(f"  {where}: not run ({block.not_run})")
                    continue
                if block.language in OUTPUT or block.language.startswith("{"):
                    continue  # output, or a MyST directive (a toctree, an include): not code
                if block.language not in RUNNABLE and block.language != "setup":
                    failures.append(
                        f"{where}: a {block.language or 'plain'} block: label it text (output), make it python or "
                        "bash, or put '<!-- not run: why -->' on the line before it"
                    )
                    continue
                start = time.perf_counter()
                output = io.StringIO()
                try:
                    if block.language == "bash":
                        done = subprocess.run(
                            ["bash", "-e", "-c", block.code],
                            check=False,
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=600,
                        )
                        output.write(done.stdout + done.stderr)
                        if done.returncode != 0:
                            raise RuntimeError(f"bash exited with status {done.returncode}")
                    else:
                        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
                            exec(compile(block.code, where, "exec"), namespace)
                except Exception:
                    failures.append(
                        f"{where}: {block.language} block failed\n{output.getvalue()}{traceback.format_exc()}"
                    )
                    continue
                ran += 1
                if verbose:
                    print(f"  {where}: {block.language} ran in {time.perf_counter() - start:.1f} s")
        finally:
            os.chdir(here)
    print(
        f"{path.relative_to(ROOT)}: {ran} ran, {skipped} not run{'' if not failures else f', {len(failures)} FAILED'}"
    )
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("pages", nargs="*", type=Path, help="Markdown files (default: README.md and docs/*.md)")
    parser.add_argument("-v", "--verbose", action="store_true", help="each block, its time, and why one is not run")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # the python blocks import this tree's nanscan, as the bash ones do
    pages = [p.resolve() for p in args.pages] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    failures = [failure for page in pages for failure in check_page(page, args.verbose)]
    for failure in failures:
        print(f"\nFAILED {failure}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
