"""nanscan.watch_activations: each module's outputs scanned for fp16 headroom, NaN and Inf, held
against an fp64 reference taken by plain forward hooks on the same calls."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import nanscan
from nanscan.activations import DEFAULT_BATCH_BYTES
from nanscan.records import read_jsonl

from conftest import OpaqueTensor, needs_cuda, syncs_refused

FP16_TINY = 2.0**-24  # fp16's smallest subnormal


class Energy(torch.nn.Module):
    """x^2 / sum(x^2): fine in fp32; in fp16, x^2 passes 65504 and inf / inf is NaN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = x * x
        return e / e.sum(-1, keepdim=True)


class Nested(torch.nn.Module):
    """Outputs in a tuple, a dict and a list, one tensor twice, one integer tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Any:
        y = self.fc(x)
        return y, {"double": y * 2, "list": [y.exp(), y], "ids": torch.arange(3)}


def reference(model: torch.nn.Module, run: Any) -> dict[str, list[float]]:
    """Per module name: [calls, elements, nan, inf, amax, overflow, underflow] of its floating outputs,
    in fp64, each distinct output object counted once per call, as the watch counts (without its
    across-module dedupe: the tests' models return fresh tensors from every module)."""
    figures: dict[str, list[float]] = {}
    handles = []
    for name, module in model.named_modules():

        def hook(module: torch.nn.Module, args: Any, output: Any, name: str = name) -> None:
            found: list[torch.Tensor] = []
            stack = [output]
            while stack:
                item = stack.pop()
                if isinstance(item, torch.Tensor):
                    if item.is_floating_point() and not any(item is f for f in found):
                        found.append(item)
                elif isinstance(item, (tuple, list)):
                    stack.extend(item)
                elif isinstance(item, dict):
                    stack.extend(item.values())
            if not found:
                return
            row = figures.setdefault(name, [0, 0, 0, 0, 0.0, 0, 0])
            row[0] += 1
            for t in found:
                v = t.detach().double().flatten()
                finite = v[torch.isfinite(v)].abs()
                row[1] += v.numel()
                row[2] += int(torch.isnan(v).sum())
                row[3] += int(torch.isinf(v).sum())
                row[4] = max(row[4], float(finite.max()) if finite.numel() else 0.0)
                row[5] += int((finite > 65504).sum())
                row[6] += int(((finite > 0) & (finite < FP16_TINY)).sum())

        handles.append(module.register_forward_hook(hook))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return figures


def as_rows(watch: nanscan.ActivationWatch) -> dict[str, list[float]]:
    return {
        f.name: [f.calls, f.elements, f.nan, f.inf, f.amax, f.overflow, f.underflow]
        for f in watch.figures()
        if f.calls > 0
    }


def planted_model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32), Nested_(), torch.nn.Linear(32, 8)
    )
    return model.to(dtype)


