"""Runs every script in examples/ as its `# Run:` line says, with a small `--steps`, and says PASS,
FAIL or SKIPPED with the wall time of each.

    python tools/run_examples.py                  # all of them (about a minute on 2 cores)
    python tools/run_examples.py --only fsdp2     # one of them (repeatable; with or without .py)
    python tools/run_examples.py --skip-missing   # SKIPPED, not FAIL, where a `# Requires:` package is missing

Each example's header holds one `# Run: <command>` line (`python ...` or `torchrun ...`) and, when it
needs optional packages, a `# Requires: pkg, pkg` line. The command is run as written, `python`
replaced by this interpreter and `torchrun` by `<this interpreter> -m torch.distributed.run`, plus
`--steps N`, in a fresh temporary directory (whatever an example writes lands there), with the
repository root on PYTHONPATH and a timeout. Exits 1 if any example fails, showing its output.

One failure is run again, up to twice: torch's gloo aborting a rank after the script has finished (a child
of torchrun killed by SIGABRT with "terminate called without an active exception": a gloo worker
thread that frees a tensor while the interpreter finalizes, pytorch/pytorch#190489). A script cannot
avoid it: after a DDP or FSDP2 model is freed and collected and ``destroy_process_group()`` has
returned, gloo's worker threads still run (torch 2.13, with or without nanscan), so the group ends
only with the interpreter. It struck the FSDP2 example in two CI runs (2026-11-27 and 11-28), each
time after every step had passed, and in none of 137 runs here (about 100 of them beside busy loops
on both cores). DeepSpeed's ZeRO example, whose last collective is torch's own all_gather, met it in 2 of
12 runs here on 2026-11-28, so a single rerun would still fail about one CI run in 36. Each aborted
run's output is shown and the first run that is not aborted so decides.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
HEADER_LINES = 40  # the `# Run:` and `# Requires:` lines sit at the top of a script
SHOWN_LINES = 200  # of a failing example's output
# What torchrun prints of a child that torch's gloo aborted at exit (module notes).
EXIT_ABORT = "terminate called without an active exception"
# The runs again of an example that met that abort alone, by name (module notes).
EXIT_ABORT_RERUNS = ("second", "third")


@dataclass
class Example:
    path: Path
    run: str | None  # the `# Run:` command, None when the script has none
    requires: list[str]

    @property
    def name(self) -> str:
        return self.path.stem


def read_example(path: Path) -> Example:
    header = path.read_text().splitlines()[:HEADER_LINES]
    runs = [m.group(1).strip() for line in header if (m := re.fullmatch(r"# Run: (.+)", line))]
    requires = [
        pkg.strip()
        for line in header
        if (m := re.fullmatch(r"# Requires: (.+)", line))
        for pkg in m.group(1).split(",")
    ]
    return Example(path, runs[0] if len(runs) == 1 else None, [p for p in requires if p])


def command_of(example: Example, steps: int) -> list[str]:
    """The `# Run:` command as argv for this interpreter, with paths in the repository made absolute
    (the command runs in a temporary directory)."""
    assert example.run is not None
    words = shlex.split(example.run)
    if words[0] == "python":
        argv = [sys.executable]
    elif words[0] == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run"]
    else:
        raise ValueError(f"the # Run: line must start with python or torchrun, not {words[0]!r}")
    argv += [str(ROOT / w) if not w.startswith("-") and (ROOT / w).is_file() else w for w in words[1:]]
    return [*argv, "--steps", str(steps)]


def missing_packages(example: Example) -> list[str]:
    missing = [pkg for pkg in example.requires if importlib.util.find_spec(pkg) is None]
    if example.run is not None and example.run.startswith("torchrun"):
        import torch.distributed

        if not torch.distributed.is_available():
            missing.append("torch.distributed")
    return missing


def run(argv: list[str], timeout: float) -> tuple[int | None, str]:
    """Exit status (None on timeout) and the combined output; a command that outlives ``timeout``
    is ended with every process under it."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("MPLBACKEND", "Agg")
    with tempfile.TemporaryDirectory(prefix="nanscan-example-") as cwd:
        process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            output, _ = process.communicate(timeout=timeout)
            return process.returncode, output
        except subprocess.TimeoutExpired:
            stop(process)
            try:
                output, _ = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:  # a process we could not end still holds the pipe
                output = "(output lost: the example's processes did not end)"
            return None, output


