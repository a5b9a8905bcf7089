"""``locate(model)``: the first module, in execution order, whose output or gradient went non-finite.

    with nanscan.locate(model) as trace:
        loss = loss_fn(model(x), y)
        loss.backward()
    if not trace.finite:
        print(trace)          # "... first non-finite: forward output of `blocks.2.mlp.fc1` (Linear), call 1 ..."
        trace.first.module    # "blocks.2.mlp.fc1"

How it works. Every call of every hooked module gives events, recorded in the order they happen:

* forward: when the call returns, its floating outputs are scanned (one ``nanscan.scan`` call). The
  event is non-finite when an output is. Its inputs' statistics, taken before forward ran, say
  whether the module received bad values or made them; an input is nearly always an earlier
  module's output, already scanned and unchanged since (same object, same version counter), so
  only inputs that no hooked module produced (the model's inputs, values made by a container's own
  code) cost a second scan call. (A write through ``.data`` in a container's code between two
  modules bumps no version counter, so the next module's input statistics would be the earlier
  ones: that can move ``origin`` to the next module, never hide a NaN, since every output is
  scanned as it is produced.)
* backward: when the gradients with respect to the module's differentiable inputs are complete (what
  the module's backward produced: its "input-gradients"), one scan covers them and the gradients the
  module received for its outputs, except those already scanned as the next module's
  input-gradients. A module without a differentiable input (the first layer, an embedding)
  produces no input-gradient; its event is the gradient it received.

* parameter gradients: every parameter's gradient, once autograd has accumulated it into ``.grad``
  (a post-accumulate-grad hook), is an event of the module that owns the parameter. A NaN that
  appears only in a weight's gradient (``x * gain.sqrt()`` with ``gain`` at zero: the input-gradient
  is finite, the gradient of ``gain`` is not) is found and named this way. The gradients of one
  backward pass are scanned together, in one call when the pass ends; until then the locator holds
  references to them (the ``.grad`` tensors themselves, no copies). The event's context is what the
  module received for its outputs in that pass.

Nothing syncs inside the hooks: each scan leaves its statistics on the device, and the first Python
value read from the trace copies all of them to the host in one transfer (one per device).

DTensors (tensor parallel, FSDP2) are read by their local tensors: each rank locates the first
non-finite event in what it holds itself, and ``first_by_rank()`` gathers every rank's. A floating
tensor no hook can read (a subclass that keeps its values elsewhere, a sparse or meta tensor) is
listed in ``unread`` (with one warning), never taken for finite in silence.

Which hooks, and why not ``register_full_backward_hook``: the full backward hook routes a module's
inputs and outputs through a custom autograd Function that returns them as-is, and autograd forbids
in-place changes to such outputs (a ``ReLU(inplace=True)`` after a hooked module raises); it also sees
positional tensor arguments only. Instead a forward pre-hook hands the module a plain view
(``view_as``) of each differentiable input (positional or keyword) and hooks the view's autograd node.
The view is used only inside the module, so its gradient is exactly this module's input-gradient (not
summed with the other consumers of the same tensor, such as a residual branch), and a regular view
tolerates in-place ops. Identical arguments share one view, so identity checks inside the module
(``query is key`` in attention) see what they saw before, and the outputs and gradients are bitwise
those of the model without hooks. Output gradients are caught by a pre-hook on each output's autograd
node, registered in the forward hook: registered before any later in-place change, it still receives
the gradient of the value the module returned. A module that changes its input in place (through any
view of its memory) re-routes autograd around the view's node; that is detected from the version
counter when forward returns, and such a call's backward event is the gradient it received instead.

Costs: a module call costs two Python hooks and a scan in forward, and two gradient hooks and a scan
in backward (tens of microseconds of host time on a CPU, and one read of the activations and
gradients); ``torch.autograd.detect_anomaly`` records a Python stack trace for every op instead, and
checks every backward op's outputs with a host sync. Memory: the statistics of every event (a few
hundred bytes on the device) until the locator is discarded, and at most two recent gradients held
during backward. Activation checkpointing re-runs forward during backward: those calls are recorded
as further forward events, with the next call numbers.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils.hooks import RemovableHandle

from ._ops import scan_op
from .fused import describe_unread, floating_tensors, local_values, scannable
from .names import clean_module_names
from .scan import scan

Phase = Literal["forward", "backward"]
Kind = Literal["output", "input-gradient", "output-gradient", "parameter-gradient"]

# How each kind of event labels its tensors: (what the module produced, what it consumed).
_LABELS: dict[str, tuple[str, str]] = {
    "output": ("output", "input"),
    "input-gradient": ("grad input", "grad output"),
    "output-gradient": ("grad output", ""),
    "parameter-gradient": ("grad", "grad output"),
}
_DESCRIBE: dict[str, str] = {
    "output": "forward output",
    "input-gradient": "input-gradient (backward)",
    "output-gradient": "gradient received for the output (backward)",
    "parameter-gradient": "parameter gradient (backward)",
}
_RECENT_GRADS = 2  # input-gradients held for _grad_ref: a chain needs one
_SEEN_PRUNE = 4096  # entries in the table of scanned tensors before the dead ones are dropped


@dataclass(frozen=True)
class TensorStats:
    """Python values of one scanned tensor: its place in the event, shape, dtype and statistics."""

    label: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nan_count: int
    inf_count: int
    min: float
    max: float
    norm: float

    @property
    def finite(self) -> bool:
        """No NaN and no Inf."""
        return self.nan_count == 0 and self.inf_count == 0

    @property
    def is_mask(self) -> bool:
        """Whether this looks like an additive attention mask (no NaN, every finite element 0, the rest +-inf).

        Such an input is non-finite by design, so it does not count against ``Finding.inputs_finite``.
        """
        return _is_mask(self.nan_count, self.inf_count, self.min, self.max)

    @property
    def absmax(self) -> float:
        """Largest magnitude among the finite elements (0.0 when there is none)."""
        if self.min > self.max:  # no finite element: min is +inf, max is -inf
            return 0.0
        return max(abs(self.min), abs(self.max))

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        head = f"{self.label} {dtype}{list(self.shape)}"
        if self.finite:
            return f"{head}: finite, max |x| {self.absmax:.3g}, norm {self.norm:.3g}"
        counts = [f"{self.nan_count} NaN"] * bool(self.nan_count) + [f"{self.inf_count} Inf"] * bool(self.inf_count)
        rest = f"finite range [{self.min:.3g}, {self.max:.3g}]" if self.min <= self.max else "no finite element"
        mask = " (an additive mask)" if self.is_mask else ""
        return f"{head}: {', '.join(counts)}, {rest}{mask}"


def _is_mask(nan: float, inf: float, lo: float, hi: float) -> bool:
    return nan == 0 and inf > 0 and lo == 0 and hi == 0


@dataclass(frozen=True)
class Finding:
    """One event (a module call's forward output or backward gradients) with its statistics.

    Attributes:
        module: qualified name from ``model.named_modules()``; ``""`` is the model itself.
        op: the module's class name (``"Linear"``, ``"MultiheadAttention"``).
        phase: ``"forward"`` or ``"backward"``.
        kind: ``"output"`` (forward), ``"input-gradient"`` (backward: the gradients the module's
            backward produced for its inputs), ``"output-gradient"`` (backward, for a module without
            a differentiable input, or one that changed its input in place: the gradients it received
            for its outputs) or ``"parameter-gradient"`` (backward: the accumulated gradient of one
            of the module's own parameters, named by ``parameter``).
        call: which call of the module this was, counted from 1 by the locator (a module applied
            twice per step has calls 1 and 2 in the first step, 3 and 4 in the next). For a
            parameter gradient, which sums the module's calls, the number of calls made so far.
        event: the event's position in execution order, from 0.
        outputs: what the module produced: its outputs (forward) or its input-gradients (backward);
            for an ``"output-gradient"`` event, the gradients it received.
        inputs: what the module consumed: its floating inputs (forward) or, for an
            ``"input-gradient"`` or ``"parameter-gradient"`` event, the gradients it received for its
            outputs. May be empty.
        parameter: for a ``"parameter-gradient"`` event, the parameter's qualified name
            (``"blocks.0.gain"``); None for every other kind.
    """

    module: str
    op: str
    phase: Phase
    kind: Kind
    call: int
    event: int
    outputs: tuple[TensorStats, ...]
    inputs: tuple[TensorStats, ...]
    parameter: str | None = None

    @property
    def finite(self) -> bool:
        """True when every tensor in ``outputs`` is finite."""
        return all(t.finite for t in self.outputs)

    @property
    def inputs_finite(self) -> bool:
        """True when every tensor in ``inputs`` is finite or an additive mask (also when there are none)."""
        return all(t.finite or t.is_mask for t in self.inputs)

    @property
    def where(self) -> str:
        """How a report names the module call, e.g. "`blocks.2.mlp` (MLP), call 1"."""
        name = f"`{self.module}`" if self.module else "the model itself"
        if self.parameter is not None:
            return f"`{self.parameter}` of {name} ({self.op})"
        return f"{name} ({self.op}), call {self.call}"

    def __str__(self) -> str:
        lines = [f"{_DESCRIBE[self.kind]} of {self.where} (event {self.event})"]
        lines += [f"  {t}" for t in self.outputs + self.inputs]
        return "\n".join(lines)


class _Scan:
    """One scan call's raw results on the device, and the shape and dtype of each scanned tensor."""

    __slots__ = ("counts", "metas", "stats")

    counts: torch.Tensor
    stats: torch.Tensor

    @classmethod
    def deferred(cls) -> _Scan:
        """A scan whose tensors are added one by one (``metas``) and scanned later, by ``run``."""
        scan = cls.__new__(cls)
        scan.metas = []
        return scan

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.metas: list[tuple[torch.Size, torch.dtype]] = []
        self.run(tensors)

    def run(self, tensors: list[torch.Tensor]) -> None:
        # Detached: the op has no autograd formula, and its outputs must not hold the model's graph.
        # (Cheaper than switching grad mode off and on around the call.)
        inputs = [t.detach() for t in tensors] if torch.is_grad_enabled() else tensors
        try:
            # The registered op directly: none of scan()'s per-call wrapping, which costs as much as
            # the op on small activations. scan() is the fallback: it gathers a list that spans
            # several devices, or raises naming the entry it cannot scan.
            counts, stats, *_ = scan_op(inputs)
        except (RuntimeError, TypeError):
            result = scan(inputs)
            counts = torch.stack([result.nan_count, result.inf_count])
            stats = torch.stack([result.min, result.max, result.norm])
        self.counts = counts  # int64 [2, N]: NaN, Inf
        self.stats = stats  # float64 [3, N]: min, max, L2 norm
        if not self.metas:
            self.metas = [(t.shape, t.dtype) for t in tensors]


# A scanned tensor: the scan that covered it and its column there.
_Ref = tuple[_Scan, int]


class _Call:
    """One call of one module: who it is, its inputs' statistics, and its state between hooks."""

    __slots__ = ("grad_inputs", "grad_outputs", "inputs", "received", "views", "who")

    def __init__(self, name: str, op: str, call: int) -> None:
        self.who = (name, op, call)  # what the events of this call keep: never its tensors
        self.inputs: list[_Ref] = []  # the forward inputs, scanned (or found scanned) before forward ran
        self.views: list[tuple[torch.Tensor, int]] | None = None  # (view, version) until forward returns
        self.grad_inputs = False  # an input-gradient event will come (else: an output-gradient event)
        # Held from the output hook to the input hook: the output gradients, and where each was
        # already scanned (None: not yet).
        self.grad_outputs: tuple[list[torch.Tensor], list[_Ref | None]] | None = None
        # Where the gradients this call received for its outputs were scanned, once they were: the
        # context of the module's parameter-gradient events.
        self.received: list[_Ref] | None = None


class _Event:
    """A recorded event: references to the scanned tensors it produced and consumed."""

    __slots__ = ("context_known", "inputs", "kind", "outputs", "parameter", "who")

    def __init__(
        self,
        call: _Call,
        kind: Kind,
        outputs: list[_Ref],
        inputs: list[_Ref],
        context_known: bool,
        parameter: tuple[str, str] | None = None,
    ) -> None:
        self.who = call.who  # (module name, class name, call number)
        self.kind = kind
        self.outputs = outputs
        self.inputs = inputs
        # False when what the module consumed is unknown (a module that returns its input unchanged
        # sees its input-gradient before its output-gradient): such an event cannot show that the
        # module made the bad values, only that it passed them on.
        self.context_known = context_known
        self.parameter = parameter  # (qualified name, name within the module) of a parameter gradient


def _where(name: str, op: str, call: int) -> str:
    """How a message names a module call: "`blocks.2.mlp` (MLP), call 1"."""
    return f"{f'`{name}`' if name else 'the model itself'} ({op}), call {call}"


def _on_grads(tensors: Sequence[torch.Tensor], fn: Callable[[Sequence[torch.Tensor | None]], None]) -> None:
    """Calls ``fn(grads)`` once the gradient of every tensor of ``tensors`` that takes part is ready."""
    if len(tensors) > 1:
        register_multi_grad_hook(tensors, fn)
        return
    t = tensors[0]
    node = t.grad_fn
    if node is None:  # a leaf (a parameter returned as an output): no node to hook
        t.register_hook(lambda grad: fn([grad]))
    else:
        # A node pre-hook gets the gradients of all of the node's outputs; this tensor is one of them.
        index = t.output_nr
        node.register_prehook(lambda grads: fn([grads[index]]))


def _requiring_grad(obj: object, out: list[torch.Tensor]) -> None:
    """Appends the tensors in ``obj`` (nested tuples, lists, dict values) that require grad and whose
    values nanscan reads (a DTensor: its gradient comes as a DTensor, read by its local tensor), each
    object once: the tensors whose gradients a module's output hook waits for."""
    if isinstance(obj, torch.Tensor):
        if obj.requires_grad and local_values(obj) is not None and not any(obj is seen for seen in out):
            out.append(obj)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _requiring_grad(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _requiring_grad(item, out)


class Locator:
    """A context manager that hooks every module of a model and records scan statistics per event.

    Made by ``nanscan.locate(model)``. After (or inside) the ``with`` block, ``first`` is the first
    non-finite event in execution order, ``origin`` the first event that turned finite inputs into
    non-finite outputs, and ``finite`` whether every event was finite. Reading any of them copies all
    statistics to the host once; recording never syncs.

    The hooks are removed on exit, also when the block raises (the exception propagates unchanged).
    Run the backward pass inside the block: gradient hooks record only while it is open. Events and
    their device statistics (a few hundred bytes each) accumulate until the locator is discarded: wrap
    one step, or a few, rather than a whole training run.
    """

    def __init__(self, model: torch.nn.Module, *, backward: bool = True, leaf_only: bool = False) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"nanscan.locate: expected a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError("nanscan.locate: a TorchScript module runs no Python hooks; locate the eager model")
        self.model = model
        self.backward = backward
        self.leaf_only = leaf_only
        self._handles: list[RemovableHandle] = []
        self._events: list[_Event] = []
        self._calls: dict[str, int] = {}
        # Tensors already scanned, by id: (weak reference, version when scanned, where). A module's
        # input is nearly always an earlier module's output; found here, it is not scanned again.
        self._seen: dict[int, tuple[weakref.ref[torch.Tensor], int, _Scan, int]] = {}
        self._seen_limit = _SEEN_PRUNE
        # The last input-gradients scanned, held until the producer's output hook sees them again
        # (through an alias); see _grad_ref.
        self._recent: list[tuple[torch.Tensor, int, _Scan, int]] = []
        # Parameter gradients of the running backward pass, scanned together when it ends (one scan
        # call): the tensors, the deferred scan their events refer to, and the events whose context
        # (what the owning module received) is filled in then.
        self._param_grads: list[torch.Tensor] = []
        self._param_scan: _Scan | None = None
        self._param_events: list[_Event] = []
        # The calls that received output-gradients in the running backward pass, by module name.
        self._receiving: dict[str, list[_Call]] = {}
        self._active = False
        self._host: tuple[int, dict[int, list[list[float]]]] | None = None
        # Floating tensors a hook met and could not read (a tensor subclass other than DTensor, a
        # sparse or meta tensor): (where, what), in the order met. Never a silent gap: see ``unread``.
        self._unread: list[tuple[str, str]] = []

    # -------------------------------------------------------------------------------- lifetime

    def __enter__(self) -> Locator:
        if self._active:
            raise RuntimeError("nanscan.locate: this locator is already active; make a new one per with block")
        self._active = True
        try:
            for name, module in self._named_modules():
                if self.leaf_only and next(module.children(), None) is not None:
                    continue
                pre_hook, forward_hook = self._hooks(name, type(module).__name__)
                self._handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
                self._handles.append(module.register_forward_hook(forward_hook, with_kwargs=True))
            if self.backward:
                self._hook_parameters()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> Literal[False]:
        self.remove()
        return False  # never swallow the block's exception

    def remove(self) -> None:
        """Removes every module and parameter hook this locator added; calling it again does nothing.
        Gradient hooks still attached to a live autograd graph go with the graph, and record nothing
        from now on."""
        self._scan_parameter_gradients()
        self._active = False
        self._seen.clear()
        self._recent.clear()
        while self._handles:
            self._handles.pop().remove()

    def _named_modules(self) -> list[tuple[str, torch.nn.Module]]:
        """``model.named_modules()``, named as the user wrote them (nanscan.names): a wrapper and the
        module it wraps share a name, the wrapper first."""
        named = list(self.model.named_modules())
        clean = clean_module_names(self.model)
        return named if clean is None else [(clean.get(name, name), module) for name, module in named]

    # ----------------------------------------------------------------------------------- hooks

    def _hook_parameters(self) -> None:
        """A post-accumulate-grad hook on every parameter, under the module that owns it (a parameter
        shared by several modules, such as tied embeddings, under the first)."""
        hooked: set[int] = set()
        for module_name, module in self._named_modules():
            for short, param in module.named_parameters(recurse=False):
                if id(param) in hooked or not param.requires_grad:
                    continue
                hooked.add(id(param))
                qualified = f"{module_name}.{short}" if module_name else short
                hook = self._parameter_hook(module_name, type(module).__name__, (qualified, short))
                self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def _parameter_hook(self, name: str, op: str, parameter: tuple[str, str]) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._active or param.grad is None:
                return
            grad = local_values(param.grad)  # a DTensor's: this rank's shard
            if grad is None:
                self._note_unread(f"parameter gradient `{parameter[0]}`", [param.grad])
                return
            if self._param_scan is None:
                self._param_scan = _Scan.deferred()
                # Scan this pass's parameter gradients together once it ends (as DDP and FSDP
                # schedule their end-of-backward work).
                torch.autograd.Variable._execution_engine.queue_callback(self._scan_parameter_gradients)
            scan = self._param_scan
            scan.metas.append((grad.shape, grad.dtype))
            self._param_grads.append(grad)
            call = _Call(name, op, self._calls.get(name, 0))
            event = _Event(call, "parameter-gradient", [(scan, len(scan.metas) - 1)], [], False, parameter)
            self._events.append(event)
            self._param_events.append(event)

        return hook

    def _scan_parameter_gradients(self) -> None:
        """Scans the parameter gradients of the pass that ended, and gives their events the context
        of what each owning module received in it."""
        scan, grads, events = self._param_scan, self._param_grads, self._param_events
        receiving = self._receiving
        self._param_scan, self._param_grads, self._param_events, self._receiving = None, [], [], {}
        if scan is None:
            return
        scan.run(grads)
        for event in events:
            calls = receiving.get(event.who[0], [])
            if calls and all(call.received is not None for call in calls):
                event.inputs = [ref for call in calls for ref in call.received or []]
                event.context_known = True

    def _hooks(self, name: str, op: str) -> tuple[Callable[..., Any], Callable[..., Any]]:
        """The forward pre-hook and forward hook of one module; they share the stack of its open calls."""
        open_calls: list[_Call] = []

        def pre_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            n = self._calls[name] = self._calls.get(name, 0) + 1
            call = _Call(name, op, n)
            open_calls.append(call)
            inputs: list[torch.Tensor] = []
            unread: list[torch.Tensor] = []
            floating_tensors(args, inputs, unread)
            if kwargs:
                floating_tensors(kwargs, inputs, unread)
            if unread:
                self._note_unread(f"forward input of {_where(name, op, n)}", unread)
            # Before forward runs: a module that changes an input in place must not see it changed.
            call.inputs = self._resolve(inputs, [self._lookup(t) for t in inputs])
            if self.backward and torch.is_grad_enabled():
                return self._wrap_inputs(call, args, kwargs)
            return None

        def forward_hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            # A call whose forward raised never reaches this hook and leaves its entry behind, below the
            # entries of later calls, so the top of the stack is still this call.
            call = open_calls.pop() if open_calls else _Call(name, op, self._calls.get(name, 0))
            outputs: list[torch.Tensor] = []
            unread: list[torch.Tensor] = []
            floating_tensors(output, outputs, unread)  # a DTensor's local tensor: this rank's values
            if unread:
                self._note_unread(f"forward output of {_where(*call.who)}", unread)
            # An output already scanned and unchanged (a module that returns its input, as dropout
            # with p=0 and Identity do) keeps its scan.
            refs = self._resolve(outputs, [self._lookup(t) for t in outputs])
            self._events.append(_Event(call, "output", refs, call.inputs, True))
            if call.views is not None:
                # An in-place change of an input (through any view of its storage) re-routes autograd
                # around the view's node, so the input-gradient hook would not fire, or would see part
                # of the gradient. Fall back to the gradient the module receives for its outputs.
                if any(view._version != version for view, version in call.views):
                    call.grad_inputs = False
                call.views = None
            if self.backward and torch.is_grad_enabled():
                differentiable: list[torch.Tensor] = []
                _requiring_grad(output, differentiable)
                if differentiable:
                    _on_grads(differentiable, lambda grads: self._on_grad_outputs(call, grads))

        return pre_hook, forward_hook

    def _resolve(self, tensors: list[torch.Tensor], refs: list[_Ref | None]) -> list[_Ref]:
        """Where each tensor's statistics are: ``refs[i]`` when known, else in one scan made now."""
        missing = [i for i, ref in enumerate(refs) if ref is None]
        if missing:
            scanned = _Scan([tensors[i] for i in missing])
            for j, i in enumerate(missing):
                refs[i] = (scanned, j)
                self._remember(tensors[i], (scanned, j))
        return refs  # type: ignore[return-value]

    def _lookup(self, t: torch.Tensor) -> _Ref | None:
        entry = self._seen.get(id(t))
        if entry is not None and entry[0]() is t and entry[1] == t._version:
            return entry[2], entry[3]
        return None

    def _remember(self, t: torch.Tensor, ref: _Ref) -> None:
        seen = self._seen
        seen[id(t)] = (weakref.ref(t), t._version, ref[0], ref[1])
        if len(seen) > self._seen_limit:  # drop the entries of freed tensors
            self._seen = {k: v for k, v in seen.items() if v[0]() is not None}
            self._seen_limit = max(_SEEN_PRUNE, 2 * len(self._seen))

    def _wrap_inputs(self, call: _Call, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Gives the module its own view of each differentiable input, and hooks the views' gradients."""
        views: dict[int, torch.Tensor] = {}

        def wrap(value: Any) -> Any:
            # Only plain tensors: a view of a Parameter (or of a subclass) would not be one any more.
            if type(value) is not torch.Tensor or not value.requires_grad or not scannable(value):
                return value
            view = views.get(id(value))
            if view is None:
                view = views[id(value)] = value.view_as(value)
                ref = self._lookup(value)
                if ref is not None:  # the module's children see the view: let them find it scanned
                    self._remember(view, ref)
            return view

        new_args = tuple([wrap(a) for a in args])
        new_kwargs = {k: wrap(v) for k, v in kwargs.items()} if kwargs else kwargs
        if not views:
            return None
        call.grad_inputs = True
        call.views = [(view, view._version) for view in views.values()]
        _on_grads(list(views.values()), lambda grads: self._on_grad_inputs(call, grads))
        return new_args, new_kwargs

    def _readable(self, grads: Sequence[torch.Tensor | None], where: str) -> list[torch.Tensor]:
        """The values of the gradients nanscan can read (a DTensor's local tensor); the floating ones
        it cannot are noted as unread."""
        readable, unread = [], []
        for g in grads:
            if g is None:
                continue
            local = local_values(g)
            if local is not None:
                readable.append(local)
            elif g.dtype.is_floating_point:
                unread.append(g)
        if unread:
            self._note_unread(where, unread)
        return readable

    def _note_unread(self, where: str, tensors: list[torch.Tensor]) -> None:
        """Records floating tensors a hook could not read, and warns once per locator."""
        what = ", ".join(sorted({describe_unread(t) for t in tensors}))
        if not self._unread:
            warnings.warn(
                f"nanscan.locate: the {where} holds {what} values that cannot be scanned; they are not "
                "covered by `finite` and `first` (Locator.unread lists every such tensor)",
                stacklevel=2,
            )
        self._unread.append((where, what))

    def _grad_ref(self, grad: torch.Tensor) -> _Ref | None:
        """The scan of ``grad`` if it is a recent input-gradient seen again.

        In a chain, the gradient a module receives for its output is the input-gradient of the next
        module, passed back through that module's input view as an alias of the same memory. Holding
        the last few input-gradients keeps that memory from being reused in between, so the same
        address, layout and version mean the same values, and the scan is not repeated."""
        for t, version, scanned, j in self._recent:
            if (
                t.data_ptr() == grad.data_ptr()
                and grad._version == version
                and t.shape == grad.shape
                and t.stride() == grad.stride()
                and t.dtype == grad.dtype
                and t.device == grad.device
            ):
                return scanned, j
        return None

    def _on_grad_outputs(self, call: _Call, grads: Sequence[torch.Tensor | None]) -> None:
        if not self._active:
            return
        received = self._readable(grads, f"gradient received by {_where(*call.who)}")
        refs = [self._grad_ref(g) for g in received]
        self._receiving.setdefault(call.who[0], []).append(call)
        if call.grad_inputs:
            call.grad_outputs = (received, refs)  # scanned (if need be) with the input-gradients
        else:
            call.received = self._resolve(received, refs) if received else []
            if received:
                self._events.append(_Event(call, "output-gradient", call.received, [], False))

    def _on_grad_inputs(self, call: _Call, grads: Sequence[torch.Tensor | None]) -> None:
        if not self._active or not call.grad_inputs:
            return
        produced = self._readable(grads, f"input-gradient of {_where(*call.who)}")
        context_known = call.grad_outputs is not None
        received, received_refs = call.grad_outputs or ([], [])
        call.grad_outputs = None  # drop the references
        if not produced and not received:
            call.received = []
            return
        # An input-gradient can itself be a recent one passed through (a module that returns its input).
        refs = self._resolve(produced + received, [self._grad_ref(g) for g in produced] + received_refs)
        k = len(produced)
        for g, (scanned, j) in zip(produced, refs[:k], strict=True):
            self._recent.append((g, g._version, scanned, j))
        del self._recent[:-_RECENT_GRADS]
        call.received = refs[k:]
        self._events.append(_Event(call, "input-gradient", refs[:k], refs[k:], context_known))

    # --------------------------------------------------------------------------------- results

    def _values(self) -> dict[int, list[list[float]]]:
        """Host rows [nan, inf, min, max, norm] of every scan the events refer to, by id of the scan.

        One device-to-host copy per device, made when the events changed since the last one."""
        self._scan_parameter_gradients()  # a backward pass that did not end (it raised) leaves some
        n = len(self._events)
        if self._host is not None and self._host[0] == n:
            return self._host[1]
        scans: dict[int, _Scan] = {}
        for event in self._events:
            for scanned, _ in event.outputs + event.inputs:
                scans.setdefault(id(scanned), scanned)
        by_device: dict[torch.device, list[_Scan]] = {}
        for scanned in scans.values():
            by_device.setdefault(scanned.counts.device, []).append(scanned)
        rows: dict[int, list[list[float]]] = {}
        for group in by_device.values():
            counts = torch.cat([s.counts for s in group], dim=1)
            stats = torch.cat([s.stats for s in group], dim=1)
            # fp64 holds counts exactly up to 2**53.
            table = torch.cat([counts.double(), stats]).t().cpu().tolist()
            offset = 0
            for s in group:
                k = len(s.metas)
                rows[id(s)] = table[offset : offset + k]
                offset += k
        self._host = (n, rows)
        return rows

    def _flags(self) -> Iterator[tuple[int, bool, bool]]:
        """(event, outputs finite, inputs finite or masks) for every event, in execution order."""
        rows = self._values()
        for i, event in enumerate(self._events):
            outputs = [rows[id(s)][j] for s, j in event.outputs]
            inputs = [rows[id(s)][j] for s, j in event.inputs]
            outputs_finite = all(r[0] == 0 and r[1] == 0 for r in outputs)
            inputs_finite = all((r[0] == 0 and r[1] == 0) or _is_mask(*r[:4]) for r in inputs)
            yield i, outputs_finite, inputs_finite

    def _finding(self, i: int) -> Finding:
        event = self._events[i]
        rows = self._values()
        produced, consumed = _LABELS[event.kind]

        def stats(refs: list[_Ref], label: str, indexed: bool = True) -> tuple[TensorStats, ...]:
            out = []
            for k, (s, j) in enumerate(refs):
                shape, dtype = s.metas[j]
                nan, inf, lo, hi, norm = rows[id(s)][j]
                name = f"{label}[{k}]" if indexed else label
                out.append(TensorStats(name, tuple(shape), dtype, int(nan), int(inf), lo, hi, norm))
            return tuple(out)

        phase: Phase = "forward" if event.kind == "output" else "backward"
        name, op, call = event.who
        inputs = stats(event.inputs, consumed)
        if event.parameter is None:
            return Finding(name, op, phase, event.kind, call, i, stats(event.outputs, produced), inputs)
        qualified, short = event.parameter
        outputs = stats(event.outputs, f"{produced} {short}", indexed=False)
        return Finding(name, op, phase, event.kind, call, i, outputs, inputs, qualified)

    @property
    def events(self) -> int:
        """How many events (forward outputs and backward gradients of module calls) were recorded."""
        return len(self._events)

    @property
    def timeline(self) -> list[tuple[str, Kind, int]]:
        """(module, kind, call) of every event in execution order; no statistics, so no sync."""
        return [(e.who[0], e.kind, e.who[2]) for e in self._events]

    @property
    def finite(self) -> bool:
        """True when no recorded module output or gradient held a NaN or an Inf. Under torch.distributed,
        this rank's (module outputs and gradients as this rank holds them: a DTensor's local shard);
        ``first_by_rank`` gathers every rank's answer. Tensors the hooks could not read are not covered:
        see ``unread``."""
        return self.first is None

    @property
    def unread(self) -> list[str]:
        """Where the hooks met floating tensors they could not read, and what those were (``"forward
        output of `0` (Linear), call 1: MyQuantTensor"``): a tensor subclass other than DTensor that
        keeps its values elsewhere, a sparse or meta tensor. Empty when every floating tensor was
        scanned; otherwise ``finite`` says nothing about the tensors listed (a warning said so when the
        first was met)."""
        return [f"{where}: {what}" for where, what in self._unread]

    def first_by_rank(self, process_group: Any = None) -> list[Finding | None]:
        """Every rank's ``first``, in rank order of ``process_group`` (default: every rank): each rank
        locates the first non-finite event in its own outputs and gradients, so ranks differ (the rank
        that made a NaN sees it at its origin, the others where a collective brought it to them). A
        collective: every rank of the group must call it. One process: ``[self.first]``."""
        import torch.distributed as dist

        first = self.first
        if not dist.is_available() or not dist.is_initialized():
            return [first]
        gathered: list[Finding | None] = [None] * dist.get_world_size(process_group)
        dist.all_gather_object(gathered, first, group=process_group)
        return gathered

    @property
    def first(self) -> Finding | None:
        """The first event, in execution order, whose outputs (or input-gradients) are non-finite."""
        for i, outputs_finite, _ in self._flags():
            if not outputs_finite:
                return self._finding(i)
        return None

    @property
    def origin(self) -> Finding | None:
        """The module that made the bad values, the first event that turned finite inputs into
        non-finite outputs. Differs from ``first`` when the values went bad outside any hooked module (in a
        container's own code between its children's calls: the origin is then the container); None when
        they came from outside the model (its inputs, or the loss)."""
        for i, outputs_finite, inputs_finite in self._flags():
            if not outputs_finite and inputs_finite and self._events[i].context_known:
                return self._finding(i)
        return None

    @property
    def nonfinite(self) -> list[Finding]:
        """Every non-finite event, in execution order."""
        return [self._finding(i) for i, outputs_finite, _ in self._flags() if not outputs_finite]

    def __str__(self) -> str:
        title = f"nanscan.locate on {type(self.model).__name__}"
        if not self._events:
            return f"{title}: no events recorded (was the model called inside the with block?)"
        first = self.first
        if first is None:
            unread = (
                f"; {len(self._unread)} tensor(s) could not be read, not covered: see .unread" if self._unread else ""
            )
            return f"{title}: all {len(self._events)} events finite{unread}"
        bad = sum(1 for _, outputs_finite, _ in self._flags() if not outputs_finite)
        text = f"{title}: {bad} of {len(self._events)} events non-finite; the first: {first}"
        origin = self.origin
        consumed = "Its inputs" if first.phase == "forward" else "The gradients it received"
        if origin is not None and origin.event == first.event:
            return f"{text}\n  {consumed} were finite: this module made the non-finite values."
        if origin is None:
            source = "the model's inputs" if first.phase == "forward" else "the loss (the model output's gradient)"
            return (
                f"{text}\n  No hooked module made them from finite values: they came from {source}, "
                "or from code outside the hooked modules."
            )
        made = f"{text}\n  They arrived non-finite; the first module that made them from finite values: {origin}"
        module = dict(self._named_modules()).get(origin.module)
        if module is not None and next(module.children(), None) is not None:
            made += "\n  (a container: in its own code, since none of its hooked children made them)"
        return made

    def __repr__(self) -> str:
        state = "active" if self._active else "closed"
        return f"<nanscan.Locator on {type(self.model).__name__}, {state}, {len(self._events)} events>"


def locate(model: torch.nn.Module, *, backward: bool = True, leaf_only: bool = False) -> Locator:
    """Finds the first module whose forward output or backward gradient became non-finite.

    Args:
        model: the module to watch; every submodule, and the model itself, is hooked. A model without
            parameters is fine: parameter-free modules (activations, norms without affine) are located
            like any other.
        backward: also scan gradients while grad mode is on (under ``torch.no_grad()`` there are none).
        leaf_only: hook only modules without children: fewer events, but a fault in a container's own
            code (between its children's calls) is then seen only at the next leaf.

    Returns:
        A ``Locator``: ``with nanscan.locate(model) as trace: ...``, then ``trace.first``. One
        ``nanscan.scan`` call per module call and phase; no host sync until a result is read.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, or is a TorchScript module (which runs no hooks).

    Run the model eagerly inside the block (not through ``torch.compile``, which would trace the hooks).
    """
    return Locator(model, backward=backward, leaf_only=leaf_only)