class Nested_(torch.nn.Module):
    """Values fp16 cannot hold: a few huge, a few tiny, a NaN and an Inf in chosen places."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.clone()
        # fill_ of an element's view: a kernel with the scalar as its argument. `y[0, 0] = 7e4` copies
        # the scalar from the host first, which the CUDA test's sync debug mode refuses.
        y[0, 0].fill_(7e4)
        y[0, 1].fill_(-1e5)
        y[0, 2].fill_(3e-9)
        y[0, 3].fill_(9e4)
        y[1, 1].fill_(1e-30)
        return y


def watched_and_reference(
    model: torch.nn.Module, x: torch.Tensor, passes: int = 3, batch_bytes: int = DEFAULT_BATCH_BYTES
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """(the watch's rows, the fp64 reference's) of ``passes`` forwards of ``model`` on ``x``: the
    first scans each module's outputs as it returns, the later ones batch them (the default
    ``batch_bytes``)."""

    def run() -> None:
        for _ in range(passes):
            model(x)

    want = reference(model, run)
    with nanscan.watch_activations(model, batch_bytes=batch_bytes) as watch:
        run()
    return as_rows(watch), want


@pytest.mark.parametrize("batch_bytes", [DEFAULT_BATCH_BYTES, 0, 1], ids=["batched", "at-return", "one-a-hold"])
def test_figures_match_an_fp64_reference_on_planted_values(batch_bytes: int) -> None:
    got, want = watched_and_reference(planted_model(), torch.randn(5, 16), batch_bytes=batch_bytes)
    # The model's own output is its last Linear's: the same object, scanned once, under that Linear.
    want.pop("", None)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name][:4] == want[name][:4], name
        assert got[name][4] == pytest.approx(want[name][4], rel=1e-12, abs=0), name
        assert got[name][5:] == want[name][5:], name
    planted = got["3"]
    # 7e4, -1e5, 9e4 overflow; 3e-9, 1e-30 underflow; in each of three passes
    assert planted[5] == 3 * 3 and planted[6] == 2 * 3, planted


def test_nested_outputs_each_counted_once() -> None:
    got, want = watched_and_reference(Nested(), torch.randn(4, 6))
    # The model returns y (fc's output, already scanned under `fc`), y * 2 and y.exp(): two new tensors.
    assert got["fc"] == pytest.approx(want["fc"])
    assert got[""][0] == 3 and got[""][1] == 3 * 2 * 24, got[""]


def test_fp16_evaluation_names_the_module_that_overflows() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), Energy(), torch.nn.Linear(8, 2)
    )
    with torch.no_grad():
        model[2].weight.mul_(400.0)
    x = torch.randn(4, 8) * 10
    with nanscan.watch_activations(model) as fp32:
        model(x).sum().backward()  # training in fp32: finite
    assert fp32.first_nonfinite is None and all(f.finite for f in fp32.figures())
    with nanscan.watch_activations(model) as fp16, torch.no_grad():
        model.half()(x.half())
    assert fp16.first_nonfinite is not None and fp16.first_nonfinite[:2] == ("3", "Energy")
    worst = fp16.worst()[0]
    assert worst.name == "3" and worst.headroom < 1, worst
    table = fp16.table()
    assert "first non-finite output: `3` (Energy)" in table, table


def test_sampling_every_nth_forward() -> None:
    model = planted_model()
    x = torch.randn(3, 16)
    watch = nanscan.watch_activations(model, every=3)
    for _ in range(7):
        model(x)
    assert (watch.forwards, watch.sampled) == (7, 3)  # forwards 0, 3 and 6
    assert {f.calls for f in watch.figures() if f.name != ""} == {3}
    assert watch.figures()[1].elements == 3 * 3 * 32  # the first Linear: 3 sampled calls of [3, 32]
    watch.remove()


def test_in_place_change_is_scanned_again_and_a_container_output_is_not() -> None:
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 64), torch.nn.ReLU(inplace=True))
    x = torch.randn(8, 4)
    with nanscan.watch_activations(model) as watch:
        out = model(x)
    rows = {f.name: f for f in watch.figures()}
    assert rows["0"].calls == 1 and rows["1"].calls == 1, "ReLU changed the Linear's output in place: two values"
    assert rows[""].calls == 0, "the Sequential returns the ReLU's output: the same object, unchanged"
    assert rows["1"].amax == float(out.detach().abs().max())


class ResidualAdd(torch.nn.Module):
    """ResNet's pattern: a BatchNorm's output changed in place by the parent (``out += identity``)
    after the BatchNorm returned, before any hook of the parent's next module; with ``late`` set, the
    change is made only from the forward it names on (a module whose first calls were left alone)."""

    def __init__(self, late: int | None = None) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 8)
        self.late = late
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        y = self.bn(self.fc(x))
        if self.late is None or self.calls >= self.late:
            y += 1000.0 * x  # after bn returned: the values bn made are gone
        return self.out(y)


def test_an_output_changed_in_place_after_its_module_returned_is_read_as_the_module_made_it() -> None:
    """The first forward scans as each module returns and sees that bn's output is changed later; bn
    is then scanned at its return in every later forward, so its figures are bn's own values (not the
    sum the parent made of them), while the others are batched."""
    torch.manual_seed(0)
    model = ResidualAdd().eval()
    x = torch.randn(16, 8)
    got, want = watched_and_reference(model, x, passes=4)
    assert got.keys() == want.keys() - {""}
    for name in got:
        assert got[name][:4] == want[name][:4] and got[name][5:] == want[name][5:], name
        assert got[name][4] == pytest.approx(want[name][4], rel=1e-12), name
    assert want["bn"][4] < 100 and want["out"][4] > 100, want  # bn's values, not bn + 1000 x


def test_a_module_left_alone_at_first_and_changed_in_place_later_is_counted_unread_never_misread() -> None:
    """bn's output is left alone in the first two forwards (so it is batched from the second on),
    then changed in place from the third: that call's kept output no longer holds bn's values, so it
    is not scanned but counted unread and warned about, and bn is scanned at its return after that."""
    torch.manual_seed(0)
    model = ResidualAdd(late=3).eval()
    x = torch.randn(16, 8)
    with nanscan.watch_activations(model) as watch:
        model(x)
        model(x)
        with pytest.warns(UserWarning, match=r"outputs of `bn` \(BatchNorm1d\) were changed in place"):
            model(x)
        model(x)
        model(x)
    bn = {f.name: f for f in watch.figures()}["bn"]
    assert (bn.calls, bn.unread, bn.complete) == (4, 1, False), bn
    with torch.no_grad():
        assert bn.amax == pytest.approx(float(model.bn(model.fc(x)).abs().max()), rel=1e-6)
    assert "could not be read" in watch.table()


def test_a_kept_view_whose_storage_is_freed_is_counted_unread_never_read() -> None:
    """A module's output that views a buffer its parent frees after the module returns (as FSDP
    frees its all-gather buffers, resizing their storage to nothing, with no version bump): from the
    forward where the freeing starts, that kept output is not read (it holds nothing the module made),
    but counted unread; later forwards scan the module at its return."""

    class Gathered(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x.flatten() * 2).view(x.shape)  # a view of a fresh buffer, as an all-gather's

    class Frees(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gathered = Gathered()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            y = self.gathered(x)
            out = y + 1
            if self.calls >= 2:
                y.untyped_storage().resize_(0)
            return out

    model = Frees()
    x = torch.full((2, 4), 3.0)
    with nanscan.watch_activations(model) as watch:
        model(x)
        freed = r"outputs of `gathered` \(Gathered\) were changed in place \(or their storage freed\)"
        with pytest.warns(UserWarning, match=freed):
            model(x)
        model(x)
    row = {f.name: f for f in watch.figures()}["gathered"]
    assert (row.calls, row.unread, row.amax) == (2, 1, 6.0), row


@pytest.fixture
def op_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The watch's op calls from here on, as the number of tensors each scanned."""
    import nanscan.activations as activations

    calls: list[int] = []
    real = activations.scan_into_

    def counted(tensors: list[torch.Tensor], *args: Any) -> None:
        calls.append(len(tensors))
        real(tensors, *args)

    monkeypatch.setattr(activations, "scan_into_", counted)
    return calls


