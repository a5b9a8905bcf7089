"""Command line: ``python -m nanscan demo [options]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m nanscan demo [--scenario train|fp16-overflow|log-zero|eval-fp16|all] [--steps N] "
            "[--fault-step K] [--width W] [--depth D] [--device DEV]"
        )
        return 0 if argv else 2
    if argv[0] != "demo":
        print(f"nanscan: unknown command {argv[0]!r}; the command is 'demo'", file=sys.stderr)
        return 2
    from .demo import main as demo_main

    return demo_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
