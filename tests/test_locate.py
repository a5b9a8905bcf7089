"""locate(model): names the module where values first went non-finite, forward and backward; hooks
are removed on every exit; the model computes exactly what it computes without them; no host sync."""

from __future__ import annotations

import math

import pytest
import torch

import nanscan
from nanscan.locate import Locator, TensorStats, locate

from conftest import DEVICES, OpaqueTensor, reference_stats

# ------------------------------------------------------------------------------- planted faults


class FaultOnCall(torch.nn.Module):
    """Passes its input through, except at call ``on_call``, where ``faulty(x)`` runs instead."""

    def __init__(self, on_call: int | None = 1) -> None:
        super().__init__()
        self.on_call = on_call
        self.calls = 0

    def faulty(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.faulty(x) if self.calls == self.on_call else x * 1.0


class ForwardFault(FaultOnCall):
    """At call ``on_call``, returns log of negatives: NaN in the forward output."""

    def faulty(self, x: torch.Tensor) -> torch.Tensor:
        return (x.abs() + 1).neg().log()


class NaNGrad(torch.autograd.Function):
    """Identity forward; its backward returns NaN everywhere (the forward values stay finite)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * math.nan


class BackwardFault(FaultOnCall):
    """Identity forward; at call ``on_call`` its backward produces NaN gradients for its input."""

    def faulty(self, x: torch.Tensor) -> torch.Tensor:
        return NaNGrad.apply(x)


class Overflow(torch.nn.Module):
    """Multiplies by ``scale``: 1e38 overflows bf16/fp32 activations of magnitude > 3.4 to Inf."""

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Block(torch.nn.Module):
    """A residual block with a slot for a fault after the activation."""

    def __init__(self, width: int, fault: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(width, width)
        self.act = torch.nn.GELU()
        self.fault = fault if fault is not None else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fault(self.act(self.fc(x)))


class Net(torch.nn.Module):
    """Linear stem, three residual blocks in a ModuleList, linear head: names like ``blocks.1.fault``."""

    def __init__(self, width: int = 16, faults: dict[int, torch.nn.Module] | None = None) -> None:
        super().__init__()
        faults = faults or {}
        self.stem = torch.nn.Linear(8, width)
        self.blocks = torch.nn.ModuleList([Block(width, faults.get(i)) for i in range(3)])
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(faults: dict[int, torch.nn.Module] | None = None, device: str = "cpu") -> tuple[Net, torch.Tensor]:
    torch.manual_seed(0)
    return Net(faults=faults).to(device), torch.randn(4, 8, device=device)


def train_step(model: torch.nn.Module, x: torch.Tensor) -> None:
    model(x).square().mean().backward()


def hooks_of(model: torch.nn.Module) -> int:
    """Every module hook of every submodule (forward, pre-forward, backward, with and without kwargs),
    and every parameter's post-accumulate-grad hook."""
    module_hooks = sum(
        len(getattr(m, attr))
        for m in model.modules()
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
        )
    )
    return module_hooks + sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


def assert_stats(got: TensorStats, tensor: torch.Tensor) -> None:
    """A TensorStats against the fp64 reference statistics of the tensor it describes."""
    ref = reference_stats(tensor)
    assert got.shape == tuple(tensor.shape) and got.dtype == tensor.dtype
    assert (got.nan_count, got.inf_count) == (ref["nan_count"], ref["inf_count"])
    assert (got.min, got.max) == (ref["min"], ref["max"])
    assert got.norm == pytest.approx(ref["norm"], rel=1e-6)


