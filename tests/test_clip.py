"""clip_grad_norm_ / get_total_norm as drop-ins for torch.nn.utils: values, dtypes, errors, edge inputs."""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import pytest
import torch

import nanscan

from conftest import DEVICES

NORM_TYPES = [0.5, 1.0, 1.5, 2.0, 4.0, math.inf, -math.inf, 0.0, "inf"]


def make_params(device: str, dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(300, 7), (7,), (5, 5, 5), (1,), (65537,)]
    params = []
    for i, shape in enumerate(shapes):
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).to(device=device, dtype=dtype))
        p.grad = torch.randn(shape, generator=gen).to(device=device, dtype=dtype) * (i + 1)
        params.append(p)
    params.append(torch.nn.Parameter(torch.ones(3, device=device, dtype=dtype)))  # grad None: skipped
    return params


def twin(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor | None]:
    return [p.grad for p in params]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", NORM_TYPES)
@pytest.mark.parametrize("max_norm", [1e-2, 1e6])
def test_clip_matches_torch(device: str, norm_type: float, max_norm: float) -> None:
    ours = make_params(device)
    theirs = twin(ours)
    got = nanscan.clip_grad_norm_(ours, max_norm, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert got.dtype == want.dtype and got.device == want.device and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=2e-6, atol=0)
    for a, b in zip(grads(ours), grads(theirs), strict=True):
        if a is None:
            assert b is None
        else:
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-30)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_clip_other_dtypes(device: str, dtype: torch.dtype, norm_type: float) -> None:
    ours = make_params(device, dtype)
    theirs = twin(ours)
    got = nanscan.clip_grad_norm_(ours, 1.0, norm_type)
    want = torch.nn.utils.clip_grad_norm_(theirs, 1.0, norm_type)
    assert got.dtype == want.dtype == dtype
    # torch rounds each per-tensor norm to the low-precision dtype before combining; nanscan rounds once.
    rtol = {torch.float64: 1e-12, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=0)
    if norm_type in (2.0, math.inf):  # the norms nanscan computes itself: correctly rounded once
        fresh = [p.grad.double().flatten() for p in make_params(device, dtype) if p.grad is not None]
        exact = torch.linalg.vector_norm(torch.cat(fresh), norm_type)
        assert got.item() == pytest.approx(exact.to(dtype).item(), rel=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_no_clip_leaves_gradients_untouched(device: str) -> None:
    params = make_params(device)
    before = [p.grad.clone() for p in params if p.grad is not None]
    pointers = [p.grad.data_ptr() for p in params if p.grad is not None]
    nanscan.clip_grad_norm_(params, 1e9)
    after = [p.grad for p in params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert pointers == [p.grad.data_ptr() for p in params if p.grad is not None]
    # What each backend promises about version counters (clip.py): on the CPU the coefficient is
    # known on the host, so a no-clip call leaves them alone; on CUDA the kernel decides on the
    # device, so every call counts as one write of each gradient, as torch's own clip (which always
    # multiplies) does. The values are untouched either way.
    versions = [p.grad._version for p in params if p.grad is not None]
    nanscan.clip_grad_norm_(params, 1e9)
    bumped = 1 if device == "cuda" else 0
    assert [v + bumped for v in versions] == [p.grad._version for p in params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["eager", "inference_mode"])
def test_a_clip_that_writes_counts_one_write_of_each_gradient(device: str, mode: str) -> None:
    """A clip that scales bumps each gradient's version once, as torch's in-place multiply does, so
    that autograd sees the change in a tensor it saved. Eager calls skip the op's Python
    ADInplaceOrView kernel and bump the versions themselves (nanscan._ops._direct; the guard they run
    under hides the CPU kernel's own _foreach_mul_ from that key); inside inference mode the call goes
    through the dispatcher's kernel. Both count one write, and scale as torch does."""
    params, theirs = make_params(device), make_params(device)
    versions = [p.grad._version for p in params if p.grad is not None]
    with torch.inference_mode() if mode == "inference_mode" else contextlib.nullcontext():
        nanscan.clip_grad_norm_(params, 1e-3)
        torch.nn.utils.clip_grad_norm_(theirs, 1e-3)
    assert [v + 1 for v in versions] == [p.grad._version for p in params if p.grad is not None]
    for mine, torchs in zip(params, theirs, strict=True):
        if mine.grad is not None:
            torch.testing.assert_close(mine.grad, torchs.grad, rtol=1e-6, atol=0)


def test_a_clip_refuses_an_inference_gradient_before_writing_any() -> None:
    """torch's refusal of an in-place write to an inference tensor outside inference mode, with every
    gradient left as it was: the eager path's check (nanscan._ops._direct) sends the call to the
    dispatcher's kernel, which refuses."""
    params = make_params("cpu")
    with torch.inference_mode():
        params[1].grad = params[1].grad.clone()
    before = [p.grad.clone() for p in params if p.grad is not None]
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        nanscan.clip_grad_norm_(params, 1e-3)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in params if p.grad is not None], strict=True))


