"""Release hygiene: one version everywhere it is shown, and a command line that says it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nanscan

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_pyproject() -> None:
    # pyproject.toml's [project] version line (read without tomllib, which Python 3.10 lacks)
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert declared is not None
    assert nanscan.__version__ == declared.group(1)


def test_version_command_names_nanscan_torch_and_the_libraries_loaded() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nanscan", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout.strip()
    assert out.startswith(f"nanscan {nanscan.__version__} (torch {torch.__version__}; libraries: ")
    if nanscan._ops.cuda_library is not None:
        assert f"CUDA {nanscan._ops.cuda_library.cuda_major}" in out
    elif torch.version.cuda is not None:
        assert "CPU only" in out  # a CUDA torch without nanscan's CUDA library: said, not hidden
    else:
        assert out.endswith("libraries: CPU)")


def test_changelog_has_an_unreleased_section_and_the_current_version() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog\n")
    assert "\n## Unreleased\n" in changelog
    assert f"\n## {nanscan.__version__}" in changelog


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib, the exact reading to compare with, is Python 3.11's")
def test_the_scripts_read_every_extra_as_toml_does() -> None:
    """tools/extra.py (which CI and the wheel scripts install the extras from) reads pyproject.toml
    with a pattern, for Python 3.10; an extra it misread would install the wrong packages silently."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras
    for name, requirements in extras.items():
        printed = subprocess.run(
            [sys.executable, str(ROOT / "tools" / "extra.py"), name], capture_output=True, text=True, check=True
        ).stdout
        assert printed.split() == requirements, name
