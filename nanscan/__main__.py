"""Command line: ``python -m nanscan demo [options]`` and ``python -m nanscan plot RUN.jsonl [options]``."""

from __future__ import annotations

import sys

USAGE = """\
usage: python -m nanscan demo [--scenario train|fp16-overflow|log-zero|eval-fp16|all] [--steps N] [--fault-step K] [--width W] [--depth D] [--device DEV]
       python -m nanscan plot RUN.jsonl [-o OUT.png] [--title T]"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    # A command's module is imported when that command runs: neither pays for the other's imports.
    if argv[0] == "demo":
        from .demo import main as demo_main

        return demo_main(argv[1:])
    if argv[0] == "plot":
        from .plot import main as plot_main

        return plot_main(argv[1:])
    print(f"nanscan: unknown command {argv[0]!r}; the commands are 'demo' and 'plot'", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
