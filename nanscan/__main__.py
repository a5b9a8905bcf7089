"""Command line: ``python -m nanscan demo [options]``, ``python -m nanscan plot RUN.jsonl [options]`` and
``python -m nanscan --version``."""

from __future__ import annotations

import sys

USAGE = """\
usage: python -m nanscan demo [--scenario train|fp16-overflow|log-zero|eval-fp16|all] [--steps N]
                              [--fault-step K] [--width W] [--depth D] [--device DEV] [--out DIR]
       python -m nanscan plot RUN.jsonl [-o OUT.png|.svg|.pdf] [--title T]
       python -m nanscan --version
(python -m nanscan demo --help, python -m nanscan plot --help: what each option does)"""


def version_line() -> str:
    """nanscan's version, the torch it runs in, and which of its libraries that torch loaded: what a
    bug report needs (a CUDA torch with no CUDA library loaded runs nanscan's CUDA calls nowhere)."""
    import torch

    from . import __version__, _ops

    cuda = _ops.cuda_library
    if cuda is not None:
        toolkit = f"{cuda.cuda_version // 1000}.{cuda.cuda_version % 1000 // 10}"  # CUDART_VERSION: 12040 is 12.4
        library = f"CPU and CUDA {toolkit} (kernels for {cuda.cuda_archs})"
    elif torch.version.cuda is not None:
        held = ", ".join(_ops.cuda_libraries_held()) or "none"
        library = f"CPU only (this torch is CUDA {torch.version.cuda}; CUDA libraries held: {held})"
    else:
        library = "CPU"
    return f"nanscan {__version__} (torch {torch.__version__}; libraries: {library})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if argv else sys.stderr)  # asked for: the output; missing: an error
        return 0 if argv else 2
    if argv[0] == "--version":
        print(version_line())
        return 0
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
