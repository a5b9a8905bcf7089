"""Shared test helpers: the fp64 reference every backend is checked against, and device parametrisation."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, settings

ROOT = Path(__file__).resolve().parent.parent

# The processes the tests start (the ranks of the distributed tests, the launchers, the examples, the
# GPU session's scripts) import the nanscan these tests import. From a checkout built in place and
# not installed (the GPU machine's copy, with its libraries carried in), a fresh interpreter would
# not find it, and each such test would fail with "No module named 'nanscan'".
_SPEC = importlib.util.find_spec("nanscan")
if _SPEC is not None and _SPEC.origin is not None and Path(_SPEC.origin).resolve().parent.parent == ROOT:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

HAS_CUDA = torch.cuda.is_available()
NEEDS_CUDA_REASON = "needs a CUDA device"
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason=NEEDS_CUDA_REASON)


@contextmanager
def syncs_refused() -> Iterator[None]:
    """A block in which any host sync with the GPU raises (``torch.cuda.set_sync_debug_mode("error")``),
    the mode put back after: how the CUDA tests prove a path makes none."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


# CPU always; CUDA where present (the same tests run on both, like torchvision's cpu_and_cuda()).
DEVICES = [pytest.param("cpu"), pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda])]

FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FP8_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]


def reference_stats(t: torch.Tensor) -> dict[str, float]:
    """The statistics of one tensor computed independently, in fp64, with plain torch ops."""
    x = t.detach().to("cpu").float().double() if t.dtype in FP8_DTYPES else t.detach().to("cpu").double()
    x = x.reshape(-1)
    nan = int(torch.isnan(x).sum())
    inf = int(torch.isinf(x).sum())
    finite = x[torch.isfinite(x)]
    sumsq = float((finite * finite).sum()) if finite.numel() else 0.0
    return {
        "nan_count": nan,
        "inf_count": inf,
        "min": float(finite.min()) if finite.numel() else math.inf,
        "max": float(finite.max()) if finite.numel() else -math.inf,
        "norm": math.nan if nan else math.inf if inf else math.sqrt(sumsq),
        "sumsq": math.nan if nan else math.inf if inf else sumsq,
    }


def plant(t: torch.Tensor, positions: list[int], value: float) -> torch.Tensor:
    """Writes ``value`` at flat ``positions`` of a contiguous tensor (in place), returns it."""
    flat = t.view(-1)
    for p in positions:
        flat[p] = value
    return t


def random_tensor(n: int, dtype: torch.dtype, device: str = "cpu", scale: float = 1.0) -> torch.Tensor:
    """Fresh random values (never zeros), representable in ``dtype``."""
    x = torch.randn(n, dtype=torch.float64, device=device) * scale
    if dtype in FP8_DTYPES:
        x = x.clamp(-400, 400)
    return x.to(dtype)


def assert_matches_reference(result, tensors: list[torch.Tensor], rtol: float = 1e-6) -> None:
    """Checks every per-tensor statistic and the totals of a ScanResult against reference_stats."""
    refs = [reference_stats(t) for t in tensors]
    got = {k: getattr(result, k).cpu().tolist() for k in ("nan_count", "inf_count", "min", "max", "norm")}
    for i, ref in enumerate(refs):
        assert got["nan_count"][i] == ref["nan_count"], f"tensor {i}: nan_count"
        assert got["inf_count"][i] == ref["inf_count"], f"tensor {i}: inf_count"
        assert got["min"][i] == ref["min"], f"tensor {i}: min {got['min'][i]} != {ref['min']}"
        assert got["max"][i] == ref["max"], f"tensor {i}: max {got['max'][i]} != {ref['max']}"
        assert_close_float(got["norm"][i], ref["norm"], rtol, f"tensor {i}: norm")
    total_sumsq = sum(r["sumsq"] for r in refs)
    assert_close_float(
        float(result.total_norm), math.sqrt(total_sumsq) if total_sumsq == total_sumsq else math.nan, rtol, "total_norm"
    )
    assert bool(result.finite) == all(r["nan_count"] == 0 and r["inf_count"] == 0 for r in refs)


def assert_close_float(got: float, want: float, rtol: float, what: str) -> None:
    if math.isnan(want):
        assert math.isnan(got), f"{what}: {got} is not NaN"
    elif math.isinf(want):
        assert got == want, f"{what}: {got} != {want}"
    else:
        assert abs(got - want) <= rtol * abs(want) + 1e-300, f"{what}: {got} != {want} (rtol {rtol})"


def build_cpp(tmp_path: Path, sources: list[Path], flags: list[str]) -> Path:
    """Compiles C++ ``sources`` (a .cu among them is compiled as C++) with the system compiler into a
    program in ``tmp_path``; fails the test on a compile error. Returns the program's path."""
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    binary = tmp_path / "program"
    command = [compiler, *flags, "-o", str(binary)]
    for source in sources:
        command += ["-x", "c++", str(source)]
    build = subprocess.run(command, capture_output=True, text=True, check=False)  # its stderr is the message
    assert build.returncode == 0, build.stderr[-6000:]
    return binary