def test_batched_scans_are_one_op_call_a_forward(op_calls: list[int]) -> None:
    """After its first forward, a watch whose modules' outputs nothing changes in place scans a
    forward's outputs in one op call (the host time that a per-call op costs a host-bound GPU step);
    with ``batch_bytes=0``, one a module call; with a small ``batch_bytes``, one each time the kept
    outputs reach it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(10)))
    x = torch.randn(2, 4)  # 32 bytes an output
    for batch_bytes, second_forward in [(DEFAULT_BATCH_BYTES, [10]), (0, [1] * 10), (96, [3, 3, 3, 1])]:
        with nanscan.watch_activations(model, batch_bytes=batch_bytes) as watch:
            model(x)
            assert op_calls == [1] * 10, (batch_bytes, op_calls)  # the first forward: at each return
            op_calls.clear()
            model(x)
            assert op_calls == second_forward, (batch_bytes, op_calls)
            op_calls.clear()
        assert {f.calls for f in watch.figures() if f.name} == {2}


def test_outputs_that_view_a_parameter_are_scanned_at_return(op_calls: list[int]) -> None:
    """A module that returns a view of its parameter: never kept (FSDP frees a parameter's storage
    after the forward without a version bump), so scanned as it returns, every forward; the Linear
    after it is batched."""

    class Table(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.arange(12.0).view(3, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight[: x.shape[0]]

    model = torch.nn.Sequential(Table(), torch.nn.Linear(4, 4))
    got, want = watched_and_reference(model, torch.zeros(2, 4))
    assert got["0"] == want["0"] and got["0"][:2] == [3, 3 * 8], got["0"]
    # Three forwards: the first scans both at return; then the Table at return and the Linear batched.
    assert op_calls == [1, 1] * 3, op_calls


def test_a_module_whose_output_the_next_changes_in_place_keeps_its_own_values_in_every_forward() -> None:
    """ReLU(inplace=True) after a Linear: the first forward learns that the Linear's output is changed
    after it returned, so in every later forward the Linear is scanned at its return (its negative
    values seen) and the ReLU's result batched; both equal the fp64 reference taken at each return."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 64), torch.nn.ReLU(inplace=True), torch.nn.Linear(64, 8), torch.nn.ReLU(inplace=True)
    )
    got, want = watched_and_reference(model, torch.randn(8, 4), passes=4)
    want.pop("", None)  # the Sequential returns the last ReLU's output: the same object, unchanged
    assert got.keys() == want.keys()
    for name in want:
        assert got[name][:4] == want[name][:4] and got[name][5:] == want[name][5:], name
        assert got[name][4] == pytest.approx(want[name][4], rel=1e-12), name
    # The seed's Linears have their largest |value| at a negative one, which the ReLUs then zero: read
    # after the ReLU, their amax would be smaller.
    assert want["0"][4] > want["1"][4] and want["2"][4] > want["3"][4], want


