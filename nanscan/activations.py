"""``watch_activations(model)``: each module's fp16 headroom, watched every step without a host sync.

    watch = nanscan.watch_activations(model, every=4)   # a scan on every 4th forward of the model
    for batch in loader:
        with torch.autocast("cuda", torch.float16):
            loss = model(batch).loss
        ...
    print(watch.table())        # one sync: per module, the largest |activation| and fp16's headroom
    watch.remove()              # or use it as a context manager

Under fp16 the values that outgrow fp16's 65504 are mostly forward activations (attention scores,
MLP outputs, the sums in a normalisation), not gradients. This watch gives, per module, the evidence
of how close each comes: the largest finite ``|value|`` of its outputs (``amax``), how many values
exceed 65504 (``overflow``), how many non-zero values fp16 would flush to zero (``underflow``: below
its smallest subnormal, 2^-24), and the NaN and Inf counts. The headroom is 65504 over the amax: below
1 the module overflows fp16, below 2 it is within a factor of two.

How it works. A forward hook on every module scans the module's floating-point outputs (nested
tuples, lists and dicts too) in one call of nanscan's fused op (``fp16_range``), which leaves its
statistics on the device. A DTensor output is scanned by its local tensor (what this rank holds; see
docs/diagnosis.md for what the reduced figures of a sharded, replicated or Partial output mean); an
output no hook can read is counted in ``ModuleActivations.unread`` and warned about, never skipped
in silence. A tensor already scanned in the same forward pass and unchanged since (the
same object, the same version counter: a container returning its last child's output) is not scanned
again; one changed in place (``ReLU(inplace=True)`` on a Linear's output) is, as the new values it
holds. Under ``torch.inference_mode()`` tensors have no version counter, so every module's outputs
are scanned (a container's output a second time).

Batched scans. An op call per module call is what a host-bound GPU step pays for (~40 us of host time
each on an H200), so the outputs are kept and scanned together: one op call per device at the end of
the forward, or whenever the kept outputs reach ``batch_bytes`` (256 MiB by default). A late scan
must still read what the module returned, so a module's first sampled call is scanned as it returns
and its outputs are kept to the end of the pass: if their version counters show a change in place by
then (``ReLU(inplace=True)`` on a Linear's output, ResNet's ``out += identity`` on a BatchNorm's), the
module is scanned as it returns from then on; otherwise its later calls are batched. A batched output
found changed at the end (a module whose first calls were left alone) is not read as the module's:
it is counted in ``unread``, with a warning, and the module is scanned at return from then on.
Inference tensors, tensor subclasses and views of a parameter (whose storage FSDP frees after the
forward) are always scanned at return; ``batch_bytes=0`` scans every call at return and keeps
nothing.

The per-call statistics wait on the device until the model's forward returns; then a few indexed
reductions fold the whole pass into per-module accumulators (an int64 [modules, 4] table of counts, a
float64 [modules] amax, and the first call, in execution order, whose outputs held a NaN/Inf, and an
int64 [modules, 3] table of calls, fp16 calls and elements scanned), so a step costs one scan a
forward (and one a call of each module whose outputs are changed in place) and a few launches,
whatever the number of modules. Each read of the figures
(``table()``, ``str()``, ``figures()``, ``first_nonfinite``, the Advisor) copies the accumulators to
the host: one sync per device; under torch.distributed also three small all-reduces, which every
rank of the group must make (``process_group``).

Sampling: ``every=N`` scans on every N-th forward of the model (the first included), and nothing in
between: the submodules' hooks are attached for a sampled forward only, so the others pay only the
model's own three hooks. A compiled model retraces once for each state (hooked, unhooked) and then
reuses both graphs. Only calls inside the model's
own forward are scanned: a submodule called on its own, or re-run by activation checkpointing during
backward, is not counted twice.

CUDA graphs: a sampled forward captured in a graph (``torch.cuda.graph``) scans at every replay, and
every figure, the calls, elements and sampled passes included, is kept on the device, so each replay
counts as the forward it repeats. (``torch.cuda.make_graphed_callables`` refuses a module with hooks,
and the watch's hooks added after it see only the graphed module's own output.) What a replay does not run is Python:
``forwards`` and ``sampled`` count the passes the hooks saw, the sampling decision is the captured
pass's, and a non-finite call's number is the one it had in that pass. The watch's accumulators must
exist before the capture: run one sampled forward first (the warm-up torch's graph API asks for
anyway); a watch whose first scan is captured refuses it.

torch.compile: the hooks run eagerly, as a graph break at each module's forward hook (while Dynamo
traces, a hook calls its ``torch.compiler.disable`` twin): their Python bookkeeping (the step
counter, the sampling decision) would otherwise be guarded on and recompile the graph every step.
The figures are the same; a compiled model with the watch attached runs as several graphs, one per
module, so attach it for diagnosis and sample with ``every``.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, NamedTuple, TypeVar, cast

import torch
from torch.utils.hooks import RemovableHandle

from ._ops import scan_into_
from .fused import capturing, describe_unread, floating_tensors, scannable, upload
from .names import clean_module_names

FP16_MAX = 65504.0

_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _eager(fn: _Fn) -> _Fn:
    """``torch.compiler.disable``, typed (torch leaves it unannotated): the hooks run eagerly under
    compile. Applied when a watch is made, never at import: its first call imports Dynamo (~1 s on
    this project's CPU), which ``import nanscan`` should not cost a script that never watches."""
    return cast(_Fn, torch.compiler.disable(fn))


# The columns of a device's pass buffers, one per scanned output: folded into the accumulators when
# they are full (a submodule called many times in one forward, a generation loop), so that a pass of
# any length holds 229 KB of them.
_PASS_COLUMNS = 4096

# How a module's outputs are scanned (ActivationWatch._modes, one per module slot). A module's first
# sampled call is scanned as it returns, and its outputs are kept until the pass ends: if nothing
# changed them in place by then (their version counters say), its later calls are batched: their
# outputs are kept, unscanned, and scanned together with the others' in one op call at the end of the
# pass (or once the kept outputs reach ``batch_bytes``). If something did (``ReLU(inplace=True)`` on a
# Linear's output, ResNet's ``out += identity`` on a BatchNorm's), its calls are scanned as they return
# from then on, so that the values read are the ones the module returned.
_FIRST_CALL, _BATCHED, _AT_RETURN = 0, 1, 2

# The outputs kept for one batched scan, per watch, by default: the most a watch adds to the memory a
# forward holds, where autograd would not keep them anyway (no_grad evaluation).
DEFAULT_BATCH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class ModuleActivations:
    """One module's figures over the sampled forward passes so far.

    Attributes:
        name: the module's qualified name as the user wrote it (``""`` for the model itself).
        op: its class name.
        calls: sampled calls whose outputs held a floating tensor.
        fp16_calls: of which calls with an fp16 output (autocast or a half model): the values fp16 held,
            rather than values that fp16 would have to hold.
        elements: values scanned over those calls.
        nan, inf: non-finite values among them.
        amax: the largest finite ``|value|`` (0 when none).
        overflow: finite values above fp16's 65504.
        underflow: non-zero finite values below fp16's smallest subnormal (2^-24): zeros in fp16.
        ranks: in a distributed watch, the ranks whose outputs of this module overflowed fp16 or held
            NaN/Inf (empty in a single process, and when the ranks are too many to list per module:
            more than 2^20 modules x ranks).
        unread: floating output tensors of the sampled calls the watch could not read (a tensor
            subclass other than DTensor that keeps its values elsewhere, a sparse, nested or meta
            tensor; an output kept for the batched scan and changed in place before it, see the
            module's docstring): nothing above covers them, so a module with ``unread`` is not known to be healthy
            (``complete`` is False). Counted by the hooks, on every rank.
    """

    name: str
    op: str
    calls: int
    fp16_calls: int
    elements: int
    nan: int
    inf: int
    amax: float
    overflow: int
    underflow: int
    ranks: tuple[int, ...] = ()
    unread: int = 0

    @property
    def complete(self) -> bool:
        """Whether every floating output of the sampled calls was read (``unread`` is 0)."""
        return self.unread == 0

    @property
    def headroom(self) -> float:
        """How many times larger the values could grow before fp16 overflows, 65504 over the amax
        (below 1, they already do). 0 for a module whose outputs held a NaN or an Inf (nothing left:
        fp16's range was already exceeded, here or upstream); infinite when its outputs were all zero."""
        if not self.finite:
            return 0.0
        return FP16_MAX / self.amax if self.amax > 0 else math.inf

    @property
    def finite(self) -> bool:
        return self.nan == 0 and self.inf == 0


_NONE = torch.iinfo(torch.int64).max  # no non-finite call yet


class _DeviceTotals:
    """The accumulators on one device: counts int64 [modules, 4] (NaN, Inf, overflow, underflow),
    amax float64 [modules], the first non-finite call (``first``: its call number times the module
    count plus its module's slot, or _NONE), tallies int64 [modules, 3] (calls, fp16 calls, elements)
    and the sampled passes folded (``passes``). All on the device, so that a CUDA graph's replays
    count as the passes they repeat.

    A module call's scan writes its outputs' results into the next columns of the pass buffers
    (``scan_into_``: nothing allocated per call), and the host notes each column's code and each
    call's tally row; ``fold`` adds them all into the accumulators at the end of the pass."""

    def __init__(self, modules: int, device: torch.device) -> None:
        self.modules = modules
        self.counts = torch.zeros((modules, 4), dtype=torch.int64, device=device)
        self.amax = torch.zeros(modules, dtype=torch.float64, device=device)
        self.first = torch.full((), _NONE, dtype=torch.int64, device=device)
        self.tallies = torch.zeros((modules, 3), dtype=torch.int64, device=device)
        self.passes = torch.zeros((), dtype=torch.int64, device=device)
        # The same figures of the passes since a recorder last took them (ActivationWatch._take_recent):
        # counts [4, modules] (a recorder's row takes the first three rows as they lie), amax [modules].
        self.recent_counts = torch.zeros((4, modules), dtype=torch.int64, device=device)
        self.recent_amax = torch.zeros(modules, dtype=torch.float64, device=device)
        # The pass so far: its outputs' counts and statistics in columns [0, used) of the buffers, each
        # column's code (its call number times the module count plus its module's slot), and each
        # call's tally row (slot, calls, fp16 calls, elements).
        self.pass_counts = torch.empty((4, _PASS_COLUMNS), dtype=torch.int64, device=device)
        self.pass_stats = torch.empty((3, _PASS_COLUMNS), dtype=torch.float64, device=device)
        self.used = 0
        self.codes: list[int] = []
        self.rows: list[int] = []

    def add(self, tensors: list[torch.Tensor], codes: list[int], rows: list[int]) -> None:
        """Scans ``tensors`` on this device into the pass buffers' next columns, in one op call where
        they fit: ``codes`` one a tensor, ``rows`` the calls' tally rows (four ints a call)."""
        start = 0
        while True:
            free = _PASS_COLUMNS - self.used
            if free == 0:  # the buffers are full (a long pass, a generation loop): folded first
                self.fold()
                free = _PASS_COLUMNS
            piece = tensors if start == 0 and len(tensors) <= free else tensors[start : start + free]
            # The hook runs under the model's grad mode and autocast: the op is not differentiable and
            # takes its inputs as they are.
            scan_into_(piece, True, self.pass_counts, self.pass_stats, self.used)
            self.used += len(piece)
            self.codes.extend(codes[start : start + len(piece)])
            if start == 0:
                self.rows.extend(rows)
            start += len(piece)
            if start >= len(tensors):
                return

    def fold(self) -> None:
        """Adds the pass's columns into the accumulators: a handful of launches for the whole pass."""
        used = self.used
        if not used:
            return
        # The columns' codes, then the calls' tally rows: one upload.
        uploaded = upload(self.codes + self.rows, torch.int64, self.counts.device)
        self.used, self.codes, self.rows = 0, [], []
        code_of, tally = uploaded[:used], uploaded[used:].view(-1, 4)
        counts, stats = self.pass_counts[:, :used], self.pass_stats[:, :used]
        self.tallies.index_add_(0, tally[:, 0], tally[:, 1:])
        index = code_of.remainder(self.modules)
        self.counts.index_add_(0, index, counts.t())
        self.recent_counts.index_add_(1, index, counts)
        # min/max are of the finite values (+inf/-inf when a tensor has none): |largest| without NaN.
        amax = torch.maximum(-stats[0], stats[1]).clamp_(min=0.0)
        self.amax.scatter_reduce_(0, index, amax, reduce="amax")
        self.recent_amax.scatter_reduce_(0, index, amax, reduce="amax")
        nonfinite = (counts[0] + counts[1]) > 0
        code = torch.where(nonfinite, code_of, _NONE).amin()
        torch.minimum(self.first, code, out=self.first)


class _ModuleCall(NamedTuple):
    """A sampled module call's outputs: scanned at its return (``scanned``: a module's first call,
    then kept to see whether anything changes them in place before the pass ends, or a module scanned
    at return), or kept unscanned for the batched scan."""

    slot: int
    number: int  # its call number among the scanned calls, in execution order
    tally: tuple[int, int, int]  # (calls, fp16 calls, elements)
    tensors: list[torch.Tensor]
    versions: list[int]  # each tensor's version counter at the call's return
    scanned: bool


def _holdable(t: torch.Tensor, version: int) -> bool:
    """Whether ``t`` (at ``version``, -1 for an inference tensor) may be kept for a later scan: a
    plain tensor with a version counter (so that a change in place is seen), not a view of a
    parameter or of a tensor subclass (FSDP frees an unsharded parameter's storage after the forward
    without a version bump; a view of a plain buffer freed so is caught by ``_changed_since``). By
    exact types: ``isinstance`` of a Parameter runs Python (its metaclass's ``__instancecheck__``), a
    cost in every module call."""
    if version < 0 or type(t) is not torch.Tensor:
        return False
    base = t._base
    return base is None or type(base) is torch.Tensor


def _changed_since(call: _ModuleCall) -> bool:
    """Whether a kept call's outputs no longer hold what its module returned: changed in place (their
    version counters moved; a view shares its base's), or a view whose storage was freed (resized to
    nothing, as FSDP frees the buffers its unsharded parameters view, with no version bump)."""
    for t, version in zip(call.tensors, call.versions, strict=True):
        if t._version != version or (t._base is not None and t.untyped_storage().nbytes() == 0):
            return True
    return False


class _Host(NamedTuple):
    """The accumulators read to the host (and, distributed, reduced), per module in module order."""

    counts: list[list[int]]  # [NaN, Inf, overflow, underflow]
    amax: list[float]
    first: int  # the first non-finite call's code (call number * modules + slot), or _NONE
    calls: list[int]
    fp16_calls: list[int]
    elements: list[int]
    ranks: list[tuple[int, ...]]
    passes: int  # sampled passes folded (the most of any device, and of any rank)
    unread: list[int]  # floating outputs the hooks could not read


class _Read(NamedTuple):
    """One read of the figures: every module's, the first non-finite call's module slot and call
    number (None when every output was finite), and the sampled passes they cover (replays of a
    captured pass included)."""

    figures: list[ModuleActivations]
    first_slot: int | None
    first_call: int | None
    passes: int

    def worst(self) -> list[ModuleActivations]:
        """The modules scanned, worst first: the first to go non-finite, the other non-finite ones,
        then by headroom, smallest first."""
        observed = [(i, f) for i, f in enumerate(self.figures) if f.calls > 0 or f.unread > 0]
        ordered = sorted(observed, key=lambda item: (item[0] != self.first_slot, item[1].finite, item[1].headroom))
        return [f for _, f in ordered]


class ActivationWatch:
    """Hooks on every module of a model that scan each module's outputs; see the module docstring.

    Made by :func:`watch_activations`. A context manager: leaving the block removes the hooks (the
    figures stay readable)."""

    def __init__(
        self,
        model: torch.nn.Module,
        every: int = 1,
        process_group: Any = None,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
    ) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"nanscan.watch_activations: expected a torch.nn.Module, got {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"nanscan.watch_activations: every must be a positive int (1: every forward), got {every!r}"
            )
        if isinstance(batch_bytes, bool) or not isinstance(batch_bytes, int) or batch_bytes < 0:
            raise ValueError(
                "nanscan.watch_activations: batch_bytes must be an int >= 0 (0: each module call's outputs "
                f"scanned as it returns), got {batch_bytes!r}"
            )
        self.model = model
        self.every = every
        self.batch_bytes = batch_bytes
        # Each rank watches its own activations; the figures read are every rank's, reduced over this
        # group (the default group when torch.distributed is initialized): never one rank's alone.
        self.process_group = process_group
        named = list(model.named_modules())
        clean = clean_module_names(model)
        self.names = [clean.get(name, name) if clean is not None else name for name, _ in named]
        self.ops = [type(module).__name__ for _, module in named]
        self._devices: dict[torch.device, _DeviceTotals] = {}
        self._forwards = 0  # forwards of the model begun
        self._sampled = 0  # of which sampled
        self._depth = 0  # nesting of the model's own forward (a model that calls itself)
        self._call_number = 0  # module calls scanned so far, in execution order
        self._sampling = False
        self._recent = 0  # sampled passes folded since a recorder last took their figures
        # Sampled passes captured in a CUDA graph (their kernels ran at the replays, not then). Once
        # one is, replays fold figures no hook sees, so a recorder takes the recent figures at every
        # record (zeros when no replay ran since).
        self._captured = 0
        self._eager_passes = 0  # sampled passes folded outside a capture: the rest of `passes` are replays
        # Per module, the floating outputs the hooks could not read (ModuleActivations.unread): host
        # counts, since the decision is the hook's; and what they were, for the first warning.
        self._unread = [0] * len(self.names)
        self._warned_unread = False
        self._warned_changed = False
        # How each module's outputs are scanned (_FIRST_CALL, _BATCHED, _AT_RETURN), and the calls kept
        # for the batched scan with their bytes.
        self._modes = [_FIRST_CALL] * len(self.names)
        self._held: list[_ModuleCall] = []
        self._held_bytes = 0
        # Tensors scanned in this forward: id -> (weak reference, version when scanned).
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self._handles: list[RemovableHandle] = []
        self._handles.append(model.register_forward_pre_hook(_eager(self._begin)))
        # The model's own scan hook (slot 0: named_modules() yields the model first) stays; then the
        # end of the pass, registered after it so that it runs after it; always_call: a forward that
        # raises still closes the pass (else the next one would count as nested and never be scanned).
        self._handles.append(model.register_forward_hook(self._hook(0)))
        self._handles.append(model.register_forward_hook(_eager(self._end), always_call=True))
        # The submodules' scan hooks. With every > 1 they are on only during a sampled forward: a hooked
        # module call takes torch's slower call path and the hook's own call (~2.5 us a call against
        # ~0.8 unhooked on this project's CPU, measured with the hook inside torch.compiler.disable),
        # paid by every module of every forward when the hooks stay; attaching them costs ~1 us a
        # module once per sampled forward (benchmarks/NOTES.md, entry 35).
        self._module_hooks = [(module, self._hook(slot)) for slot, (_, module) in enumerate(named) if slot > 0]
        self._module_handles: list[RemovableHandle] = []
        if every == 1:
            self._attach_module_hooks()

    # ----------------------------------------------------------------------------------- hooks

    def _begin(self, module: torch.nn.Module, args: tuple[Any, ...]) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        self._sampling = self._forwards % self.every == 0
        self._forwards += 1
        if self._sampling:
            self._sampled += 1
            self._attach_module_hooks()
        self._seen.clear()

    def _end(self, module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        if self._sampling:
            self._settle()
            for totals in self._devices.values():
                totals.fold()
                totals.passes.add_(1)
            if any(capturing(d) for d in self._devices):
                self._captured += 1
            elif self._devices:
                self._eager_passes += 1
            self._recent += 1
        else:
            # A pass whose sampling stopped midway (a first scan refused inside a CUDA graph capture):
            # what it kept is not the next pass's.
            self._held, self._held_bytes = [], 0
        if self.every > 1:
            self._detach_module_hooks()
        self._sampling = False
        self._seen.clear()

    def _attach_module_hooks(self) -> None:
        if not self._module_handles:
            self._module_handles = [module.register_forward_hook(hook) for module, hook in self._module_hooks]

    def _detach_module_hooks(self) -> None:
        while self._module_handles:
            self._module_handles.pop().remove()

    def _hook(self, slot: int) -> Any:
        def scan(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if self._sampling:
                self._scan(slot, output)

        traced = _eager(scan)

        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> None:
            # Under compile, Dynamo meets the disabled twin and leaves it to run eagerly (a graph
            # break); in eager mode the twin is skipped, since inside torch.compiler.disable every
            # Python frame goes through Dynamo's frame callback: the scan op's call took 13.0 us there
            # against 6.4 outside, in a tight loop on this project's CPU (benchmarks/NOTES.md entry 51).
            (traced if torch.compiler.is_compiling() else scan)(module, args, output)

        return hook

    def _scan(self, slot: int, output: Any) -> None:
        if type(output) is torch.Tensor and scannable(output):
            # The usual output, one plain tensor, without the walk through containers.
            version = self._fresh_version(output)
            if version is None:
                return
            fresh, versions = [output], [version]
        else:
            found: list[torch.Tensor] = []
            unread: list[torch.Tensor] = []
            floating_tensors(output, found, unread)  # a DTensor's local tensor: this rank's own values
            if unread:
                self._note_unread(slot, unread)
            fresh, versions = [], []
            for t in found:
                version = self._fresh_version(t)
                if version is not None:
                    fresh.append(t)
                    versions.append(version)
            if not fresh:
                return
        number = self._call_number
        self._call_number += 1
        if len(fresh) == 1:
            t = fresh[0]
            tally = (1, int(t.dtype == torch.float16), t.numel())
            nbytes = tally[2] * t.element_size()
        else:
            tally = (1, int(any(t.dtype == torch.float16 for t in fresh)), sum(t.numel() for t in fresh))
            nbytes = sum(t.numel() * t.element_size() for t in fresh)
        mode = self._modes[slot]
        call = _ModuleCall(slot, number, tally, fresh, versions, mode != _BATCHED)
        if (
            mode != _AT_RETURN
            and self.batch_bytes
            and all(_holdable(t, v) for t, v in zip(fresh, versions, strict=True))
        ):
            if call.scanned:  # a first call: scanned now, kept to see whether anything changes it
                self._scan_calls([call])
            self._hold(call, nbytes)
        else:
            self._scan_calls([call])

    def _scan_calls(self, calls: list[_ModuleCall]) -> None:
        """Scans the calls' outputs into the pass buffers of their devices: one op call a device. Each
        call's tally goes with its first device's results, so that a call is counted once."""
        m = len(self.names)
        if len(calls) == 1 and len(calls[0].tensors) == 1:  # a call scanned at its return, the usual one
            call = calls[0]
            self._totals(call.tensors[0].device).add(
                call.tensors, [call.number * m + call.slot], [call.slot, *call.tally]
            )
            return
        # Per device: its tensors, their codes, their calls' tally rows.
        batches: dict[torch.device, tuple[list[torch.Tensor], list[int], list[int]]] = {}
        # The batch of the device met last (usually the only one): a dict lookup an output saved.
        last_device: torch.device | None = None
        batch: tuple[list[torch.Tensor], list[int], list[int]] = ([], [], [])
        for call in calls:
            code = call.number * m + call.slot
            row: tuple[int, ...] = (call.slot, *call.tally)
            for t in call.tensors:
                device = t.device
                if device != last_device:
                    if device not in batches:
                        batches[device] = ([], [], [])
                    batch = batches[device]
                    last_device = device
                batch[0].append(t)
                batch[1].append(code)
                if row:
                    batch[2].extend(row)
                    row = ()
        for device, (tensors, codes, rows) in batches.items():
            self._totals(device).add(tensors, codes, rows)

    def _hold(self, call: _ModuleCall, nbytes: int) -> None:
        """Keeps a call's outputs (``nbytes`` of them) for the batched scan, or, for a module's first
        call, for the check of their versions; scans what is kept once it reaches batch_bytes."""
        self._held.append(call)
        self._held_bytes += nbytes
        if self._held_bytes >= self.batch_bytes:
            self._settle()

    def _settle(self) -> None:
        """Scans the kept outputs that are unchanged since their module returned, in one op call per
        device, and learns from the kept first calls which modules' outputs something changes in place.
        A kept output changed in place (a module whose first call was left alone, changed in a later
        one) is not scanned: its values are no longer the module's; counted in ``unread``, warned about
        once, and that module's calls are scanned as they return from then on."""
        if not self._held:
            return
        held, self._held, self._held_bytes = self._held, [], 0
        unscanned: list[_ModuleCall] = []
        for call in held:
            changed = _changed_since(call)
            if changed:
                self._modes[call.slot] = _AT_RETURN
            elif self._modes[call.slot] == _FIRST_CALL:
                self._modes[call.slot] = _BATCHED
            if call.scanned:
                continue
            if changed:
                self._note_changed(call)
            else:
                unscanned.append(call)
        if unscanned:
            self._scan_calls(unscanned)

    def _note_changed(self, call: _ModuleCall) -> None:
        """Counts a kept call whose outputs were changed in place (or freed) before the batched scan
        read them."""
        self._unread[call.slot] += len(call.tensors)
        if not self._warned_changed:
            self._warned_changed = True
            warnings.warn(
                f"nanscan.watch_activations: the outputs of `{self.names[call.slot] or '(model)'}` "
                f"({self.ops[call.slot]}) were changed in place (or their storage freed) after the module "
                "returned, before the watch's batched scan read them (its earlier calls' outputs were left "
                "alone); that call is not scanned "
                "(counted in ModuleActivations.unread), and this module's outputs are scanned as each call "
                "returns from now on (batch_bytes=0 does so for every module)",
                stacklevel=2,
            )

    def _fresh_version(self, t: torch.Tensor) -> int | None:
        """None when ``t`` was scanned in this pass and is unchanged since (a module whose output is
        the next one's input is scanned once); else its version counter, to be scanned (-1 for an
        inference tensor, which has none: scanned each time, as a change in place cannot be told)."""
        if t.is_inference():
            return -1
        version = t._version
        seen = self._seen.get(id(t))
        if seen is not None and seen[1] == version and seen[0]() is t:
            return None  # scanned in this pass and unchanged since: one scan per value
        self._seen[id(t)] = (weakref.ref(t), version)
        return version

    def _totals(self, device: torch.device) -> _DeviceTotals:
        totals = self._devices.get(device)
        if totals is None:
            totals = self._devices[device] = self._new_totals(device)
        return totals

    def _note_unread(self, slot: int, unread: list[torch.Tensor]) -> None:
        """Counts the outputs the hook could not read, and says so once per watch: never a silent zero."""
        self._unread[slot] += len(unread)
        if not self._warned_unread:
            self._warned_unread = True
            kinds = sorted({describe_unread(t) for t in unread})
            warnings.warn(
                f"nanscan.watch_activations: the outputs of `{self.names[slot] or '(model)'}` "
                f"({self.ops[slot]}) include {', '.join(kinds)} values the watch cannot read; they are not "
                "scanned, and ModuleActivations.unread counts them (the table's `unread` column)",
                stacklevel=2,
            )

    def _new_totals(self, device: torch.device) -> _DeviceTotals:
        """The accumulators of a device's first scanned call. Made in a CUDA graph capture, their
        zeroing would be captured too and undo every replay's figures: refused."""
        if capturing(device):
            self._sampling = False  # the rest of the captured pass scans nothing
            raise RuntimeError(
                f"nanscan.watch_activations: the watch's first scan on {device} is being captured in a CUDA "
                "graph, and its accumulators cannot be made inside one; run one sampled forward of the model "
                "before the capture (the warm-up torch.cuda.graph asks for)"
            )
        # Normal tensors even when the first scanned forward runs under torch.inference_mode: inference
        # tensors would refuse every later pass's writes outside it.
        with torch.inference_mode(False):
            return _DeviceTotals(len(self.names), device)

    # ----------------------------------------------------------------------------------- results

    @property
    def forwards(self) -> int:
        """Forward passes of the model since the watch was attached, as its hooks saw them; a CUDA
        graph's replays are not among them (the figures count them, and ``table()`` says how many)."""
        return self._forwards

    @property
    def sampled(self) -> int:
        """Of which scanned (every ``every``-th, the first included)."""
        return self._sampled

    def _read(self) -> _Read:
        """The figures of every device, merged on the host: one copy per device (counts below 2^53 and
        codes are exact in float64). In a distributed watch, every rank's, reduced (collectives:
        every rank must read)."""
        m = len(self.names)
        counts = [[0, 0, 0, 0] for _ in range(m)]
        amax = [0.0] * m
        tallies = [[0, 0, 0] for _ in range(m)]
        first, passes = _NONE, 0
        self._settle()  # read within a forward (a hook of the user's): what it kept so far too
        for totals in self._devices.values():
            totals.fold()
            code = torch.where(totals.first == _NONE, -1, totals.first)
            packed = torch.cat(
                [
                    totals.counts.flatten().double(),
                    totals.amax,
                    totals.tallies.flatten().double(),
                    totals.passes.double().view(1),
                    code.double().view(1),
                ]
            ).tolist()
            for i in range(m):
                counts[i] = [a + int(b) for a, b in zip(counts[i], packed[4 * i : 4 * i + 4], strict=True)]
                amax[i] = max(amax[i], packed[4 * m + i])
                tallies[i] = [
                    a + int(b) for a, b in zip(tallies[i], packed[5 * m + 3 * i : 5 * m + 3 * i + 3], strict=True)
                ]
            passes = max(passes, int(packed[-2]))
            if packed[-1] >= 0:
                first = min(first, int(packed[-1]))
        host = _Host(
            counts,
            amax,
            first,
            calls=[t[0] for t in tallies],
            fp16_calls=[t[1] for t in tallies],
            elements=[t[2] for t in tallies],
            ranks=[()] * m,
            passes=passes,
            unread=list(self._unread),
        )
        group = self._group()
        if group is not None:
            host = self._reduce(group, host)
        figures = [
            ModuleActivations(name, op, n, fp16, e, c[0], c[1], a, c[2], c[3], ranks, unread)
            for name, op, n, fp16, e, c, a, ranks, unread in zip(
                self.names,
                self.ops,
                host.calls,
                host.fp16_calls,
                host.elements,
                host.counts,
                host.amax,
                host.ranks,
                host.unread,
                strict=True,
            )
        ]
        if host.first == _NONE:
            return _Read(figures, None, None, host.passes)
        call, slot = divmod(host.first, m)
        return _Read(figures, slot, call, host.passes)

    def _take_recent(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The figures of the sampled passes since the last take, for a recorder's row on ``device``:
        (amax float64 [modules], counts int64 [4, modules]: NaN, Inf, overflow, underflow), every
        device's combined and, under torch.distributed, every rank's (two all-reduces: only when a
        pass was sampled, so every rank must run as many forwards, as DDP and FSDP do); None when no
        pass was sampled and none was captured in a CUDA graph (whose replays no hook sees: taken at
        every record then). The recent figures start again from zero; the watch's own do not. No sync."""
        if self._recent == 0 and not self._captured:
            return None
        self._recent = 0
        amax = torch.zeros(len(self.names), dtype=torch.float64, device=device)
        counts = torch.zeros((4, len(self.names)), dtype=torch.int64, device=device)
        for totals in self._devices.values():
            # Asynchronous between GPUs; to the CPU a plain copy, which the CPU's record then reads.
            non_blocking = device.type != "cpu"
            torch.maximum(amax, totals.recent_amax.to(device, non_blocking=non_blocking), out=amax)
            counts += totals.recent_counts.to(device, non_blocking=non_blocking)
            totals.recent_amax.zero_()
            totals.recent_counts.zero_()
        group = self._group()
        if group is not None:
            import torch.distributed as dist

            from .layouts.collectives import all_reduce
            from .layouts.reduce import group_device

            on_group = group_device(group)
            reduced_amax, reduced_counts = amax.to(on_group), counts.to(on_group)
            all_reduce(reduced_amax, dist.ReduceOp.MAX, group)
            all_reduce(reduced_counts, dist.ReduceOp.SUM, group)
            amax, counts = reduced_amax.to(device), reduced_counts.to(device)
        return amax, counts

    def _group(self) -> Any:
        """The group the figures are reduced over, or None in a single process."""
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            if self.process_group is not None:
                raise ValueError(
                    "nanscan.watch_activations: process_group given, but torch.distributed is not initialized"
                )
            return None
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group if dist.get_world_size(group) > 1 else None

    def _reduce(self, group: Any, host: _Host) -> _Host:
        """Every rank's figures: counts, calls and elements summed, amax the largest, the first
        non-finite call the earliest; per module, the ranks that overflowed or went non-finite.
        Three collectives (one to check that every rank watches the same modules)."""
        import torch.distributed as dist

        from .layouts.collectives import all_reduce
        from .layouts.reduce import group_device

        m, rank, world = len(self.names), dist.get_rank(group), dist.get_world_size(group)
        device = group_device(group)
        shape = torch.tensor([m, -m], dtype=torch.float64, device=device)
        all_reduce(shape, dist.ReduceOp.MAX, group)
        if int(shape[0]) != m or int(-shape[1]) != m:
            raise ValueError(
                f"nanscan.watch_activations: the ranks watch different models ({int(-shape[1])} to {int(shape[0])} "
                f"modules; this rank {m}): watch the same model on every rank of the process group"
            )
        bad = [float(c[2] > 0 or c[0] > 0 or c[1] > 0) for c in host.counts]
        per_module = m * world <= 1 << 20
        flags = torch.zeros((m, world) if per_module else (1, world), dtype=torch.float64)
        flags[:, rank] = torch.tensor(bad if per_module else [float(any(bad))], dtype=torch.float64)
        summed = torch.cat(
            [
                torch.tensor([x for c in host.counts for x in c], dtype=torch.float64),
                torch.tensor(host.calls + host.fp16_calls + host.elements + host.unread, dtype=torch.float64),
                flags.flatten(),
            ]
        ).to(device)
        first = host.first if host.first != _NONE else 2.0**62
        largest = torch.tensor([*host.amax, -float(first), float(host.passes)], dtype=torch.float64).to(device)
        all_reduce(summed, dist.ReduceOp.SUM, group)
        all_reduce(largest, dist.ReduceOp.MAX, group)
        s, big = summed.tolist(), largest.tolist()
        rest = [int(x) for x in s[4 * m : 8 * m]]
        flat = s[8 * m :]
        code = -big[m]
        return _Host(
            counts=[[int(x) for x in s[4 * i : 4 * i + 4]] for i in range(m)],
            amax=big[:m],
            first=_NONE if code >= 2.0**62 else int(code),
            calls=rest[:m],
            fp16_calls=rest[m : 2 * m],
            elements=rest[2 * m : 3 * m],
            ranks=[tuple(r for r in range(world) if flat[i * world + r]) for i in range(m)] if per_module else [()] * m,
            passes=int(big[m + 1]),
            unread=rest[3 * m :],
        )

    def figures(self) -> list[ModuleActivations]:
        """Every module's figures, in the model's module order (one sync, per device)."""
        return self._read().figures

    @property
    def first_nonfinite(self) -> tuple[str, str, int] | None:
        """The module whose outputs were the first to hold a NaN or an Inf, in execution order over
        every sampled pass: (name, class name, its call number among the scanned calls), or None (one
        sync). With finite inputs to the model, this module made the non-finite values."""
        read = self._read()
        if read.first_slot is None or read.first_call is None:
            return None
        return self.names[read.first_slot], self.ops[read.first_slot], read.first_call

    def worst(self) -> list[ModuleActivations]:
        """The modules that were scanned, worst first: the first to go non-finite, the other
        non-finite ones, then by headroom, smallest first (one sync)."""
        return self._read().worst()

    def table(self, limit: int | None = 20) -> str:
        """A text table of the scanned modules, worst headroom first (one sync)."""
        read = self._read()
        rows = read.worst()
        replays = read.passes - self._eager_passes
        head = (
            f"activations of {len(rows)} modules over {read.passes} sampled forward(s) of "
            + (f"{self._forwards}" if replays <= 0 else f"{self._forwards} and {replays} CUDA graph replay(s)")
            + f" (every {self.every}); headroom = 65504 / amax, 0 where a NaN/Inf was seen"
        )
        if read.first_slot is not None:
            first = read.figures[read.first_slot]
            head += (
                f"\nfirst non-finite output: `{first.name or '(model)'}` ({first.op}), scanned call {read.first_call}"
            )
        unread = [f for f in read.figures if f.unread]
        if unread:
            head += (
                f"\n{sum(f.unread for f in unread)} output tensor(s) of {len(unread)} module(s) could not be read "
                "(column `unread`): those modules' figures cover only what was read"
            )
        if not rows:
            return head + "\n(nothing scanned yet)"
        shown = rows if limit is None else rows[:limit]
        width = max(len("module"), *(len(f.name or "(model)") for f in shown))
        lines = [
            head,
            f"{'module':<{width}}  {'op':<16} {'amax':>10} {'headroom':>9} {'overflow':>9} {'underflow':>10} "
            f"{'nan':>6} {'inf':>6} {'calls':>6}" + (f" {'unread':>6}" if unread else ""),
        ]
        for f in shown:
            # A module none of whose outputs was read has no headroom to show: "?", never "inf".
            headroom = "?" if f.calls == 0 else "inf" if math.isinf(f.headroom) else f"{f.headroom:.3g}"
            ranks = f"  ranks {','.join(map(str, f.ranks))}" if f.ranks else ""
            lines.append(
                f"{f.name or '(model)':<{width}}  {f.op[:16]:<16} {f.amax:>10.4g} {headroom:>9} {f.overflow:>9} "
                f"{f.underflow:>10} {f.nan:>6} {f.inf:>6} {f.calls:>6}" + (f" {f.unread:>6}" if unread else "") + ranks
            )
        if len(rows) > len(shown):
            lines.append(f"... {len(rows) - len(shown)} more (table(limit=None) shows all)")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"ActivationWatch({len(self.names)} modules, every={self.every}, {self._sampled} sampled forwards)"

    # ----------------------------------------------------------------------------------- lifetime

    def remove(self) -> None:
        """Removes every hook; the figures so far stay readable."""
        self._settle()  # removed within a forward: the outputs kept so far are scanned, not dropped
        while self._handles:
            self._handles.pop().remove()
        self._detach_module_hooks()
        self._sampling = False
        self._seen.clear()

    def __enter__(self) -> ActivationWatch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.remove()

    def __iter__(self) -> Iterator[ModuleActivations]:
        return iter(self.figures())


def watch_activations(
    model: torch.nn.Module, *, every: int = 1, process_group: Any = None, batch_bytes: int = DEFAULT_BATCH_BYTES
) -> ActivationWatch:
    """Watches each module's outputs for fp16 headroom, NaN and Inf, every ``every``-th forward.

    Args:
        model: the module whose submodules (itself included) are watched.
        every: scan on every ``every``-th forward of ``model`` (the first included); 1 scans every
            forward.
        process_group: under torch.distributed, the ranks whose figures are reduced together when
            read (default: every rank). Each rank watches its own activations (DDP, FSDP: its own
            batch); reading the figures (``table()``, ``figures()``, the Advisor) is then a
            collective, made by every rank of the group, and says which ranks overflowed.
        batch_bytes: the most output bytes the watch keeps alive for its batched scan (256 MiB by
            default): the outputs of the modules whose outputs nothing changes in place are scanned
            together, in one op call per device, at the end of the forward or once they reach this
            size, rather than one op call per module call (a host-bound step's cost). In training
            autograd keeps most of them anyway; under ``no_grad``, or where activation checkpointing
            frees them, this is what a forward's peak memory can grow by. ``0``: every module call's
            outputs are scanned as it returns, nothing kept.

    Returns:
        An :class:`ActivationWatch`: ``table()``/``str()`` for the figures (one sync), ``figures()``
        for them as values, ``remove()`` (or a ``with`` block) to detach.
    """
    return ActivationWatch(model, every, process_group, batch_bytes)