# --------------------------------------------------------------------------------- localization


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", [0, 1, 2])
def test_forward_fault_in_nested_module(device: str, where: int) -> None:
    model, x = make({where: ForwardFault()}, device)
    received: list[torch.Tensor] = []
    model.blocks[where].act.register_forward_hook(lambda m, i, o: received.append(o.detach().clone()))
    with locate(model) as trace:
        train_step(model, x)
    first = trace.first
    assert first is not None and not trace.finite
    assert (first.module, first.op, first.phase, first.kind, first.call) == (
        f"blocks.{where}.fault",
        "ForwardFault",
        "forward",
        "output",
        1,
    )
    assert first.outputs[0].nan_count == 4 * 16 and first.outputs[0].shape == (4, 16)
    assert first.inputs_finite and first.inputs[0].nan_count == 0
    assert_stats(first.inputs[0], received[0])  # the activation's scan, reused for the fault's input
    assert trace.origin is not None and trace.origin.event == first.event
    # Everything downstream in forward went bad too, upstream did not.
    bad_forward = [f.module for f in trace.nonfinite if f.phase == "forward"]
    assert bad_forward[0] == f"blocks.{where}.fault" and "stem" not in bad_forward
    assert f"blocks.{where}" in bad_forward and "head" in bad_forward and "" in bad_forward
    text = str(trace)
    assert f"forward output of `blocks.{where}.fault` (ForwardFault), call 1" in text
    assert "this module made the non-finite values" in text


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", [0, 1, 2])
@pytest.mark.parametrize("autocast", [False, True])
def test_backward_fault_in_nested_module(device: str, where: int, autocast: bool) -> None:
    model, x = make({where: BackwardFault()}, device)
    received: list[torch.Tensor] = []  # the gradient for the fault's output, as autograd delivers it

    def capture(module: torch.nn.Module, args: object, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: received.append(grad.detach().clone()))

    model.blocks[where].fault.register_forward_hook(capture)
    with locate(model) as trace:
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().mean().backward()
    first = trace.first
    assert first is not None
    assert (first.module, first.op, first.phase, first.kind, first.call) == (
        f"blocks.{where}.fault",
        "BackwardFault",
        "backward",
        "input-gradient",
        1,
    )
    assert first.outputs[0].nan_count == first.outputs[0].shape[0] * first.outputs[0].shape[1]
    assert first.inputs and first.inputs_finite, "the gradient it received was finite"
    assert_stats(first.inputs[0], received[0])
    assert trace.origin is not None and trace.origin.event == first.event
    assert all(f.phase == "backward" for f in trace.nonfinite), "the forward pass was finite"
    # It is the first non-finite event in backward order: the events before it are all finite, and
    # the modules before it in backward order (the head, later blocks) were recorded.
    assert first.event > 0
    backward_before = [f for f in trace.nonfinite if f.event < first.event]
    assert backward_before == []
    assert "input-gradient (backward) of `blocks." in str(trace)


@pytest.mark.parametrize("device", DEVICES)
def test_module_called_twice_forward_fault_on_second_call(device: str) -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 8)
    with torch.no_grad():
        lin.weight.fill_(1.0)
        lin.bias.zero_()

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = lin

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)  # 8.0 everywhere: finite
            return self.lin(h * 4e37)  # finite input (3.2e38), the sum of eight overflows fp32 to Inf

    model = torch.nn.Sequential(torch.nn.Identity(), torch.nn.Sequential(Twice())).to(device)
    with locate(model) as trace:
        model(torch.ones(2, 8, device=device)).sum().backward()
    first = trace.first
    assert first is not None
    assert (first.module, first.op, first.phase, first.call) == ("1.0.lin", "Linear", "forward", 2)
    assert first.outputs[0].inf_count == 16 and first.inputs_finite
    assert first.inputs[0].max == pytest.approx(3.2e38, rel=1e-6)
    assert "call 2" in str(trace)


@pytest.mark.parametrize("device", DEVICES)
def test_module_called_twice_backward_fault_on_first_call(device: str) -> None:
    # Backward runs the calls in reverse: call 2's gradient is finite and comes first, then call 1's.
    fault = BackwardFault(on_call=1)

    class Twice(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fault = fault
            self.mid = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fault(self.mid(self.fault(x)))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Twice()).to(device)
    with locate(model) as trace:
        model(torch.randn(2, 8, device=device)).sum().backward()
    first = trace.first
    assert first is not None
    assert (first.module, first.phase, first.kind, first.call) == ("1.fault", "backward", "input-gradient", 1)
    second_call = [f for f in trace.nonfinite if f.module == "1.fault"]
    assert [f.call for f in second_call] == [1], "call 2's gradient was finite"


def test_no_fault() -> None:
    model, x = make()
    with locate(model) as trace:
        train_step(model, x)
    assert trace.finite and trace.first is None and trace.origin is None and trace.nonfinite == []
    # Forward: stem, 3 x (fc, act, fault, block), head, the model: 15 events. Backward: the model and
    # the stem have no differentiable input (one output-gradient event each), the other 13 modules
    # one input-gradient event each, and the 5 Linear layers one parameter-gradient event per
    # weight and bias.
    assert trace.events == 40
    assert str(trace) == "nanscan.locate on Net: all 40 events finite"