def test_training_gradients_unchanged_and_autocast_evaluation() -> None:
    def run(watched: bool) -> list[torch.Tensor]:
        model = planted_model()
        watch = nanscan.watch_activations(model) if watched else None
        torch.manual_seed(5)
        model(torch.randn(4, 16)).square().mean().backward()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(4, 16))
        if watch is not None:
            assert watch.sampled == 2 and watch.figures()[1].calls == 2
            watch.remove()
        return [p.grad for p in model.parameters()]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


def test_inference_mode_outputs_are_scanned_without_a_version_counter() -> None:
    model = planted_model()
    x = torch.randn(3, 16)
    with nanscan.watch_activations(model) as eager:
        model(x)
    with nanscan.watch_activations(model) as watch, torch.inference_mode():
        model(x)
    got, want = as_rows(watch), as_rows(eager)
    # Inference tensors are scanned each time they are returned: the Sequential's output (its last
    # Linear's) a second time, under the model's own name.
    assert got.pop("") == want["4"], got
    assert got == want


def test_a_first_forward_under_inference_mode_leaves_later_ones_working() -> None:
    """The accumulators are made at the first scanned call: under inference_mode they would be
    inference tensors, and every later pass outside it would fail on its writes."""
    model = planted_model()
    x = torch.randn(3, 16)
    with nanscan.watch_activations(model) as eager:
        model(x)
        model(x)
    with nanscan.watch_activations(model) as watch:
        with torch.inference_mode():
            model(x)
        with torch.no_grad():
            model(x)
    got, want = as_rows(watch), as_rows(eager)
    got.pop("", None), want.pop("", None)  # the inference pass scans the model's output twice (the test above)
    assert got == want


def test_a_forward_that_raises_leaves_sampling_working() -> None:
    class Fails(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)
            self.fail = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fc(x)
            if self.fail:
                raise RuntimeError("boom")
            return y

    model = Fails()
    watch = nanscan.watch_activations(model)
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.ones(1, 2))
    model.fail = False
    model(torch.ones(1, 2))
    assert watch.sampled == 2 and watch.figures()[1].calls == 2


def test_remove_leaves_no_hook() -> None:
    model = planted_model()

    def hooks() -> list[int]:
        return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()]

    before = hooks()
    watch = nanscan.watch_activations(model)
    assert hooks() != before
    watch.remove()
    assert hooks() == before
    model(torch.randn(2, 16))
    assert watch.sampled == 0 and "nothing scanned yet" in watch.table()