def build_and_run_cpp(tmp_path: Path, sources: list[Path], flags: list[str], timeout: float, hang_hint: str) -> str:
    """Compiles C++ ``sources`` (``build_cpp``) and runs the program; fails the test on a compile
    error, a non-zero exit or a timeout (``hang_hint`` says what a hang would mean). Returns the
    program's stdout."""
    binary = build_cpp(tmp_path, sources, flags)
    try:
        run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{binary.name} did not finish in {timeout:g} s: {hang_hint}")
    assert run.returncode == 0, run.stderr[-6000:]
    return run.stdout


def rank_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a process started as one of several ranks on this machine: ``environ`` (the
    test process's own by default) with one intra-op thread each, as torchrun sets it for several
    processes a node. Left at torch's default, each rank starts a thread per core: 4 ranks on 2 cores
    ran 8 threads spinning against each other, and the 4-rank distributed cases took 80 s, not 53."""
    env = dict(os.environ if environ is None else environ)
    env["OMP_NUM_THREADS"] = "1"
    return env


# ---- Hypothesis profiles (used by tests/test_properties.py) ---------------------------------------
# "ci" is the default: a few hundred derandomized examples in all, so every run checks the same
# inputs and the file stays well under a minute. "long" searches far more, with fresh randomness:
#     python -m pytest -q tests/test_properties.py --hypothesis-profile=long
# The hypothesis pytest plugin loads the flag's profile after this file is imported, so the flag
# overrides "ci".
settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")


# Settings both framework callbacks must refuse when they are made (nanscan.integrations._logging),
# with the message each raises.
CALLBACK_BAD_SETTINGS = [
    ({"on_nonfinite": "skipp"}, "on_nonfinite must be one of"),
    ({"max_norm": -1.0}, "max_norm must be a non-negative number"),
    ({"norm_type": "two"}, "norm_type must be a real number"),
    ({"max_consecutive_skips": -1}, "max_consecutive_skips must be >= 0"),
    ({"log_every_n_steps": 0}, "log_every_n_steps must be >= 1"),
]


@pytest.fixture(autouse=True)
def rank_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts in a process that has not been a rank: nanscan.sinks keeps the rank
    torch.distributed gave last (a test's world of one, or a patched rank, would leak into the next)."""
    import nanscan.sinks

    monkeypatch.setattr(nanscan.sinks, "_noted", [])


@pytest.fixture
def world_of_one() -> Iterator[None]:
    """A gloo process group of one rank, in this process, for DTensor gradients (FSDP2 on a mesh of
    one), whose checks carry a rank attribution as a distributed run's do."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", store=dist.FileStore(str(Path(tmp) / "store"), 1), rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


# CI runs the README's test command in a venv with only what the README installs, so tests of the
# optional integrations skip there; they run where those packages are installed, and what skipped in
# every venv runs once more in one that has them all (.ci/run). With NANSCAN_RECORD_SKIPPED=FILE, every
# skipped test's node id (or, for a module skipped whole at import, its path) is appended to FILE,
# but for those that skipped for want of a GPU (needs_cuda): no other venv on the machine has one.
_SKIPPED_FILE = os.environ.get("NANSCAN_RECORD_SKIPPED")


def _record_skipped(nodeid: str) -> None:
    if _SKIPPED_FILE:
        with open(_SKIPPED_FILE, "a") as out:
            out.write(nodeid + "\n")


def _skipped_for_want_of_a_gpu(report: pytest.TestReport) -> bool:
    # A skip's longrepr is (path, line, "Skipped: <reason>").
    return isinstance(report.longrepr, tuple) and report.longrepr[2] == f"Skipped: {NEEDS_CUDA_REASON}"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and report.when in ("setup", "call") and not _skipped_for_want_of_a_gpu(report):
        _record_skipped(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped and report.nodeid:
        _record_skipped(report.nodeid)


@contextmanager
def composite_on_cpu() -> Iterator[None]:
    """The ops' composites (nanscan.composite; record_'s in C++) registered over their CPU kernels for
    the block, so that nanscan's whole stack runs, on the CPU, the path that MPS, XPU and every device
    without a kernel takes. The dispatcher restores the kernels when the registrations go."""
    from nanscan import composite

    library = torch.library.Library("nanscan", "IMPL")
    record_composite = torch.ops.nanscan._record_composite_.default
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "overriding a previously registered kernel"
        library.impl("scan", composite.scan, "CPU")
        library.impl("scan_difference", composite.scan_difference, "CPU")
        library.impl("scale_", composite.scale_, "CPU")
        library.impl("unscale_scan_", composite.unscale_scan_, "CPU")
        library.impl("record_", record_composite, "CPU")
    try:
        yield
    finally:
        library._destroy()


class OpaqueTensor(torch.Tensor):
    """A wrapper subclass that keeps its values elsewhere (as quantized or lazy tensors do): no hook or
    kernel can read it (tests of what the activation watch and locate do with what they cannot read)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> OpaqueTensor:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[attr-defined]

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: object, types: object, args: object = (), kwargs: object = None) -> object:
        raise NotImplementedError(f"OpaqueTensor: {func}")
