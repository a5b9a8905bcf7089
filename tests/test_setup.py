"""setup.py's choice of backends: a CUDA build of torch gets the CUDA backend or a loud error, never a
silent CPU-only build (whose first CUDA call would fail far from the cause)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import cuda_toolkit
from cuda_toolkit import ToolkitNotFound, arch_list, find_toolkit


def setup_functions() -> dict[str, Any]:
    """setup.py's imports, constants and functions, without its call to setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.Try, ast.FunctionDef, ast.Assign))]
    namespace: dict[str, Any] = {"__file__": str(ROOT / "setup.py")}
    exec(compile(ast.Module(body=kept, type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace


def fake_nvcc(
    path: Path, release: str, top: Path | None = None, archs: str = "compute_75 compute_80 compute_90"
) -> Path:
    """An executable that answers as nvcc does: ``--version``, ``--dryrun`` (the toolkit's TOP, on
    stderr) and ``--list-gpu-arch``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    top_line = f'echo "#\\$ TOP={top}/bin/.." >&2' if top is not None else "true"
    path.write_text(
        "#!/bin/sh\n"
        'case "$1" in\n'
        f'  --version) echo "Cuda compilation tools, release {release}, V{release}.1";;\n'
        f"  --dryrun) {top_line};;\n"
        f'  --list-gpu-arch) echo "{archs}";;\n'
        "esac\n"
    )
    path.chmod(0o755)
    return path


def toolkit_dir(root: Path, release: str) -> Path:
    """A system-style toolkit: bin/nvcc (which names its own TOP), include, lib64."""
    fake_nvcc(root / "bin" / "nvcc", release, top=root)
    (root / "include").mkdir()
    return root


def nothing_here(tmp_path: Path) -> dict[str, Any]:
    """find_toolkit's arguments for a machine with no toolkit anywhere."""
    return {"environ": {"PATH": str(tmp_path / "empty")}, "site_dirs": [], "default_home": tmp_path / "no-cuda"}


def test_cuda_home_or_cuda_path_first_and_a_wrong_one_is_an_error(tmp_path: Path) -> None:
    where = nothing_here(tmp_path)
    explicit = toolkit_dir(tmp_path / "explicit", "13.0")
    toolkit = find_toolkit("13.0", **where | {"environ": {"CUDA_PATH": str(explicit)}})
    assert toolkit.home == explicit and toolkit.version == (13, 0) and toolkit.found_by == "$CUDA_PATH"
    with pytest.raises(ToolkitNotFound, match=r"\$CUDA_HOME=.* holds no bin/nvcc"):
        find_toolkit("13.0", **where | {"environ": {"CUDA_HOME": str(tmp_path)}})
    old = toolkit_dir(tmp_path / "old", "12.4")
    with pytest.raises(ToolkitNotFound, match=r"is CUDA 12.4, but torch was built with CUDA 13.0.*pip install"):
        find_toolkit("13.0", **where | {"environ": {"CUDA_HOME": str(old)}})


def test_an_nvcc_wrapper_on_path_resolves_to_its_real_toolkit(tmp_path: Path) -> None:
    """A wrapper script in a directory that is no toolkit: nvcc's --dryrun names the real one."""
    real = toolkit_dir(tmp_path / "cuda-13.0", "13.0")
    wrapper = tmp_path / "usr-local" / "bin" / "nvcc"
    wrapper.parent.mkdir(parents=True)
    wrapper.write_text(f'#!/bin/sh\nexec {real}/bin/nvcc "$@"\n')
    wrapper.chmod(0o755)
    where = nothing_here(tmp_path) | {"environ": {"PATH": str(wrapper.parent)}}
    toolkit = find_toolkit("13.0", **where)
    assert toolkit.home == real and toolkit.found_by.startswith("nvcc on PATH")


def test_nvidias_pip_toolkit_of_cuda_13_and_of_cuda_12(tmp_path: Path) -> None:
    """CUDA 13's one directory (CCCL under include/cccl) and CUDA 12's components; their runtime has
    only libcudart.so.N, which the build links through a directory of its own."""
    site = tmp_path / "site-packages"
    cu13 = site / "nvidia" / "cu13"
    fake_nvcc(cu13 / "bin" / "nvcc", "13.0")
    (cu13 / "include" / "cccl").mkdir(parents=True)
    (cu13 / "lib").mkdir()
    (cu13 / "lib" / "libcudart.so.13").write_bytes(b"")
    where = nothing_here(tmp_path) | {"site_dirs": [site]}
    toolkit = find_toolkit("13.0", **where)
    assert toolkit.home == cu13 and toolkit.found_by.startswith("NVIDIA's pip packages")
    assert toolkit.include_dirs == (cu13 / "include" / "cccl",) and toolkit.library_dirs == (cu13 / "lib",)
    assert toolkit.cudart == cu13 / "lib" / "libcudart.so.13"
    nvidia = site / "nvidia"
    fake_nvcc(nvidia / "cuda_nvcc" / "bin" / "nvcc", "12.8")
    for component in ("cuda_runtime/include", "cuda_runtime/lib", "cuda_cccl/include"):
        (nvidia / component).mkdir(parents=True)
    (nvidia / "cuda_runtime" / "lib" / "libcudart.so.12").write_bytes(b"")
    toolkit = find_toolkit("12.8", **where)
    assert toolkit.home == nvidia / "cuda_nvcc" and toolkit.version == (12, 8)
    assert toolkit.include_dirs == (nvidia / "cuda_runtime" / "include", nvidia / "cuda_cccl" / "include")
    assert toolkit.cudart == nvidia / "cuda_runtime" / "lib" / "libcudart.so.12"


def test_the_search_order_skips_toolkits_of_another_cuda_major(tmp_path: Path) -> None:
    """nvcc on PATH before pip before /usr/local/cuda; one of another major is passed over, and named
    if nothing else is found, with the pip command that installs the right one."""
    on_path = toolkit_dir(tmp_path / "cuda-13.0", "13.0")
    site = tmp_path / "site-packages"
    fake_nvcc(site / "nvidia" / "cuda_nvcc" / "bin" / "nvcc", "12.6")
    default = toolkit_dir(tmp_path / "usr-local-cuda", "12.6")
    where = {"environ": {"PATH": str(on_path / "bin")}, "site_dirs": [site], "default_home": default}
    assert find_toolkit("13.0", **where).home == on_path
    assert find_toolkit("12.6", **where).home == site / "nvidia" / "cuda_nvcc"
    assert find_toolkit("12.6", **where | {"site_dirs": []}).home == default
    with pytest.raises(ToolkitNotFound) as error:
        find_toolkit("11.8", **where)
    message = str(error.value)
    assert "no CUDA 11 toolkit was found" in message and f"{on_path} (CUDA 13.0" in message
    assert "Install a CUDA 11 toolkit" in message and "pip packages hold no nvcc" in message
    assert "NANSCAN_CPU_ONLY=1" in message
    with pytest.raises(ToolkitNotFound, match=r'pip install "nvidia-cuda-nvcc==13.2.\*" "nvidia-cuda-cccl==13.2.\*"'):
        find_toolkit("13.2", **nothing_here(tmp_path))
    with pytest.raises(ToolkitNotFound, match=r"tools/cuda12_from_debian.sh DIR"):
        find_toolkit("12.8", **nothing_here(tmp_path))


def test_the_arch_list_is_torchs_from_sm_75_with_ptx_for_the_newest() -> None:
    torch_flags = "sm_50 sm_60 sm_70 sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"
    nvcc_13 = [
        "compute_75",
        "compute_80",
        "compute_86",
        "compute_87",
        "compute_89",
        "compute_90",
        "compute_100",
        "compute_110",
        "compute_120",
    ]
    assert arch_list(torch_flags, nvcc_13) == "7.5;8.0;8.6;9.0;10.0;12.0+PTX"
    assert arch_list(torch_flags, nvcc_13[:6]) == "7.5;8.0;8.6;9.0+PTX"  # an nvcc that stops at sm_90
    with pytest.raises(ToolkitNotFound, match="set TORCH_CUDA_ARCH_LIST"):
        arch_list("sm_50 sm_60", nvcc_13)


@pytest.fixture
def cuda_torch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """setup.py's functions, seeing a torch built with CUDA 13.0 and no toolkit anywhere."""
    setup = setup_functions()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(cuda_toolkit, "DEFAULT_HOME", tmp_path / "no-cuda")
    monkeypatch.setattr(cuda_toolkit.find_toolkit, "__defaults__", (tmp_path / "no-cuda", True))
    setup["site_dirs"] = list
    for name in ("CUDA_HOME", "CUDA_PATH", "NANSCAN_CPU_ONLY"):
        monkeypatch.delenv(name, raising=False)
    return setup


def test_cuda_torch_without_a_toolkit_fails_loudly_with_the_pip_command(cuda_torch: dict[str, Any]) -> None:
    with pytest.raises(SystemExit, match=r"no CUDA 13 toolkit was found.*pip install .*NANSCAN_CPU_ONLY=1"):
        cuda_torch["cuda_toolkits_for_build"]()


def test_opt_out_builds_the_cpu_backend(cuda_torch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANSCAN_CPU_ONLY", "1")
    assert cuda_torch["cuda_toolkits_for_build"]() == ([], "NANSCAN_CPU_ONLY=1")


def test_a_toolkit_found_is_torchs_major(
    cuda_torch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    home = toolkit_dir(tmp_path / "cuda", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(home))
    [toolkit], reason = cuda_torch["cuda_toolkits_for_build"]()
    assert toolkit.home == home and toolkit.found_by == "$CUDA_HOME" and "torch has CUDA 13.0" in reason


def test_a_wheel_builds_every_major_asked_for_without_a_cuda_torch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """NANSCAN_CUDA_MAJORS on a CPU torch: one toolkit per major, each by the search (here CUDA 13 by
    $CUDA_HOME and CUDA 12 by NVIDIA's pip components), a $CUDA_HOME of the other major passed over."""
    setup = setup_functions()
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.setattr(cuda_toolkit.find_toolkit, "__defaults__", (tmp_path / "no-cuda", True))
    home13 = toolkit_dir(tmp_path / "cuda13", "13.0")
    nvidia = tmp_path / "site" / "nvidia"
    fake_nvcc(nvidia / "cuda_nvcc" / "bin" / "nvcc", "12.9")
    setup["site_dirs"] = lambda: [tmp_path / "site"]
    monkeypatch.delenv("NANSCAN_CPU_ONLY", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("CUDA_HOME", str(home13))
    monkeypatch.setenv("NANSCAN_CUDA_MAJORS", "12,13")
    toolkits, reason = setup["cuda_toolkits_for_build"]()
    assert [t.version for t in toolkits] == [(12, 9), (13, 0)], toolkits
    assert toolkits[0].home == nvidia / "cuda_nvcc" and toolkits[1].home == home13
    assert reason == "NANSCAN_CUDA_MAJORS=12,13"
    monkeypatch.setenv("NANSCAN_CUDA_MAJORS", "11")
    with pytest.raises(SystemExit, match=r"no CUDA 11 toolkit was found.*Install a CUDA 11 toolkit"):
        setup["cuda_toolkits_for_build"]()


def test_a_library_without_a_cuda_torch_of_its_major_gets_torchs_architectures_of_that_major(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    setup = setup_functions()
    monkeypatch.setattr(torch.version, "cuda", None)
    nvcc = fake_nvcc(tmp_path / "cuda" / "bin" / "nvcc", "12.6", archs="compute_75 compute_80 compute_86 compute_90")
    toolkit = cuda_toolkit.Toolkit(home=nvcc.parent.parent, version=(12, 6), found_by="test")
    # torch's CUDA 12 list, cut to what this nvcc knows (12.6: no sm_100 or sm_120), PTX for the newest
    assert setup["arch_list_for"](toolkit, None) == "7.5;8.0;8.6;9.0+PTX"
    assert setup["arch_list_for"](toolkit, "8.0") == "8.0"


@pytest.mark.skipif(shutil.which("cc") is None or shutil.which("readelf") is None, reason="needs cc and readelf")
def test_a_cpu_torch_links_cuda_libraries_against_stand_ins_named_as_torchs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A CPU torch has no libtorch_cuda.so: the stand-ins carry its soname and the calls the CUDA
    library makes, so that the library records the name and the real one binds it on a CUDA torch."""
    setup = setup_functions()
    setup["ROOT"] = str(tmp_path)
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "cpu-torch" / "__init__.py"))
    [directory] = setup["torch_cuda_stub_dir"]()
    for name in ("libtorch_cuda.so", "libc10_cuda.so"):
        dynamic = subprocess.run(
            ["readelf", "-d", str(Path(directory, name))], capture_output=True, text=True, check=True
        )
        assert f"Library soname: [{name}]" in dynamic.stdout
    symbols = subprocess.run(
        ["nm", "-D", str(Path(directory, "libtorch_cuda.so"))], capture_output=True, text=True, check=True
    )
    assert set(setup["TORCH_CUDA_CALLS"]) <= {line.split()[-1] for line in symbols.stdout.splitlines()}
    # A torch with its own libtorch_cuda.so needs none.
    (tmp_path / "cuda-torch" / "lib").mkdir(parents=True)
    (tmp_path / "cuda-torch" / "lib" / "libtorch_cuda.so").write_bytes(b"")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "cuda-torch" / "__init__.py"))
    assert setup["torch_cuda_stub_dir"]() == []


def test_pips_runtime_is_linked_through_a_directory_of_its_own(cuda_torch: dict[str, Any], tmp_path: Path) -> None:
    cudart = tmp_path / "lib" / "libcudart.so.13"
    cudart.parent.mkdir()
    cudart.write_bytes(b"")
    cuda_torch["ROOT"] = str(tmp_path)
    toolkit = cuda_toolkit.Toolkit(home=tmp_path, version=(13, 0), found_by="test", cudart=cudart)
    [directory] = cuda_torch["cudart_link_dir"](toolkit)
    assert os.readlink(Path(directory) / "libcudart.so") == str(cudart)
    assert cuda_torch["cudart_link_dir"](cuda_toolkit.Toolkit(home=tmp_path, version=(13, 0), found_by="test")) == []


def test_a_build_environment_without_torch_stops_at_once_and_says_why() -> None:
    """pip's default isolated build has no torch (pyproject.toml does not fetch one: it would be
    another torch than the user's): setup.py stops before anything else, naming the flag to use."""
    blocked = "import runpy, sys; sys.modules['torch'] = None; sys.argv = ['setup.py', '--name']; " + (
        "runpy.run_path('setup.py', run_name='__main__')"
    )
    run = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, cwd=ROOT, check=False)
    assert run.returncode == 1
    assert "no torch in the build environment" in run.stderr and "--no-build-isolation" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_source_distribution_holds_what_the_build_reads(tmp_path: Path) -> None:
    """pip install from an sdist builds from it alone: every file under csrc/ (headers too) and the
    toolkit search setup.py imports (MANIFEST.in)."""
    import tarfile

    # In a copy without build products: an egg-info left by an earlier build lists files of its own.
    tree = tmp_path / "tree"
    ignored = shutil.ignore_patterns(
        ".git", "*.egg-info", "build", "*.so", "__pycache__", "out", "nanscan-demo", "shared"
    )
    shutil.copytree(ROOT, tree, ignore=ignored)
    run = subprocess.run(
        [sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp_path), "--formats", "gztar"],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "NANSCAN_CPU_ONLY": "1"},
        check=False,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [archive] = tmp_path.glob("nanscan-*.tar.gz")
    with tarfile.open(archive) as sdist:
        held = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "csrc").rglob("*") if p.is_file()}
    assert wanted <= held, sorted(wanted - held)
    assert {"tools/cuda_toolkit.py", "setup.py", "pyproject.toml"} <= held


def test_cpu_torch_builds_the_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = setup_functions()
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.delenv("NANSCAN_CUDA_MAJORS", raising=False)
    monkeypatch.delenv("NANSCAN_CPU_ONLY", raising=False)
    toolkits, reason = setup["cuda_toolkits_for_build"]()
    assert toolkits == [] and "has no CUDA support" in reason


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("readelf") is None or shutil.which("nm") is None,
    reason="needs readelf and nm",
)
def test_library_links_the_shared_libstdcxx() -> None:
    """nanscan._C must use the libstdc++ that torch uses, not a private static copy: with two copies,
    formatting a number into an error message crashed the process (an H100 machine's image, where the
    link found only libstdc++.a). setup.py names the shared library; this checks the result."""
    import nanscan._C

    dynamic = subprocess.run(["readelf", "-dW", nanscan._C.__file__], capture_output=True, text=True, check=True)
    needed = [line.split("[")[-1].rstrip("]") for line in dynamic.stdout.splitlines() if "(NEEDED)" in line]
    assert any(name.startswith("libstdc++.so") for name in needed), f"libstdc++ not a dynamic dependency: {needed}"
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", "-C", nanscan._C.__file__], capture_output=True, text=True, check=True
    )
    assert "std::locale::classic()" not in symbols.stdout, "nanscan._C defines libstdc++'s own symbols"