def test_a_compiled_model_gives_the_eager_figures() -> None:
    model = planted_model()
    x = torch.randn(4, 16)
    with nanscan.watch_activations(model) as eager:
        model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with nanscan.watch_activations(model) as watch:
        for _ in range(2):
            compiled(x)
    assert watch.sampled == 2
    want = as_rows(eager)
    got = as_rows(watch)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name][0] == 2 * want[name][0] and got[name][4] == want[name][4], name


def test_a_compiled_model_sampled_every_other_forward() -> None:
    """every > 1 attaches the submodules' hooks for the sampled forwards only: a compiled model sees
    both states, and gives the eager figures of the sampled forwards."""
    model = planted_model()
    x = torch.randn(4, 16)
    with nanscan.watch_activations(model) as eager:
        model(x)
    compiled = torch.compile(model, backend="aot_eager")
    with nanscan.watch_activations(model, every=2) as watch:
        for _ in range(5):
            compiled(x)
    assert (watch.forwards, watch.sampled) == (5, 3)
    want, got = as_rows(eager), as_rows(watch)
    assert got.keys() == want.keys()
    for name in want:
        assert got[name][0] == 3 * want[name][0] and got[name][4] == want[name][4], name


def test_unsampled_forwards_leave_the_submodules_unhooked() -> None:
    model = planted_model()
    watch = nanscan.watch_activations(model, every=4)
    submodules = list(model.children())
    assert all(not m._forward_hooks for m in submodules)
    model(torch.randn(2, 16))  # sampled: hooked during the forward, unhooked after
    assert all(not m._forward_hooks for m in submodules) and watch.figures()[1].calls == 1
    model(torch.randn(2, 16))
    assert watch.figures()[1].calls == 1
    watch.remove()
    assert not model._forward_hooks and not model._forward_pre_hooks


# ------------------------------------------------------------------------- the recorder


def test_a_recorder_keeps_each_sampled_forwards_figures(tmp_path: Path) -> None:
    """Recorder(activations=watch): a record holds the figures of the forwards sampled since the
    record before (not the watch's running totals), None when none was sampled; JSONL carries them
    (schema 3) and reads them back."""
    model = planted_model()
    x = torch.randn(4, 16)
    scales = [1.0, 1.0, 1e5, 1.0, 1.0]
    want = [reference(model, lambda s=s: model(x * s)) for s in scales]  # each forward on its own
    path = tmp_path / "run.jsonl"
    watch = nanscan.watch_activations(model, every=2)
    recorder = nanscan.Recorder([nanscan.sinks.JSONLSink(path)], every=2, activations=watch)
    for s in scales:
        model.zero_grad()
        model(x * s).sum().backward()
        nanscan.check(model, recorder=recorder)
    recorder.close()
    records = list(recorder.records)
    # The stated memory: 16 bytes per module and record on top of the gradients' rows.
    assert recorder.nbytes == recorder.capacity * (24 * 6 + 24 + 16 * len(watch.names)) + 8
    assert [r.activations is None for r in records] == [False, True, False, True, False]
    for step in (0, 2, 4):
        got = records[step].activations
        assert got is not None and list(got.modules) == watch.names
        for name, row in want[step].items():
            if name == "":
                continue  # the model's output is its last module's, scanned once, as that module's
            i = got.modules.index(name)
            # float32 in the ring: amax to float32's precision, counts exact.
            assert got.amax[i] == pytest.approx(row[4], rel=1e-7), (step, name)
            assert [got.nan_count[i], got.inf_count[i], got.overflow[i]] == [row[2], row[3], row[5]], (step, name)
    first, scaled, last = (records[k].activations for k in (0, 2, 4))
    assert first is not None and scaled is not None and last is not None
    # The figures of their own forwards, not running totals: the scaled forward's overflow gone again.
    assert sum(scaled.overflow) > sum(first.overflow) == sum(last.overflow) == 3
    assert first.nonfinite == [] and first.headroom[watch.names.index("3")] == pytest.approx(65504 / 1e5)
    back = read_jsonl(path)
    assert [r.activations for r in back] == [r.activations for r in records]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["kind"] == "layout" and lines[0]["modules"] == watch.names
    assert lines[2]["activations"] is None and len(lines[1]["activations"]["amax"]) == len(watch.names)