def aborted_at_exit(status: int | None, output: str) -> bool:
    """Whether a failed torchrun run has the mark of torch's gloo exit abort (module notes): the
    message, and every failed child ended by SIGABRT (exitcode -6) or by torchrun's SIGTERM to the
    others (-15) after it, at least one of them by SIGABRT."""
    if status in (None, 0) or EXIT_ABORT not in output:
        return False
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]
    return -6 in codes and all(c in (-6, -15) for c in codes)


def show(command: list[str], output: str) -> None:
    lines = output.splitlines()
    print(f"    $ {shlex.join(command)}")
    if len(lines) > SHOWN_LINES:
        print(f"    ... ({len(lines) - SHOWN_LINES} lines before)")
    print("\n".join(f"    | {line}" for line in lines[-SHOWN_LINES:]))


def descendants(pid: int) -> set[int]:
    """The processes below ``pid`` (Linux's /proc; empty elsewhere): torchrun's workers run in
    sessions of their own, out of reach of a signal to torchrun's process group."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # ended meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def stop(process: subprocess.Popen[str]) -> None:
    """Ends a timed-out example: SIGTERM first (torchrun then stops its workers), SIGKILL to what is
    left after a grace period. Only the example's own processes, by id."""
    pids = descendants(process.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in (process.pid, *pids):
            with contextlib.suppress(ProcessLookupError):  # already ended
                os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        pids = {p for p in pids if Path(f"/proc/{p}").exists()}
        if process.poll() is not None and not pids:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="run this example only (repeatable)"
    )
    parser.add_argument("--steps", type=int, default=4, help="--steps passed to each example (default 4)")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per example (default 180)")
    parser.add_argument(
        "--skip-missing", action="store_true", help="skip, not fail, examples whose packages are missing"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the output of passing examples too")
    args = parser.parse_args(argv)

    examples = [read_example(p) for p in sorted(EXAMPLES.glob("*.py"))]
    if args.only:
        wanted = {name.removesuffix(".py") for name in args.only}
        unknown = wanted - {e.name for e in examples}
        if unknown:
            parser.error(
                f"no such example: {', '.join(sorted(unknown))} (examples: {', '.join(e.name for e in examples)})"
            )
        examples = [e for e in examples if e.name in wanted]
    if not examples:
        print(f"no examples found in {EXAMPLES}", file=sys.stderr)
        return 1

    results: list[tuple[str, str, float]] = []
    started = time.perf_counter()
    for example in examples:
        print(f"{example.name:<20} ", end="", flush=True)
        if example.run is None:
            print("FAIL  (its header needs exactly one '# Run: <command>' line)")
            results.append((example.name, "FAIL", 0.0))
            continue
        missing = missing_packages(example)
        if missing:
            verdict = "SKIPPED" if args.skip_missing else "FAIL"
            hint = "" if args.skip_missing else "; install it, or pass --skip-missing"
            print(f"{verdict}  (needs {', '.join(missing)}, not installed{hint})")
            results.append((example.name, verdict, 0.0))
            continue
        command = command_of(example, args.steps)
        t0 = time.perf_counter()
        status, output = run(command, args.timeout)
        again = ""
        for ordinal in EXIT_ABORT_RERUNS:
            if not aborted_at_exit(status, output):
                break
            print("aborted at exit by torch's gloo (pytorch/pytorch#190489); its output, then once more:")
            show(command, output)
            print(f"{example.name:<20} ", end="", flush=True)
            status, output = run(command, args.timeout)
            again = f"  (the {ordinal} run)"
        seconds = time.perf_counter() - t0
        passed = status == 0
        if passed:
            print(f"PASS  {seconds:6.1f} s{again}")
        else:
            why = f"timed out after {args.timeout:.0f} s" if status is None else f"exit status {status}"
            print(f"FAIL  {seconds:6.1f} s  ({why}){again}")
        if not passed or args.verbose:
            show(command, output)
        results.append((example.name, "PASS" if passed else "FAIL", seconds))

    counts = {v: sum(r[1] == v for r in results) for v in ("PASS", "FAIL", "SKIPPED")}
    print(
        f"\n{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIPPED']} skipped "
        f"in {time.perf_counter() - started:.1f} s (--steps {args.steps})"
    )
    if counts["FAIL"]:
        print("failed: " + ", ".join(name for name, verdict, _ in results if verdict == "FAIL"))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