def test_exact_event_sequence() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with locate(model) as trace:
        model(torch.randn(3, 4)).sum().backward()
    assert trace.timeline == [
        ("0", "output", 1),
        ("1", "output", 1),
        ("2", "output", 1),
        ("", "output", 1),
        ("", "output-gradient", 1),  # the model's input needs no gradient: the gradient it received
        ("2", "parameter-gradient", 1),  # weight and bias, as autograd accumulates them
        ("2", "parameter-gradient", 1),
        ("2", "input-gradient", 1),
        ("1", "input-gradient", 1),
        ("0", "output-gradient", 1),
        ("0", "parameter-gradient", 1),
        ("0", "parameter-gradient", 1),
    ]


def test_several_inputs_keyword_inputs_and_several_outputs() -> None:
    # Two differentiable inputs, one of them by keyword, and two outputs: the module's gradients are
    # gathered into one event (multi-tensor hooks), and only the input whose gradient is NaN is bad.
    class Mix(torch.nn.Module):
        def forward(self, x: torch.Tensor, *, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x + NaNGrad.apply(y), x * 2

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)
            self.mix = Mix()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            s, p = self.mix(self.a(x), y=self.b(x))
            return s.sum() + p.sum()

    torch.manual_seed(0)
    model = Model()
    with locate(model) as trace:
        model(torch.randn(3, 4)).backward()
    first = trace.first
    assert first is not None and (first.module, first.kind) == ("mix", "input-gradient")
    assert [t.label for t in first.outputs] == ["grad input[0]", "grad input[1]"]
    assert [t.nan_count for t in first.outputs] == [0, 12], "x's gradient finite, y's NaN"
    assert [t.label for t in first.inputs] == ["grad output[0]", "grad output[1]"] and first.inputs_finite
    assert trace.origin is not None and trace.origin.event == first.event
    assert ("mix", "input-gradient", 1) in trace.timeline


def test_eval_no_grad_bf16_autocast_overflow() -> None:
    torch.manual_seed(0)
    model, _ = make({1: Overflow(1e38)})
    with torch.no_grad():  # the fault's input: GELU(8) = 8 everywhere, finite; 8e38 overflows bf16
        model.blocks[1].fc.weight.zero_()
        model.blocks[1].fc.bias.fill_(8.0)
    model.eval()
    x = torch.ones(4, 8)
    with locate(model) as trace, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    first = trace.first
    assert first is not None
    assert (first.module, first.phase, first.call) == ("blocks.1.fault", "forward", 1)
    assert first.outputs[0].dtype == torch.bfloat16 and first.outputs[0].inf_count > 0
    assert first.inputs[0].dtype == torch.bfloat16 and first.inputs_finite
    assert trace.events == 15, "forward events only: no gradients under no_grad"
    assert all(f.phase == "forward" for f in trace.nonfinite)


def test_inplace_ops_keep_working_and_backward_fault_is_found() -> None:
    # The full backward hook would raise here (in-place change of a hooked module's output); locate's
    # views tolerate it, and the block whose input changes in place still gets a backward event.
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8),
        torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(8, 8), BackwardFault()),
        torch.nn.ReLU(inplace=True),
        torch.nn.Linear(8, 1),
    )
    x = torch.randn(4, 8)
    with locate(model) as trace:
        model(x).sum().backward()
    first = trace.first
    assert first is not None and (first.module, first.phase, first.kind) == ("1.2", "backward", "input-gradient")
    backward = {(module, kind) for module, kind, _ in trace.timeline if kind != "output"}
    assert {module for module, _ in backward} == {"", "0", "1", "1.0", "1.1", "1.2", "2", "3"}
    # The ReLUs change their input in place, and so does the block holding the first one: their
    # backward events fall back to the gradient they received; the others keep their input-gradient.
    assert {module for module, kind in backward if kind == "output-gradient"} == {"", "0", "1", "1.0", "2"}


def test_fault_in_container_code_names_container_as_origin() -> None:
    class Inline(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out((self.fc(x).abs() + 1).neg().sqrt())  # NaN made between two children

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Inline())
    with locate(model) as trace:
        model(torch.randn(2, 8))
    assert trace.first is not None and trace.first.module == "1.out" and not trace.first.inputs_finite
    assert trace.origin is not None and trace.origin.module == "1" and trace.origin.op == "Inline"
    text = str(trace)
    assert "They arrived non-finite" in text and "forward output of `1` (Inline)" in text
    assert "a container: in its own code" in text