def test_a_recorder_refuses_what_is_not_a_watch() -> None:
    with pytest.raises(TypeError, match=r"activations must be a nanscan\.watch_activations"):
        nanscan.Recorder(activations=torch.nn.Linear(2, 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("every", [0, -1, 1.5, True, "2"])
def test_bad_every_is_refused(every: Any) -> None:
    with pytest.raises(ValueError, match="every must be a positive int"):
        nanscan.watch_activations(torch.nn.Linear(2, 2), every=every)


@pytest.mark.parametrize("batch_bytes", [-1, 1.5, True, None])
def test_bad_batch_bytes_is_refused(batch_bytes: Any) -> None:
    with pytest.raises(ValueError, match=r"batch_bytes must be an int >= 0"):
        nanscan.watch_activations(torch.nn.Linear(2, 2), batch_bytes=batch_bytes)


def test_a_non_module_is_refused() -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module, got list"):
        nanscan.watch_activations([torch.nn.Linear(2, 2)])  # type: ignore[arg-type]


@pytest.mark.cuda
@needs_cuda
def test_cuda_watch_without_a_sync() -> None:
    model = planted_model().cuda()
    x = torch.randn(4, 16, device="cuda")
    watch = nanscan.watch_activations(model)
    model(x)  # the first pass allocates the accumulators
    torch.cuda.synchronize()
    with syncs_refused():
        for _ in range(3):
            model(x).sum().backward()
    got = as_rows(watch)  # before the reference, whose forward the watch would count too
    want = reference(model, lambda: model(x))
    assert got["3"][0] == 4 and got["3"][5:] == [3 * 4, 2 * 4], got["3"]
    assert got["3"][4] == pytest.approx(want["3"][4], rel=1e-12)


@needs_cuda
def test_cuda_recorder_keeps_the_watch_without_a_sync() -> None:
    """A recorder with an activation watch appends without a sync on a GPU (sampled and unsampled
    steps alike); its records equal the watch's per-pass figures."""
    model = planted_model().cuda()
    x = torch.randn(4, 16, device="cuda")
    watch = nanscan.watch_activations(model, every=2)
    recorder = nanscan.Recorder(every=100, activations=watch)
    model(x).sum().backward()  # the first pass allocates the accumulators, the first append the ring
    nanscan.check(model, recorder=recorder)
    torch.cuda.synchronize()
    with syncs_refused():
        for _ in range(4):
            model.zero_grad()
            model(x).sum().backward()
            nanscan.check(model, recorder=recorder)
    recorder.close()
    records = list(recorder.records)
    assert [r.activations is None for r in records] == [False, True, False, True, False]
    i = watch.names.index("3")
    assert all(r.activations.overflow[i] == 3 for r in records if r.activations is not None)


@pytest.mark.cuda
@needs_cuda
def test_cuda_watch_captured_in_a_graph_counts_every_replay() -> None:
    """A sampled forward captured in a CUDA graph scans at every replay: the figures (calls, elements
    and passes included, all kept on the device) count each replay as the forward it repeats, the
    capture itself (recorded, not run) adds nothing, and a recorder takes each replay's figures, with
    no sync."""
    model = planted_model().cuda()
    x = torch.randn(4, 16, device="cuda")
    watch = nanscan.watch_activations(model)
    with torch.no_grad():
        side = torch.cuda.Stream()  # the warm-up off the capture stream, as torch.cuda.graph asks
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            model(x)  # the watch's accumulators are made here, outside the graph
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    recorder = nanscan.Recorder(every=100, activations=watch)
    nanscan.check(model, recorder=recorder)  # the warm-up's figures
    torch.cuda.synchronize()
    with syncs_refused():
        for _ in range(3):
            graph.replay()
            nanscan.check(model, recorder=recorder)
    recorder.close()
    got = as_rows(watch)  # the warm-up and three replays: four passes
    assert watch.forwards == 2 and "over 4 sampled forward(s) of 2 and 3 CUDA graph replay(s)" in watch.table()
    with torch.no_grad():
        want = reference(model, lambda: model(x))  # one pass, which the watch counts too: read after
    assert got["3"][:2] == [4, 4 * want["3"][1]] and got["3"][5:] == [3 * 4, 2 * 4], got["3"]
    assert got["3"][4] == pytest.approx(want["3"][4], rel=1e-12)
    assert got["0"][0] == 4 and got["4"][0] == 4, got
    records = list(recorder.records)
    i = watch.names.index("3")
    assert len(records) == 4 and all(r.activations is not None and r.activations.overflow[i] == 3 for r in records)


@pytest.mark.cuda
@needs_cuda
def test_cuda_watch_whose_first_scan_would_be_captured_refuses_it() -> None:
    """The accumulators' zeroing, captured, would undo every replay's figures: a capture before any
    sampled forward is refused, and a warm-up then lets the capture go through."""
    model = planted_model().cuda()
    x = torch.randn(4, 16, device="cuda")
    watch = nanscan.watch_activations(model)
    with torch.no_grad():
        refused = pytest.raises(RuntimeError, match="run one sampled forward of the model before the capture")
        with refused, torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(x)
        model(x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            model(x)
    graph.replay()
    assert as_rows(watch)["3"][0] == 2  # the warm-up and the replay
    assert "over 2 sampled forward(s) of 3 and 1 CUDA graph replay(s)" in watch.table()


# ------------------------------------------------------------------------- the AMP advice


class Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def energy_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8), Energy(), torch.nn.Linear(8, 2)
    )
    with torch.no_grad():
        model[2].weight.mul_(400.0)
    return model


def test_advice_names_the_fp32_island_of_an_fp16_evaluation() -> None:
    model = energy_model().half()
    with nanscan.watch_activations(model) as watch, torch.no_grad():
        model(torch.randn(4, 8).half() * 10)
    advice = nanscan.amp.Advisor(activations=watch).advise()
    assert advice.recommendation == "fp32-modules" and advice.fp32_modules == ["3"], advice
    assert "3 (Energy) was the first module whose fp16 outputs held NaN/Inf" in str(advice), advice


def test_advice_is_bf16_when_the_overflow_is_spread() -> None:
    layers = [torch.nn.Linear(4, 4)] + [Scale(10.0) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    with nanscan.watch_activations(model) as watch:
        model(torch.full((2, 4), 100.0))  # 1e3 .. 1e8 after the scales: most beyond 65504 / 2
    advice = nanscan.amp.Advisor(activations=watch).advise()
    assert advice.recommendation == "bf16" and "spread over" in str(advice), advice


def test_advice_keeps_fp16_for_a_healthy_run_and_states_the_headroom() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    advisor = nanscan.amp.Advisor(activations=nanscan.watch_activations(model))
    for _ in range(3):
        model.zero_grad()
        model(torch.randn(16, 8)).square().mean().backward()
        advisor.observe(model)
    advice = advisor.advise()
    assert advice.recommendation == "keep", advice
    assert advice.activation_headroom is not None and 1e3 < advice.activation_headroom < math.inf
    assert "activations fit fp16 with a headroom of" in str(advice) and "gradients:" in str(advice), advice


def test_advice_on_tiny_activations_and_on_nonfinite_ones_without_fp16() -> None:
    tiny = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(1e-9))
    with nanscan.watch_activations(tiny) as watch:
        tiny(torch.randn(64, 4))
    advice = nanscan.amp.Advisor(activations=watch).advise()
    assert advice.recommendation == "bf16" and "would be zeros in fp16" in str(advice), advice
    broken = torch.nn.Sequential(torch.nn.Linear(4, 4), Scale(math.inf), Scale(0.0))
    with nanscan.watch_activations(broken) as watch:
        broken(torch.randn(2, 4))
    advice = nanscan.amp.Advisor(activations=watch).advise()
    assert advice.recommendation == "nonfinite" and "in a run without fp16" in str(advice), advice


def test_advice_before_anything_was_observed_is_refused() -> None:
    watch = nanscan.watch_activations(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="nothing observed yet"):
        nanscan.amp.Advisor(activations=watch).advise()


def test_advisor_refuses_what_is_not_a_watch() -> None:
    with pytest.raises(TypeError, match=r"activations must be a nanscan\.watch_activations"):
        nanscan.amp.Advisor(activations=torch.nn.Linear(2, 2))  # type: ignore[arg-type]


# --------------------------------------------------------------------- what the watch cannot miss


def _tensor_parallel_of_one() -> torch.nn.Sequential:
    """Column- then row-parallel Linears on a mesh of one rank, whose outputs stay DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
    styles = {"0": ColwiseParallel(use_local_output=False), "1": RowwiseParallel(use_local_output=False)}
    parallelize_module(model, init_device_mesh("cpu", (1,)), styles)  # type: ignore[arg-type]
    return model


def test_dtensor_outputs_are_read_by_their_local_tensor(world_of_one: None) -> None:
    model = _tensor_parallel_of_one()
    x = torch.randn(3, 4)
    x[0, 0] = math.nan
    with nanscan.watch_activations(model) as watch:
        out = model(x)
    assert type(out).__name__ == "DTensor"
    figures = {f.name: f for f in watch.figures()}
    for name in ("0", "1"):  # every output row 0 is NaN: 8 and 4 values
        f = figures[name]
        want = 8 if name == "0" else 4
        assert (f.calls, f.elements, f.nan, f.unread) == (1, 3 * want, want, 0), f
        assert f.amax > 0 and not f.finite
    assert watch.first_nonfinite == ("0", "Linear", 0)


class _Plain(torch.Tensor):
    """A subclass that overrides no dispatch: its memory holds its values."""


class _Wraps(torch.nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return OpaqueTensor(x) if self.kind is OpaqueTensor else x.as_subclass(_Plain)


def test_an_output_the_watch_cannot_read_is_counted_and_shown_never_a_silent_zero() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Wraps(OpaqueTensor))
    with pytest.warns(UserWarning, match="cannot read"), nanscan.watch_activations(model) as watch:
        model[0](torch.randn(2, 4))  # a submodule alone: not the model's forward, nothing scanned
        model(torch.full((2, 4), math.nan))
    figures = {f.name: f for f in watch.figures()}
    wrapped = figures["1"]
    assert (wrapped.calls, wrapped.unread, wrapped.complete) == (0, 1, False), wrapped
    assert figures["0"].complete and figures["0"].nan == 8
    table = watch.table()
    assert "2 output tensor(s) of 2 module(s) could not be read" in table, table  # the model's output too
    row = next(line for line in table.splitlines() if line.startswith("1 "))
    assert row.split()[3] == "?", row  # no headroom shown for a module none of whose outputs was read
    assert "unread" in table.splitlines()[3], table


def test_the_advice_is_not_keep_while_an_output_went_unread() -> None:
    """All that was read fits fp16, but one module's output could not be read: the Advisor says the
    evidence is incomplete, naming the module, instead of 'keep'."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), _Wraps(OpaqueTensor)))
    with pytest.warns(UserWarning, match="cannot read"), nanscan.watch_activations(model) as watch:
        model(torch.randn(2, 4))
    advice = nanscan.amp.Advisor(activations=watch).advise()
    assert advice.recommendation == "incomplete", advice
    assert any("1.1 (1)" in reason and "could not read" in reason for reason in advice.reasons), advice.reasons


def test_a_subclass_that_overrides_no_dispatch_is_read() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Wraps(_Plain))
    x = torch.randn(2, 4)
    x[1, 2] = math.inf
    with nanscan.watch_activations(model) as watch:
        model(x)
    wrapped = next(f for f in watch.figures() if f.name == "1")
    assert (wrapped.calls, wrapped.unread, wrapped.inf) == (1, 0, 4), wrapped


def test_table_header_lines_up_with_short_module_names() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    with nanscan.watch_activations(model) as watch:
        model(torch.randn(3, 4))
    lines = watch.table().splitlines()
    header, row = lines[1], lines[2]
    assert header.index("op") == row.index("Linear"), (header, row)
    assert header.index("calls") + len("calls") == len(row), (header, row)
