"""Loads the compiled ops, gives each its fake (shape-only) implementation for torch.compile, and
registers what the stable ABI the library is built on cannot (csrc/torch_api.h): the Autograd
fall-through, and the writing ops' version counters and inference-tensor refusal.

The ops themselves are declared once, in csrc/ops.cpp:

* ``nanscan::scan(Tensor[] tensors, bool fp16_range=False, bool checksum=False) -> (counts, stats,
  total_norm, finite, total_norm_cast)``: counts int64 [2, N] (NaN, Inf; with fp16_range also fp16
  overflow and underflow: [4, N]; with checksum the replica checksums, in [0, 2^32): [3, N]), stats
  float64 [3, N] (min, max, L2 norm), total_norm float64 [], finite bool [], total_norm_cast []: the
  total norm as ``total_norm.to(norm_dtype(...))`` would give it, in the dtype torch's total norm of
  these tensors has, so that no caller reads every tensor's dtype to find it. All outputs live on the
  tensors' device.
* ``nanscan::scan_difference(Tensor[] before, Tensor[] after) -> (counts, stats, total_norm, finite,
  total_norm_cast)``: the scan's outputs for 2N entries, the differences ``before[i] - after[i]``
  (each computed in ``before[i]``'s dtype, float32 or float64, as torch's subtraction rounds it;
  ``after[i]`` of the same shape and no wider dtype), then the ``after[i]``. The update watch's pass
  (nanscan.updates). On the CPU and CUDA one fused kernel that reads each pair once and writes
  nothing; on other devices the composite below (torch's ``_foreach_sub``, then ``scan``).
* ``nanscan::sketch(Tensor[] tensors, int buckets, int seed) -> (sketches, sumsq)``: each tensor's
  CountSketch (csrc/common/sketch_rules.h; buckets a power of two in [64, 4096], seed in [0, 2^32)):
  a float64 vector linear in its values, in ``min(numel, buckets)`` buckets (its values themselves
  when it has no more), whose squared length estimates the tensor's squared norm without bias; all
  the tensors' buckets concatenated in list order (``sketches``, float64 1-D) and each one's sum of
  squares (``sumsq``, float64 [N]). The update watch's copy-free ratio (nanscan.updates): the sketch
  of an update is the difference of the weights' sketches. On the CPU and CUDA a kernel; on other
  devices the composite (float32 on a device without float64: MPS).
* ``nanscan::scan_into_(Tensor[] tensors, bool fp16_range, Tensor(a!) counts, Tensor(b!) stats, int
  column) -> ()``: the scan's per-tensor counts and statistics written into columns ``[column, column +
  N)`` of buffers the caller keeps (counts int64 [2 or, with fp16_range, 4, W], stats float64 [3, W],
  both contiguous), with no totals: a scan that allocates no output. The activation watch's call per
  module (nanscan.activations), whose pass writes one column per output and reads them all at once.
* ``nanscan::scale_(Tensor(a!)[] tensors, Tensor coef) -> ()``: multiplies in place unless coef == 1.
* ``nanscan::unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> (counts, stats, total_norm, finite,
  total_norm_cast)``: GradScaler's unscale (x <- x * inv_scale, torch's arithmetic) fused with the
  scan of the result.
* ``nanscan::record_(Tensor(a!) rows, Tensor(b!) counter, Tensor[] sources, Tensor(c!)? attribution,
  Tensor[] attribution_sources) -> ()``: one nanscan.Recorder append. The sources' values (flattened,
  in order, cast to the rows' dtype as ``copy_`` casts) go into row ``counter % capacity`` of ``rows``
  (float32/float64 [capacity, length]; the sources must hold exactly ``length`` values),
  ``attribution_sources``' into the same row of ``attribution`` (or None, with no sources), and the
  counter (int64, one element) advances by 1. No host sync: on the CPU one kernel, elsewhere (CUDA)
  the composite of ATen ops the recorder ran before (capturable in a CUDA graph).
  ``nanscan::_record_composite_`` is the same op always by its composite implementation, for tests.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

import torch

# The oldest torch whose stable ABI the libraries are built on (csrc/torch_api.h, setup.py's
# TORCH_TARGET_VERSION): an older one lacks C calls they make, and loading them there would fail with
# the dynamic linker's "undefined symbol", which names neither cause nor fix.
OLDEST_TORCH = (2, 10)


def _torch_release(version: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


if _torch_release(torch.__version__) < OLDEST_TORCH:
    raise ImportError(
        f"nanscan needs torch {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} or newer (its compiled library is built on "
        f"PyTorch's stable ABI of {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}); this is torch {torch.__version__}. "
        f'Upgrade torch (pip install "torch>={OLDEST_TORCH[0]}.{OLDEST_TORCH[1]}")'
    )

# Loading the library registers the ops and their CPU kernels; after the version check above.
from . import _C, composite  # noqa: E402
from .dtypes import norm_dtype  # noqa: E402


def cuda_libraries_held() -> list[str]:
    """The CUDA libraries this install holds: ``_C_cuda13`` ... (none for a CPU-only build)."""
    found = {re.match(r"(_C_cuda\d+)\.", p.name) for p in Path(_C.__file__).parent.glob("_C_cuda*.so")}
    return sorted(m.group(1) for m in found if m is not None)


def _load_cuda_library() -> ModuleType | None:
    """The CUDA library of the running torch's CUDA major (importing it registers the CUDA kernels),
    or None: a CPU torch, or an install without that major's library (``_built_without_cuda`` then
    answers for CUDA tensors)."""
    if torch.version.cuda is None:
        return None
    name = f"_C_cuda{torch.version.cuda.split('.')[0]}"
    if name not in cuda_libraries_held():
        return None
    try:
        return importlib.import_module(f"{__package__}.{name}")
    except ImportError as error:
        raise ImportError(
            f"nanscan could not load its CUDA library {name} with torch {torch.__version__} (CUDA "
            f"{torch.version.cuda}): {error}. Reinstall nanscan for this torch (pip install --no-build-isolation "
            "--force-reinstall nanscan, or a wheel built with tools/build_wheel.sh)"
        ) from error


# The loaded CUDA library (its cuda_archs and cuda_major say what it holds), or None.
cuda_library = _load_cuda_library()

scan_op = torch.ops.nanscan.scan.default
scan_into_op = torch.ops.nanscan.scan_into_.default
scan_difference_op = torch.ops.nanscan.scan_difference.default
sketch_op = torch.ops.nanscan.sketch.default
scale_op = torch.ops.nanscan.scale_.default
unscale_scan_op = torch.ops.nanscan.unscale_scan_.default
record_op = torch.ops.nanscan.record_.default
_record_composite_op = torch.ops.nanscan._record_composite_.default


def has_fused_difference(device: torch.device) -> bool:
    """Whether ``scan_difference`` runs a fused kernel on ``device`` (the CPU's, or CUDA's when the
    CUDA library is loaded; a ROCm torch's "cuda" devices run the composite) rather than the
    composite, which allocates the differences."""
    return device.type == "cpu" or (device.type == "cuda" and cuda_library is not None and torch.version.hip is None)


# Kept for the life of the process: dropping a Library object removes its registrations.
_LIBRARY = torch.library.Library("nanscan", "IMPL")

# nanscan's ops are not differentiable: their outputs are counts, extrema and norms for diagnosis,
# and their writes are the multiplies of clipping and unscaling, which torch runs under no_grad too.
# The Autograd key falls through to the kernels, so outputs never require grad (autograd's fallback
# would otherwise hang on them a grad_fn that fails only when someone calls backward through a norm);
# the kernels run their own ATen calls with grad mode off (csrc/torch_api.h, NoGradGuard).
for _name in (
    "scan",
    "scan_into_",
    "scan_difference",
    "sketch",
    "scale_",
    "unscale_scan_",
    "record_",
    "_record_composite_",
):
    _LIBRARY.impl(_name, torch.library.fallthrough_kernel, "Autograd")

_INFERENCE_MESSAGE = (
    "Inplace update to inference tensor outside InferenceMode is not allowed."
    "You can make a clone to get a normal tensor before doing inplace update."
    "See https://github.com/pytorch/rfcs/pull/17 for more details."
)
_BELOW_INPLACE_OR_VIEW = torch._C._after_ADInplaceOrView_keyset
_is_inference = torch.Tensor.is_inference
_increment_version = torch._C._increment_version


def _refuse_inference(tensors: Iterable[torch.Tensor]) -> None:
    """torch's refusal, with its message, of an in-place write to an inference tensor outside
    inference mode, before anything is written (an ADInplaceOrView kernel runs only outside it)."""
    if any(map(_is_inference, tensors)):
        raise RuntimeError(_INFERENCE_MESSAGE)


def _writes_on_cpu(factor: torch.Tensor) -> bool:
    """Whether a CPU kernel writes for this factor: it writes nothing when the factor is exactly 1.
    Read on the host only for a plain CPU factor; on another device the kernel decides without a
    sync, and a traced one (a fake or functional tensor under torch.compile) has no value to read:
    such calls count as a write."""
    return factor.device.type != "cpu" or type(factor) is not torch.Tensor or bool(factor.item() != 1.0)


# What ADInplaceOrView does for torch's own in-place ops, for the writes the kernels make themselves
# (not through ATen, whose in-place ops bump their tensors' versions already): the version counters
# advance, so autograd sees that a saved tensor changed, and an inference tensor is refused first.
def _scale_inplace_or_view(keyset: Any, tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    _refuse_inference(tensors)
    scale_op.redispatch(keyset & _BELOW_INPLACE_OR_VIEW, tensors, coef)
    if coef.device.type != "cpu":  # the CPU kernel multiplies through ATen's _foreach_mul_
        _increment_version(tensors)


def _scan_into_inplace_or_view(
    keyset: Any, tensors: list[torch.Tensor], fp16_range: bool, counts: torch.Tensor, stats: torch.Tensor, column: int
) -> None:
    _refuse_inference((counts, stats))
    scan_into_op.redispatch(keyset & _BELOW_INPLACE_OR_VIEW, tensors, fp16_range, counts, stats, column)
    _increment_version((counts, stats))  # the kernels write them directly (the composite's copies bump them too)


def _unscale_scan_inplace_or_view(keyset: Any, tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> Any:
    _refuse_inference(tensors)
    outputs = unscale_scan_op.redispatch(keyset & _BELOW_INPLACE_OR_VIEW, tensors, inv_scale)
    if _writes_on_cpu(inv_scale):
        _increment_version(tensors)
    return outputs


def _record_at_inplace_or_view(op: Any, direct_cpu_kernel: bool) -> Callable[..., None]:
    """The ADInplaceOrView kernel of a record op: ``direct_cpu_kernel``, whether its CPU kernel writes
    the rows and the counter itself (record_), or, as the composite does everywhere, through ATen's
    in-place ops (_record_composite_), which bump the versions already."""

    def kernel(
        keyset: Any,
        rows: torch.Tensor,
        counter: torch.Tensor,
        sources: list[torch.Tensor],
        attribution: torch.Tensor | None,
        attribution_sources: list[torch.Tensor],
    ) -> None:
        written = [rows, counter] if attribution is None else [rows, counter, attribution]
        _refuse_inference(written)
        op.redispatch(keyset & _BELOW_INPLACE_OR_VIEW, rows, counter, sources, attribution, attribution_sources)
        if direct_cpu_kernel and rows.device.type == "cpu":
            _increment_version(written)

    return kernel


# The ADInplaceOrView kernels above are Python: the dispatcher's trip through one converts the whole
# list from C++ to Python and back (the redispatch), ~60 ns a tensor of a 10,000-tensor call on the
# CPU, a sixth of the op's cost (NOTES.md entry 49). Eager calls that can take no refusal skip the
# trip: below the key, with the kernel's version bumps made here. Not the CPU's scale: its kernel
# writes through ATen's _foreach_mul_, which the guard would hide from the key too, and whether it
# wrote (a factor other than 1) could then be known only by reading the factor on the host, which
# the scale's callers never do (a fused optimizer's step decides on the device).
_below_inplace_or_view = torch._C._AutoDispatchBelowADInplaceOrView


def _direct(tensors: list[torch.Tensor]) -> bool:
    """Whether an in-place op's eager call may skip its ADInplaceOrView kernel: outside torch.compile
    (which traces the op as it is) and inference mode (where the key is the tensors' own concern),
    with no inference tensor to refuse. There the kernel's work is the version bumps alone."""
    return not (torch.compiler.is_compiling() or torch.is_inference_mode_enabled() or any(map(_is_inference, tensors)))


def scale_(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    """``scale_op(tensors, coef)``: multiplies each tensor by ``coef`` in place (nothing written for a
    coefficient of exactly 1), the versions of what was written bumped as torch's in-place ops do.
    A coefficient of 1 still calls the op: its checks (a gradient it could not write) do not depend
    on the value (tests/test_bad_input.py, clip-expanded-nothing-to-clip)."""
    if coef.device.type == "cpu" or not _direct(tensors):
        scale_op(tensors, coef)
        return
    with _below_inplace_or_view():
        scale_op(tensors, coef)
    _increment_version(tensors)  # off the CPU the kernel decides on the device: every call is a write


def scan_into_(
    tensors: list[torch.Tensor], fp16_range: bool, counts: torch.Tensor, stats: torch.Tensor, column: int
) -> None:
    """``scan_into_op(tensors, fp16_range, counts, stats, column)``: the scan's results into columns
    ``[column, column + len(tensors))`` of ``counts`` and ``stats``, their versions bumped."""
    buffers = [counts, stats]
    if not _direct(buffers):
        scan_into_op(tensors, fp16_range, counts, stats, column)
        return
    with _below_inplace_or_view():
        scan_into_op(tensors, fp16_range, counts, stats, column)
    _increment_version(buffers)


def unscale_scan_(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> ScanOutputs:
    """``unscale_scan_op(tensors, inv_scale)``: the fused unscale and scan, the versions bumped as
    ``scale_``'s."""
    if not _direct(tensors):
        return cast(ScanOutputs, unscale_scan_op(tensors, inv_scale))
    with _below_inplace_or_view():
        outputs = unscale_scan_op(tensors, inv_scale)
    if _writes_on_cpu(inv_scale):
        _increment_version(tensors)
    return cast(ScanOutputs, outputs)


_LIBRARY.impl("scale_", _scale_inplace_or_view, "ADInplaceOrView", with_keyset=True)
_LIBRARY.impl("unscale_scan_", _unscale_scan_inplace_or_view, "ADInplaceOrView", with_keyset=True)
_LIBRARY.impl("scan_into_", _scan_into_inplace_or_view, "ADInplaceOrView", with_keyset=True)
_LIBRARY.impl("record_", _record_at_inplace_or_view(record_op, True), "ADInplaceOrView", with_keyset=True)
_LIBRARY.impl(
    "_record_composite_", _record_at_inplace_or_view(_record_composite_op, False), "ADInplaceOrView", with_keyset=True
)


# The ops in ATen ops (nanscan.composite; record_'s composite is C++, in csrc/ops.cpp), by op name.
COMPOSITES: dict[str, Callable[..., Any]] = {
    "scan": composite.scan,
    "scan_into_": composite.scan_into_,
    "scan_difference": composite.scan_difference,
    "sketch": composite.sketch,
    "scale_": composite.scale_,
    "unscale_scan_": composite.unscale_scan_,
}

# Every device without a kernel of its own (not the CPU, not CUDA: MPS, XPU, an out-of-tree backend)
# runs the composites.
for _name, _composite in COMPOSITES.items():
    _LIBRARY.impl(_name, _composite, "CompositeExplicitAutograd")


def _built_without_cuda(*args: Any) -> Any:
    held = ", ".join(cuda_libraries_held()) or "none (a CPU-only build)"
    cuda = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU build"
    raise RuntimeError(
        f"nanscan: this install holds no CUDA library for torch {torch.__version__} ({cuda}), "
        f"so it cannot read CUDA tensors; it holds: {held}. Reinstall it with the CUDA backend: a wheel built "
        "with tools/build_wheel.sh, or pip install --no-build-isolation -e . against this CUDA torch with a CUDA "
        "toolkit (CUDA_HOME; setup.py prints which libraries it builds, and why)"
    )


def register_cuda_key(library: torch.library.Library, hip: str | None) -> None:
    """What answers for "cuda" tensors when no CUDA library of nanscan's is loaded. On a ROCm torch
    (``hip``: its HIP version), whose AMD GPUs are "cuda" devices, the composites: nanscan has no HIP
    kernel (docs/dev/devices.md says what one would need), and the composite's answers are the
    kernels'. Otherwise (a CPU-only build, NANSCAN_CPU_ONLY=1, a wheel without this CUDA major) a
    stand-in that says why it cannot read them and how to install the library: otherwise the first
    CUDA call fails with the dispatcher's "Could not run 'nanscan::scan' with arguments from the
    'CUDA' backend", which names neither cause nor fix; and a GPU run on the composite would be
    several times slower without saying so."""
    for name, implementation in COMPOSITES.items():
        if hip is not None:
            library.impl(name, implementation, "CUDA")
        elif name != "scan_difference":  # its composite calls scan, whose stand-in answers
            library.impl(name, _built_without_cuda, "CUDA")


if cuda_library is None:
    register_cuda_key(_LIBRARY, torch.version.hip)


_Fake = TypeVar("_Fake", bound=Callable[..., Any])

ScanOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def register_fake(op: str) -> Callable[[_Fake], _Fake]:
    """``torch.library.register_fake``, typed: torch leaves it unannotated, which would make every
    fake kernel below untyped in the eyes of a type checker."""
    return cast(Callable[[_Fake], _Fake], torch.library.register_fake(op))


@register_fake("nanscan::scan")
def _scan_fake(tensors: list[torch.Tensor], fp16_range: bool = False, checksum: bool = False) -> ScanOutputs:
    torch._check(not (fp16_range and checksum), lambda: "nanscan.scan: fp16_range and checksum are separate scans")
    return _scan_outputs(tensors, 4 if fp16_range else 3 if checksum else 2)


@register_fake("nanscan::scan_into_")
def _scan_into_fake(
    tensors: list[torch.Tensor], fp16_range: bool, counts: torch.Tensor, stats: torch.Tensor, column: int
) -> None:
    composite.check_scan_into_buffers(tensors, fp16_range, counts, stats, column)


@register_fake("nanscan::scan_difference")
def _scan_difference_fake(before: list[torch.Tensor], after: list[torch.Tensor]) -> ScanOutputs:
    composite.check_difference_pairs(before, after)
    return _scan_outputs(list(before) + list(after))


@register_fake("nanscan::sketch")
def _sketch_fake(tensors: list[torch.Tensor], buckets: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sketch's fake kernel: the kernels' checks of what a fake has (devices, dtypes, buckets, seed),
    and the outputs' shapes: min(numel, buckets) buckets per tensor (numel may be symbolic), one sum
    of squares per tensor; in the composite's dtype on a device without float64."""
    composite.check_sketch_arguments(tensors, buckets, seed)
    device = tensors[0].device
    wide = composite.wide_dtype(device)
    total = sum(torch.sym_min(t.numel(), buckets) for t in tensors)
    return (
        torch.empty((total,), dtype=wide, device=device),
        torch.empty((len(tensors),), dtype=wide, device=device),
    )


@register_fake("nanscan::unscale_scan_")
def _unscale_scan_fake(tensors: list[torch.Tensor], inv_scale: torch.Tensor) -> ScanOutputs:
    return _scan_outputs(tensors)


def _scan_outputs(tensors: list[torch.Tensor], count_rows: int = 2) -> ScanOutputs:
    torch._check(len(tensors) > 0, lambda: "nanscan.scan: expected at least one tensor")
    n = len(tensors)
    device = tensors[0].device
    for i, t in enumerate(tensors):  # the real kernels refuse mixed devices; so must the fake one
        torch._check(
            t.device == device,
            lambda i=i, t=t: f"nanscan.scan: tensors[{i}] is on {t.device} but tensors[0] is on {device}",
        )
    return (
        torch.empty((count_rows, n), dtype=torch.int64, device=device),
        torch.empty((3, n), dtype=torch.float64, device=device),
        torch.empty((), dtype=torch.float64, device=device),
        torch.empty((), dtype=torch.bool, device=device),
        torch.empty((), dtype=norm_dtype(t.dtype for t in tensors), device=device),
    )


@register_fake("nanscan::scale_")
def _scale_fake(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    return None


# The dtypes record_'s sources may have (csrc/ops.cpp; not float16/bfloat16: see csrc/cpu/record_cpu.cpp).
RECORD_SOURCE_DTYPES = frozenset(
    (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float32, torch.float64)
)


_RECORD = "nanscan.record_"


@register_fake("nanscan::record_")
@register_fake("nanscan::_record_composite_")  # the same op, by its composite: the same fake
def _record_fake(
    rows: torch.Tensor,
    counter: torch.Tensor,
    sources: list[torch.Tensor],
    attribution: torch.Tensor | None,
    attribution_sources: list[torch.Tensor],
) -> None:
    """record_'s fake kernel: it writes in place and returns nothing, so all it does is check what
    the kernels check of the arguments and a fake can (no values): the torch dispatcher sends a call
    with one meta tensor among CPU ones here, not to the kernels."""
    torch._check(
        counter.dtype == torch.int64 and counter.numel() == 1,
        lambda: (
            f"{_RECORD}: counter must be a one-element int64 tensor, got {counter.dtype} of shape {list(counter.shape)}"
        ),
    )
    torch._check(
        counter.device == rows.device,
        lambda: f"{_RECORD}: counter is on {counter.device} but rows are on {rows.device}",
    )
    _check_record_block("rows", rows, "sources", sources, rows)
    if attribution is not None:
        _check_record_block("attribution", attribution, "attribution_sources", attribution_sources, rows)
    else:
        torch._check(
            not attribution_sources,
            lambda: f"{_RECORD}: attribution_sources given but attribution is None: there is no row to write them to",
        )


def _check_record_block(
    target_name: str, target: torch.Tensor, sources_name: str, sources: list[torch.Tensor], rows: torch.Tensor
) -> None:
    """One block of record_: ``target`` ([capacity, length] rows) and the sources that fill one row."""
    torch._check(target.dim() == 2, lambda: f"{_RECORD}: {target_name} must be 2-D [capacity, row length]")
    torch._check(
        target.dtype in (torch.float32, torch.float64),
        lambda: f"{_RECORD}: {target_name} has dtype {target.dtype}; supported: float32, float64",
    )
    torch._check(
        target.device == rows.device,
        lambda: f"{_RECORD}: {target_name} is on {target.device} but rows are on {rows.device}",
    )
    torch._check(target.shape[0] == rows.shape[0], lambda: f"{_RECORD}: {target_name} and rows differ in rows")
    for i, t in enumerate(sources):
        torch._check(
            t.device == rows.device,
            lambda i=i, t=t: f"{_RECORD}: {sources_name}[{i}] is on {t.device} but rows are on {rows.device}",
        )
        torch._check(
            t.dtype in RECORD_SOURCE_DTYPES, lambda i=i, t=t: f"{_RECORD}: {sources_name}[{i}] has dtype {t.dtype}"
        )
    total = sum(t.numel() for t in sources)
    torch._check(
        total == target.shape[1],
        lambda: f"{_RECORD}: {sources_name} hold {total} values but a row of {target_name} holds {target.shape[1]}",
    )