def test_input_changed_in_place_after_it_was_scanned_is_scanned_again() -> None:
    # A module's input is usually an earlier module's output, already scanned; that scan is reused
    # only while the tensor is unchanged. Here the container poisons the output of ``a`` in place.
    class Poison(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.a(x)
            h[0, 0] = math.nan
            return self.b(h)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Poison())
    with locate(model) as trace:
        model(torch.randn(2, 8)).sum().backward()
    first = trace.first
    assert first is not None and first.module == "1.b"
    assert first.inputs[0].nan_count == 1 and not first.inputs_finite
    assert trace.origin is not None and trace.origin.module == "1"


class SqrtGain(torch.nn.Module):
    """``x * sqrt(gain)`` with ``gain`` at zero: the output and the input-gradient are finite, but the
    gradient of ``gain`` is grad * x / (2 sqrt(0)) = +-inf (NaN where x is 0)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain.sqrt()


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_only_in_a_parameter_gradient(device: str) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), SqrtGain(8), torch.nn.Linear(8, 1)).to(device)
    x = torch.randn(4, 8, device=device)
    with locate(model) as trace:
        model(x).sum().backward()
    assert [f for f in trace.nonfinite if f.kind != "parameter-gradient"] == [], (
        "activations and input-gradients are finite"
    )
    first = trace.first
    assert first is not None and (first.module, first.op, first.kind, first.phase) == (
        "1",
        "SqrtGain",
        "parameter-gradient",
        "backward",
    )
    assert first.parameter == "1.gain" and first.outputs[0].label == "grad gain"
    assert_stats(first.outputs[0], model[1].gain.grad)
    assert first.inputs_finite and len(first.inputs) == 1, "the gradient the module received, finite"
    assert trace.origin is not None and trace.origin.event == first.event
    assert "`1.gain` of `1` (SqrtGain)" in str(trace) and "this module made the non-finite values" in str(trace)
    assert nanscan.check(model).nonfinite == ["1.gain"], "locate and check agree"


def test_fp16_amp_inf_in_a_weight_gradient_is_named() -> None:
    """Under fp16 autocast and a GradScaler, an overflow that shows only in a weight's gradient (the
    activations and input-gradients stay finite) is found and named."""

    class WideSum(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    torch.manual_seed(0)
    model = torch.nn.Sequential(WideSum(), torch.nn.Linear(64, 1))
    with torch.no_grad():  # sizes that keep every activation and gradient but proj.weight's in range
        model[0].proj.weight.fill_(1e-6)
        model[1].weight.fill_(1e-2)
    x = torch.full((4, 64), 3000.0)  # proj.weight's gradient: 1024 * 1e-2 * 3000 * 4 rows > 65504
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with locate(model) as trace:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(x).float().sum()
        scaler.scale(loss).backward()
    first = trace.first
    assert first is not None and first.kind == "parameter-gradient" and first.parameter == "0.proj.weight", str(trace)
    assert first.outputs[0].inf_count > 0
    assert all(f.kind == "parameter-gradient" for f in trace.nonfinite)


def test_parameter_gradient_events_of_shared_and_frozen_parameters() -> None:
    torch.manual_seed(0)
    shared = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(shared, torch.nn.Tanh(), shared, torch.nn.Linear(4, 1))
    model[3].bias.requires_grad_(False)
    with locate(model) as trace:
        model(torch.randn(2, 4)).sum().backward()
    params = [(m, k, c) for m, k, c in trace.timeline if k == "parameter-gradient"]
    # The shared layer's two parameters, once each (under its first name, "0"), after both calls;
    # the frozen bias has no gradient and no event.
    assert params == [("3", "parameter-gradient", 1), ("0", "parameter-gradient", 2), ("0", "parameter-gradient", 2)]
    assert trace.finite


def test_nonfinite_loss_is_outside_the_model() -> None:
    model, x = make()
    with locate(model) as trace:
        (model(x).sum() * math.inf).backward()
    first = trace.first
    assert first is not None and (first.module, first.kind) == ("", "output-gradient")
    assert trace.origin is None
    assert "they came from the loss" in str(trace)


def test_attention_mask_does_not_count_as_non_finite_input() -> None:
    # A causal float mask holds -inf by design; the attention with a NaN weight is still the origin.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    with torch.no_grad():
        layer.self_attn.in_proj_weight[0, 0] = math.nan
    mask = torch.nn.Transformer.generate_square_subsequent_mask(5)
    with locate(layer) as trace:
        layer(torch.randn(2, 5, 16), src_mask=mask).sum().backward()
    first = trace.first
    assert first is not None and (first.module, first.op) == ("self_attn", "MultiheadAttention")
    assert any(t.is_mask and not t.finite for t in first.inputs), "the mask was scanned as an input"
    assert first.inputs_finite and trace.origin is not None and trace.origin.event == first.event


def test_outputs_in_containers_and_non_floating_outputs() -> None:
    class Heads(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"index": x.argmax(-1), "pair": (x * 2, x.log()), "none": None}

    class Pick(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.argmax(-1)  # integer output: nothing to scan

    model = torch.nn.ModuleDict({"pick": Pick(), "heads": Heads()})
    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    with locate(model) as trace:
        model["pick"](x)
        model["heads"](x)
    first = trace.first
    assert first is not None and first.module == "heads"
    assert [t.nan_count for t in first.outputs] == [0, 1], "x * 2 finite, log(-2) NaN; the argmax skipped"
    assert [t.label for t in first.outputs] == ["output[0]", "output[1]"]
    assert trace.events == 2


# ------------------------------------------------------------------------------- options, inputs


def test_model_without_parameters() -> None:
    # Handled, not an error: parameter-free modules are located like any other, forward and backward.
    inner = torch.nn.Sequential(torch.nn.ReLU(), BackwardFault())
    model = torch.nn.Sequential(torch.nn.Tanh(), inner, torch.nn.Sigmoid())
    assert list(model.parameters()) == []
    x = torch.randn(3, 4, requires_grad=True)
    with locate(model) as trace:
        model(x).sum().backward()
    assert trace.first is not None and (trace.first.module, trace.first.phase) == ("1.1", "backward")

    forward = torch.nn.Sequential(torch.nn.Tanh(), ForwardFault())
    with locate(forward) as trace:
        forward(torch.randn(3, 4))
    assert trace.first is not None and (trace.first.module, trace.first.phase) == ("1", "forward")


@pytest.mark.parametrize("bad", [None, 3, torch.randn(2), [torch.nn.Linear(2, 2)]])
def test_not_a_module_is_a_type_error(bad: object) -> None:
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        locate(bad)  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_module_is_a_type_error() -> None:
    scripted = torch.jit.script(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="TorchScript"):
        locate(scripted)


def test_leaf_only_and_forward_only() -> None:
    model, x = make({1: ForwardFault()})
    with locate(model, leaf_only=True, backward=False) as trace:
        train_step(model, x)
    modules = {module for module, _, _ in trace.timeline}
    assert modules == {"stem", "head"} | {f"blocks.{i}.{c}" for i in range(3) for c in ("fc", "act", "fault")}
    assert all(kind == "output" for _, kind, _ in trace.timeline) and trace.events == 11
    assert trace.first is not None and trace.first.module == "blocks.1.fault"


def test_empty_block_and_reentry() -> None:
    model, _ = make()
    trace = locate(model)
    with trace:
        pass
    assert trace.events == 0 and trace.finite and "no events recorded" in str(trace)
    with trace, pytest.raises(RuntimeError, match="already active"):
        trace.__enter__()
    assert hooks_of(model) == 0


# ------------------------------------------------------------------------- hooks, model untouched


def test_exception_in_block_removes_hooks_and_propagates() -> None:
    model, x = make()
    user_hook = model.blocks[1].register_forward_hook(lambda m, i, o: None)
    before = hooks_of(model)
    with pytest.raises(ValueError, match="boom"), locate(model) as trace:
        assert hooks_of(model) > before
        train_step(model, x)
        raise ValueError("boom")
    assert hooks_of(model) == before == 1, "only the user's own hook is left"
    assert isinstance(trace, Locator) and trace.events == 40, "what was recorded stays readable"
    trace.remove()  # removing twice is harmless
    user_hook.remove()
    assert hooks_of(model) == 0


def test_exception_inside_forward_removes_hooks_and_next_locate_works() -> None:
    class Raises(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("bad shape")

    model, x = make({2: Raises()})
    with pytest.raises(RuntimeError, match="bad shape"), locate(model):
        train_step(model, x)
    assert hooks_of(model) == 0
    model.blocks[2].fault = ForwardFault()
    with locate(model) as trace:
        train_step(model, x)
    assert trace.first is not None and trace.first.module == "blocks.2.fault"
    assert hooks_of(model) == 0


def test_gradient_hooks_after_exit_record_nothing() -> None:
    model, x = make()
    with locate(model) as trace:
        out = model(x)
    assert trace.events == 15
    out.sum().backward()  # the graph's gradient hooks outlive the block, but the locator is closed
    assert trace.events == 15


def test_model_computes_the_same_with_and_without_locate() -> None:
    # The views given to modules (and shared between identical arguments, as attention checks
    # ``query is key``) must not change a single bit of the outputs or gradients.
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True, norm_first=True)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(inplace=True), layer, torch.nn.Linear(16, 1))
    x = torch.randn(2, 5, 8, requires_grad=True)

    def run() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = model(x)
        out.square().mean().backward()
        return [out.detach(), x.grad] + [p.grad for p in model.parameters()]

    plain = run()
    with locate(model) as trace:
        located = run()
    assert trace.finite and trace.events > 20
    for a, b in zip(plain, located, strict=True):
        assert torch.equal(a, b)
    assert model.training and hooks_of(model) == 0


def test_hooks_do_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # No CUDA here to count syncs, so forbid every way a tensor reaches a Python value while the
    # model runs inside the block: a hook that synced would raise.
    model, x = make({1: BackwardFault()})

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a host sync inside the locate block")

    with locate(model) as trace, monkeypatch.context() as patch:
        for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
            patch.setattr(torch.Tensor, name, forbidden)
        train_step(model, x)
    assert trace.first is not None and trace.first.module == "blocks.1.fault"


def test_reading_results_syncs_once() -> None:
    model, x = make({0: ForwardFault()})
    with locate(model) as trace:
        train_step(model, x)
    assert trace._host is None, "nothing was copied while recording"
    _ = trace.first
    host = trace._host
    _ = trace.finite, trace.origin, trace.nonfinite, str(trace)
    assert trace._host is host, "values were fetched again"


# ------------------------------------------------------------------------------ DTensors, subclasses


def test_dtensor_outputs_and_gradients_are_located(world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    styles = {"0": ColwiseParallel(use_local_output=False), "2": RowwiseParallel(use_local_output=False)}
    parallelize_module(model, init_device_mesh("cpu", (1,)), styles)  # type: ignore[arg-type]
    with torch.no_grad():
        model[2].weight.to_local()[0, 0] = math.nan
    with locate(model) as trace:
        model(torch.randn(3, 4)).full_tensor().sum().backward()
    assert not trace.finite and trace.unread == []
    assert trace.first is not None and (trace.first.module, trace.first.kind) == ("2", "output")
    assert [(f.module, f.event) for f in trace.first_by_rank() if f is not None] == [("2", trace.first.event)]
    # The gradients are DTensors too: the first layer's weight gradient, through the NaN, is an event.
    kinds = {(f.module, f.kind) for f in trace.nonfinite}
    assert ("0", "parameter-gradient") in kinds, kinds


def test_fsdp2_parameter_gradients_are_located(world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    class Gain(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.zeros(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.gain.sqrt()  # finite outputs and input-gradients; d/dgain is inf

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), Gain())
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    with locate(model) as trace:
        model(torch.randn(2, 4)).sum().backward()
    assert type(model[1].gain.grad).__name__ == "DTensor"
    assert trace.first is not None, str(trace)
    assert (trace.first.kind, trace.first.parameter) == ("parameter-gradient", "1.gain"), trace.first


class _Hides(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, OpaqueTensor(x)


def test_a_tensor_locate_cannot_read_is_listed_never_silently_finite() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), _Hides())
    with pytest.warns(UserWarning, match="cannot be scanned"), locate(model, backward=False) as trace:
        model(torch.randn(2, 4))
    assert trace.finite  # of what was read...
    assert trace.unread == [
        "forward output of `1` (_Hides), call 1: OpaqueTensor",
        "forward output of the model itself (Sequential), call 1: OpaqueTensor",
    ]
    assert "could not be read" in str(trace), str(trace)