@pytest.mark.parametrize("device", DEVICES)
def test_get_total_norm_matches_torch(device: str) -> None:
    tensors = [p.grad for p in make_params(device) if p.grad is not None]
    for norm_type in NORM_TYPES:
        torch.testing.assert_close(
            nanscan.get_total_norm(tensors, norm_type),
            torch.nn.utils.get_total_norm(tensors, norm_type),
            rtol=2e-6,
            atol=0,
        )
    single = tensors[0]
    torch.testing.assert_close(nanscan.get_total_norm(single), torch.nn.utils.get_total_norm(single))
    assert torch.equal(nanscan.get_total_norm([]), torch.nn.utils.get_total_norm([]))


def test_single_tensor_generator_and_empty_inputs() -> None:
    p = make_params("cpu")[0]
    q = twin([p])[0]
    torch.testing.assert_close(nanscan.clip_grad_norm_(p, 0.1), torch.nn.utils.clip_grad_norm_(q, 0.1))
    torch.testing.assert_close(p.grad, q.grad)
    params = make_params("cpu")
    others = twin(params)
    torch.testing.assert_close(
        nanscan.clip_grad_norm_((x for x in params), 0.1), torch.nn.utils.clip_grad_norm_((x for x in others), 0.1)
    )
    with pytest.warns(UserWarning, match="empty generator"):
        assert nanscan.clip_grad_norm_((x for x in []), 1.0).item() == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nanscan.clip_grad_norm_([], 1.0).item() == 0.0
    no_grads = [torch.nn.Parameter(torch.ones(2))]
    assert nanscan.clip_grad_norm_(no_grads, 1.0).item() == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_norm_and_error_if_nonfinite(device: str) -> None:
    for bad in (math.nan, math.inf):
        ours = make_params(device)
        ours[1].grad[3] = bad
        theirs = twin(ours)
        got = nanscan.clip_grad_norm_(ours, 1.0)
        want = torch.nn.utils.clip_grad_norm_(theirs, 1.0)
        torch.testing.assert_close(got, want, equal_nan=True)
        for a, b in zip(grads(ours), grads(theirs), strict=True):
            if a is not None:
                torch.testing.assert_close(a, b, equal_nan=True)
        ours = make_params(device)
        ours[1].grad[3] = bad
        before = [p.grad.clone() for p in ours if p.grad is not None]
        with pytest.raises(RuntimeError, match="non-finite"):
            nanscan.clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(twin(ours), 1.0, error_if_nonfinite=True)
        for a, b in zip(before, [p.grad for p in ours if p.grad is not None], strict=True):
            torch.testing.assert_close(a, b, equal_nan=True)


def test_inf_norm_of_empty_tensor_raises_like_torch() -> None:
    t = [torch.empty(0), torch.ones(3)]
    with pytest.raises(RuntimeError, match=r"infinity norm|inf norm"):
        torch.nn.utils.get_total_norm(t, math.inf)
    with pytest.raises(RuntimeError, match=r"infinity norm|inf norm"):
        nanscan.get_total_norm(t, math.inf)
    assert nanscan.get_total_norm(t, 2.0).item() == pytest.approx(math.sqrt(3))


def test_foreach_argument_accepted() -> None:
    for foreach in (None, True, False):
        params = make_params("cpu")
        others = twin(params)
        torch.testing.assert_close(
            nanscan.clip_grad_norm_(params, 0.5, foreach=foreach),
            torch.nn.utils.clip_grad_norm_(others, 0.5, foreach=foreach),
        )


@pytest.mark.parametrize(
    "max_norm, error",
    [(-1.0, "non-negative"), (math.nan, "non-negative"), ("abc", "could not convert")],
)
def test_bad_max_norm_raises_before_touching_gradients(max_norm: object, error: str) -> None:
    params = make_params("cpu")
    before = [p.grad.clone() for p in params if p.grad is not None]
    with pytest.raises(ValueError, match=error):
        nanscan.clip_grad_norm_(params, max_norm)  # type: ignore[arg-type]
    assert all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in params if p.grad is not None], strict=True))


@pytest.mark.parametrize("norm_type", ["fro", None, [2.0], object()])
def test_bad_norm_type_raises_like_torch(norm_type: object) -> None:
    params = make_params("cpu")
    grads = [p.grad for p in params if p.grad is not None]
    before = [g.clone() for g in grads]
    with pytest.raises(Exception) as theirs:
        torch.nn.utils.get_total_norm([g.clone() for g in grads], norm_type)  # type: ignore[arg-type]
    with pytest.raises(theirs.type, match="norm_type must be a real number or 'inf'"):
        nanscan.clip_grad_norm_(params, 1.0, norm_type)  # type: ignore[arg-type]
    with pytest.raises(theirs.type, match="norm_type must be a real number or 'inf'"):
        nanscan.get_total_norm(grads, norm_type)  # type: ignore[arg-type]
    assert all(torch.equal(a, g) for a, g in zip(before, grads, strict=True))


@pytest.mark.parametrize(
    "norm_type",
    [np.float32(2.0), np.float64(math.inf), np.int64(1), np.int32(3), True, "inf", "2", torch.tensor(2.0), 2],
    ids=repr,
)
def test_norm_type_accepts_what_torch_accepts(norm_type: object) -> None:
    """torch takes ``float(norm_type)``: numpy scalars, bools (True is the 1-norm), numeric strings."""
    params = make_params("cpu")
    twins = twin(params)
    got = nanscan.clip_grad_norm_(params, 0.5, norm_type)  # type: ignore[arg-type]
    want = torch.nn.utils.clip_grad_norm_(twins, 0.5, norm_type)  # type: ignore[arg-type]
    torch.testing.assert_close(got, want)
    for p, t in zip(params, twins, strict=True):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, t.grad)
    grads = [t.grad for t in twins if t.grad is not None]
    torch.testing.assert_close(
        nanscan.get_total_norm(grads, norm_type), torch.nn.utils.get_total_norm(grads, norm_type)
    )  # type: ignore[arg-type]


def test_non_tensor_parameter_is_named() -> None:
    with pytest.raises(TypeError, match="entry 1 of parameters is a str"):
        nanscan.clip_grad_norm_([torch.nn.Parameter(torch.ones(1)), "weight"], 1.0)  # type: ignore[list-item]


def test_dtypes_the_scan_does_not_read_behave_exactly_like_torch() -> None:
    complex_grads = [torch.randn(10, dtype=torch.complex64), torch.randn(3, dtype=torch.complex64)]
    torch.testing.assert_close(nanscan.get_total_norm(complex_grads), torch.nn.utils.get_total_norm(complex_grads))
    ints = [torch.ones(3, dtype=torch.int64)]
    with pytest.raises(RuntimeError, match="floating point or complex"):
        torch.nn.utils.get_total_norm(ints)
    with pytest.raises(RuntimeError, match="floating point or complex"):
        nanscan.get_total_norm(ints)
    with pytest.raises(TypeError, match="entry 1 is a str"):
        nanscan.get_total_norm([torch.ones(1), "x"])  # type: ignore[list-item]


@pytest.mark.parametrize("norm_type", [1.0, 3.0, 0.5, 2.0, math.inf])
def test_assigning_over_torchs_get_total_norm_does_not_recurse(
    norm_type: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Users monkeypatch drop-ins; nanscan delegates to the torch function it took at import."""
    params = make_params("cpu")
    grads_ = [p.grad for p in params if p.grad is not None]
    want = torch.nn.utils.get_total_norm(grads_, norm_type)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", nanscan.get_total_norm)
    torch.testing.assert_close(torch.nn.utils.get_total_norm(grads_, norm_type), want)
    torch.testing.assert_close(nanscan.clip_grad_norm_(params, 1e30, norm_type), want)
    torch.testing.assert_close(nanscan.check(params, norm_type=norm_type).total_norm_tensor, want)


def test_expanded_gradient_is_refused_before_any_gradient_is_scaled() -> None:
    """torch's clip scales the entries before a stride-0 gradient and then raises; nanscan validates
    every entry first, raises the same error, and leaves all gradients as they were."""
    params = make_params("cpu")
    params[3].grad = torch.full((1,), 5.0).expand(1)  # one element: writable
    params.append(torch.nn.Parameter(torch.ones(4)))
    params[-1].grad = torch.full((1,), 5.0).expand(4)  # four elements, one memory location
    theirs = twin(params)
    theirs[-1].grad = torch.full((1,), 5.0).expand(4)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor") as torch_error:
        torch.nn.utils.clip_grad_norm_(theirs, 1e-3)
    assert not torch.equal(theirs[0].grad, params[0].grad), "torch scaled the first gradient before raising"
    before = [None if p.grad is None else p.grad.clone() for p in params]
    with pytest.raises(type(torch_error.value), match="more than one element of the written-to tensor"):
        nanscan.clip_grad_norm_(params, 1e-3)
    with pytest.raises(RuntimeError, match="more than one element of the written-to tensor"):
        nanscan.check(params, max_norm=1e-3)
    for p, b in zip(params, before, strict=True):
        assert (p.grad is None and b is None) or torch.equal(p.grad, b)


@pytest.mark.parametrize("device", DEVICES)
def test_create_graph_gradient_after_a_no_clip_call(device: str) -> None:
    """A gradient saved by a create_graph=True graph (a gradient penalty): torch's clip always writes,
    so the penalty's backward raises; nanscan's no-clip call writes nothing, and on the CPU leaves the
    version alone (no error), while on CUDA it counts as a write (clip.py), like torch's."""

    def penalty_after(clip: object) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 2).to(device)
        loss = model(torch.randn(3, 4, device=device)).square().sum()
        grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        penalty = sum(g.square().sum() for g in grads)
        clip(model.parameters(), 1e9)  # type: ignore[operator]
        penalty.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        penalty_after(torch.nn.utils.clip_grad_norm_)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            penalty_after(nanscan.clip_grad_norm_)
    else:
        penalty_after(nanscan.clip_grad_norm_)
