"""The op layer: opcheck, torch.compile, the fake implementation, and bad input to the raw op and to scan()."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import nanscan

from conftest import DEVICES, FLOAT_DTYPES, FP8_DTYPES, random_tensor


def finite_samples(device: str) -> list[list[torch.Tensor]]:
    return [
        [random_tensor(n, dtype, device) for n, dtype in [(17, torch.float32), (4096 + 3, torch.bfloat16)]],
        [torch.randn(3, 5, device=device, dtype=torch.float64).t(), torch.randn((), device=device)],
        [random_tensor(70_000, torch.float16, device)],
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_scan(device: str) -> None:
    for sample in finite_samples(device):
        torch.library.opcheck(torch.ops.nanscan.scan.default, (sample,))


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_scale(device: str) -> None:
    for coef in (0.5, 1.0):
        tensors = [torch.randn(33, device=device), torch.randn(4, 4, device=device)]
        torch.library.opcheck(torch.ops.nanscan.scale_.default, (tensors, torch.tensor(coef, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph(device: str) -> None:
    def health(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = nanscan.scan(grads)
        return r.total_norm * 2, r.finite, r.nan_count.sum()

    compiled = torch.compile(health, fullgraph=True)
    grads = [torch.randn(100, device=device), torch.randn(7, 3, device=device, dtype=torch.bfloat16)]
    grads[0][5] = math.nan
    got = compiled(grads)
    want = health(grads)
    assert math.isnan(got[0].item()) and math.isnan(want[0].item())
    assert got[1].item() is False and got[2].item() == 1
    grads[0][5] = 1.0
    torch.testing.assert_close(compiled(grads)[0], health(grads)[0])


@pytest.mark.parametrize("device", DEVICES)
def test_torch_compile_fullgraph_beside_a_registered_fsdp2_state(device: str) -> None:
    """A process that holds an FSDP2 module (torch's registry of fully_shard states non-empty) still
    traces scan and the clip whole: the layouts' look at that registry stays outside the graph. On
    torch 2.11 dynamo cannot test a WeakKeyDictionary for truth, and fullgraph=True failed there
    (found on an H200, 2026-11-28)."""
    composable_state = pytest.importorskip("torch.distributed._composable_state")
    holder = torch.nn.Linear(2, 2)
    composable_state._insert_module_state(holder, composable_state._State())
    try:

        def health(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            r = nanscan.scan(grads)
            return r.total_norm, nanscan.clip_grad_norm_(grads, max_norm=1e9)

        compiled = torch.compile(health, fullgraph=True, backend="eager")
        grads = [torch.randn(100, device=device), torch.randn(7, 3, device=device, dtype=torch.bfloat16)]
        got, want = compiled(grads), health(grads)
        torch.testing.assert_close(got[0], want[0])
        torch.testing.assert_close(got[1], want[1])
    finally:
        composable_state._module_state_mapping.pop(holder, None)


def test_the_wrappers_write_calls_off_the_cpu_count_as_the_dispatchers() -> None:
    """nanscan._ops.scale_ and unscale_scan_ call the op below its Python ADInplaceOrView kernel off the
    CPU and bump the versions themselves (NOTES.md entry 49): one write per tensor a call, as the
    kernel's own path counts, and an inference tensor still refused before anything is written. Run
    here on meta tensors (the fake kernels), the one device beside the CPU that every machine has; the
    CUDA tests check the same on a GPU."""
    from nanscan import _ops

    factor = torch.tensor(0.5, device="meta")
    for direct, through_dispatcher in (
        (_ops.scale_, _ops.scale_op),
        (_ops.unscale_scan_, _ops.unscale_scan_op),
    ):
        bumps = []
        for call in (direct, through_dispatcher):
            tensors = [torch.empty(3, device="meta"), torch.empty(2, 5, device="meta")]
            before = [t._version for t in tensors]
            call(tensors, factor)
            bumps.append([t._version - v for t, v in zip(tensors, before, strict=True)])
        assert bumps[0] == bumps[1] == [1, 1], (direct.__name__, bumps)
        with torch.inference_mode():
            frozen = torch.empty(3, device="meta")
        plain = torch.empty(3, device="meta")
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            direct([plain, frozen], factor)
        assert plain._version == 0


def same_value(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal dtype and value, a NaN equal to a NaN."""
    return got.dtype == want.dtype and bool(torch.equal(got, want) or (got.isnan() & want.isnan()).item())


@pytest.mark.parametrize("device", DEVICES)
def test_total_norm_cast_has_torchs_dtype_and_rounding(device: str) -> None:
    """The op's total_norm_cast is total_norm.to(<torch's dtype of the total norm>), bit for bit, for
    every pair of dtypes (the C++ promotion against nanscan._ops.norm_dtype, and against torch's own
    get_total_norm where torch has a norm) and for norms that round, overflow or are NaN/Inf."""
    from nanscan.dtypes import norm_dtype

    dtypes = FLOAT_DTYPES + FP8_DTYPES
    for first in dtypes:
        for second in dtypes:
            tensors = [random_tensor(5, first, device), random_tensor(3, second, device, scale=3.0)]
            *_, total_norm, _, cast = torch.ops.nanscan.scan(tensors)
            assert cast.dtype == norm_dtype({first, second}), (first, second)
            if first not in FP8_DTYPES and second not in FP8_DTYPES:
                assert cast.dtype == torch.nn.utils.get_total_norm(tensors).dtype, (first, second)
            assert same_value(cast, total_norm.to(cast.dtype)), (first, second, total_norm, cast)
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for scale in (1e-30, 1e-6, 1.0, 3e2, 1e4, 1e30):
            for _ in range(20):  # random norms: each a rounding from float64
                values = torch.randn(int(torch.randint(1, 9, (), generator=generator)), generator=generator)
                tensors = [(values * scale).to(dtype).to(device)]
                *_, total_norm, _, cast = torch.ops.nanscan.scan(tensors)
                assert same_value(cast, total_norm.to(dtype)), (dtype, scale, tensors, total_norm, cast)
        for special in (math.nan, math.inf, 0.0):
            *_, total_norm, _, cast = torch.ops.nanscan.scan([torch.tensor([special, 1.0], dtype=dtype, device=device)])
            assert same_value(cast, total_norm.to(dtype)), (dtype, special)
    # Rounding twice, as torch does: c10::Half takes a float, so a double becomes a float first. This
    # norm (two float16 tensors: exact squares, summed exactly in float64) is 0x1.0ca00079fbf30p+1;
    # as a float it is 0x1.0ca000p+1, a tie of float16's last bit, which goes to even: 0x1.0c8p+1,
    # where rounding the double once would give 0x1.0ccp+1.
    tensors = [
        torch.tensor([1.9853515625], dtype=torch.float16, device=device),
        torch.tensor([0.68017578125], dtype=torch.float16, device=device),
    ]
    *_, total_norm, _, cast = torch.ops.nanscan.scan(tensors)
    assert total_norm.item() == float.fromhex("0x1.0ca00079fbf30p+1")
    assert cast.item() == float.fromhex("0x1.0c8p+1") == total_norm.to(torch.float16).item()


def test_raw_op_errors_name_the_index() -> None:
    good = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Long"):
        torch.ops.nanscan.scan([good, torch.ones(3, dtype=torch.int64)])
    # No tensor, no device to dispatch on: the composite (nanscan.composite) answers, as the kernels would.
    with pytest.raises(RuntimeError, match=r"nanscan\.scan: expected at least one tensor"):
        torch.ops.nanscan.scan([])
    with pytest.raises(RuntimeError, match="coef must have one element"):
        torch.ops.nanscan.scale_([good], torch.ones(2))


@pytest.mark.parametrize(
    "bad, error, match",
    [
        (3.0, TypeError, "entry 1 is a float, not a torch.Tensor"),
        (None, TypeError, "entry 1 is a NoneType"),
        (torch.ones(2, dtype=torch.complex64), TypeError, "entry 1 has complex dtype"),
        (torch.ones(2, dtype=torch.int32), TypeError, "entry 1 has integer/bool dtype"),
        (torch.ones(2, dtype=torch.bool), TypeError, "entry 1 has integer/bool dtype"),
        (torch.ones(2, 2).to_sparse_csr(), TypeError, "entry 1 is a torch.sparse_csr tensor"),
        (torch.ones(2, device="meta"), ValueError, "entry 1 is a meta tensor"),
    ],
)
def test_scan_bad_input(bad: object, error: type, match: str) -> None:
    """(Sparse COO tensors are scanned exactly: tests/test_scan.py; the op itself refuses them.)"""
    with pytest.raises(error, match=match):
        nanscan.scan([torch.ones(3), bad])  # type: ignore[list-item]


def test_scan_names_in_errors() -> None:
    with pytest.raises(TypeError, match=r"'layer\.bias' \(entry 1\)"):
        nanscan.scan([torch.ones(1), torch.ones(1, dtype=torch.int8)], names=["layer.weight", "layer.bias"])


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rules(device: str) -> None:
    e4m3 = torch.tensor([0x7F, 0xFF, 0x7E, 0xFE, 0x78, 0x01, 0x00], dtype=torch.uint8, device=device).view(
        torch.float8_e4m3fn
    )
    r = nanscan.scan([e4m3])
    assert r.nan_count.item() == 2 and r.inf_count.item() == 0  # no Inf in e4m3fn; 0x7e is 448, finite
    assert r.max.item() == 448.0 and r.min.item() == -448.0
    e5m2 = torch.tensor([0x7C, 0xFC, 0x7D, 0x7B, 0x01], dtype=torch.uint8, device=device).view(torch.float8_e5m2)
    r = nanscan.scan([e5m2])
    assert r.inf_count.item() == 2 and r.nan_count.item() == 1 and r.max.item() == 57344.0
    for dtype in FP8_DTYPES:
        all_bits = torch.arange(256, dtype=torch.uint8, device=device).view(dtype)
        ref = all_bits.float()
        finite = ref[torch.isfinite(ref)]
        r = nanscan.scan([all_bits])
        assert r.nan_count.item() == int(torch.isnan(ref).sum()) and r.inf_count.item() == int(torch.isinf(ref).sum())
        assert (r.min.item(), r.max.item()) == (finite.min().item(), finite.max().item())


def test_every_half_bit_pattern_decodes_exactly() -> None:
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        values = bits.view(dtype)
        ref = values.double()
        for start in range(0, 65536, 1024):  # one scan per slice, so min/max pin down every decoded value
            part = values[start : start + 1024]
            r = nanscan.scan([part])
            sub = ref[start : start + 1024]
            fin = sub[torch.isfinite(sub)]
            assert r.nan_count.item() == int(torch.isnan(sub).sum())
            assert r.inf_count.item() == int(torch.isinf(sub).sum())
            if fin.numel():
                assert (r.min.item(), r.max.item()) == (fin.min().item(), fin.max().item())
            if fin.numel() == sub.numel():
                assert r.norm.item() == pytest.approx(float(fin.square().sum().sqrt()), rel=1e-6, abs=1e-300)


@pytest.mark.parametrize("device", DEVICES)
def test_multi_device_lists_group_by_device(device: str) -> None:
    if device == "cpu":
        pytest.skip("needs two devices: exercised with cuda + cpu")
    tensors = [torch.ones(4, device=device), torch.full((4,), 2.0), torch.tensor([math.nan], device=device)]
    r = nanscan.scan(tensors)
    assert r.norm.device.type == device
    assert r.norm[:2].tolist() == [2.0, 4.0] and r.nan_count.tolist() == [0, 0, 1] and not bool(r.finite)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_unscale_scan_and_fp16_range(device: str) -> None:
    for sample in finite_samples(device):
        torch.library.opcheck(torch.ops.nanscan.scan.default, (sample,), {"fp16_range": True})
        grads = [t for t in sample if t.dtype not in FP8_DTYPES]
        torch.library.opcheck(torch.ops.nanscan.unscale_scan_.default, (grads, torch.tensor(0.5, device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_are_not_differentiable(device: str) -> None:
    """The ops declare themselves non-differentiable (an Autograd kernel), so a scan of tensors that
    require grad returns plain tensors, not ones with a grad_fn that fails on backward."""
    x = torch.randn(5, 3, device=device, requires_grad=True)
    y = (x * 2).sum(0)  # a non-leaf, with a grad_fn of its own
    r = nanscan.scan([x, y])
    for name in ("nan_count", "inf_count", "min", "max", "norm", "total_norm", "finite", "total_norm_cast"):
        out = getattr(r, name)
        assert out.grad_fn is None and not out.requires_grad, name
    outputs = torch.ops.nanscan.unscale_scan_([torch.randn(4, device=device)], torch.tensor(0.5, device=device))
    assert len(outputs) == 5 and not any(t.requires_grad for t in outputs)
    # opcheck's autograd-registration test needs inputs that require grad.
    for sample in finite_samples(device):
        torch.library.opcheck(torch.ops.nanscan.scan.default, ([t.clone().requires_grad_() for t in sample],))


@pytest.mark.parametrize("device", DEVICES)
def test_scale_validates_every_entry_before_writing(device: str) -> None:
    """An expanded (stride-0) entry cannot be written; scale_ refuses the list with torch's message and
    leaves the entries before it unchanged (torch's clip would have scaled them already)."""
    good = torch.randn(10, device=device)
    before = good.clone()
    expanded = torch.randn(1, device=device).expand(6)
    with pytest.raises(
        RuntimeError, match="more than one element of the written-to tensor refers to a single memory location"
    ):
        torch.ops.nanscan.scale_([good, expanded], torch.tensor(0.5, device=device))
    assert torch.equal(good, before)
    fp8 = torch.zeros(4, device=device).to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match=r"tensors\[1\] is float8"):
        torch.ops.nanscan.scale_([good, fp8], torch.tensor(0.5, device=device))
    with pytest.raises(RuntimeError, match=r"tensors\[1\] has dtype Long"):
        torch.ops.nanscan.scale_(
            [good, torch.ones(3, dtype=torch.int64, device=device)], torch.tensor(0.5, device=device)
        )
    with pytest.raises(RuntimeError, match="more than one element"):
        torch.ops.nanscan.unscale_scan_([good, expanded], torch.tensor(0.5, device=device))
    assert torch.equal(good, before)


def test_names_must_match_the_tensors() -> None:
    with pytest.raises(ValueError, match="got 1 names for 2 tensors"):
        nanscan.scan([torch.ones(2), None], names=["x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="got 3 names for 2 tensors"):
        nanscan.scan([torch.ones(2), torch.ones(3)], names=["a", "b", "c"])


def test_tensors_without_strides_reaching_a_kernel_are_refused_by_name() -> None:
    """The dispatcher sends a call with a sparse argument to the sparse backend, which nanscan does not
    register; called on the CPU kernels directly, the library reads a tensor's sizes only once it knows
    the tensor is strided, and refuses the rest by name, with nothing written."""
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    t = torch.ones(3)
    sparse_factor = torch.tensor([0.5]).to_sparse()
    with pytest.raises(RuntimeError, match=r"nanscan.scale_: coef must be a dense \(strided\) tensor, got Sparse"):
        torch.ops.nanscan.scale_.default.redispatch(cpu, [t], sparse_factor)
    with pytest.raises(RuntimeError, match=r"inv_scale must be a dense \(strided\) tensor, got Sparse"):
        torch.ops.nanscan.unscale_scan_.default.redispatch(cpu, [t], sparse_factor)
    rows, counter = torch.zeros(4, 3), torch.zeros((), dtype=torch.int64)
    record = torch.ops.nanscan.record_.default
    with pytest.raises(RuntimeError, match=r"rows has layout Sparse; expected a dense \(strided\) tensor"):
        record.redispatch(cpu, rows.to_sparse(), counter, [t], None, [])
    with pytest.raises(RuntimeError, match=r"counter must be a one-element int64 tensor, got Long of shape Sparse"):
        record.redispatch(cpu, rows, torch.tensor([1]).to_sparse(), [t], None, [])
    assert torch.equal(t, torch.ones(3)) and not rows.any() and counter.item() == 0


def test_a_build_without_cuda_says_so_at_the_first_cuda_call() -> None:
    """Without the CUDA library of torch's CUDA, nanscan registers CUDA kernels that name the cause,
    what the install holds and the fix, in place of the dispatcher's "Could not run 'nanscan::scan'
    with arguments from the 'CUDA' backend"."""
    from nanscan import _ops

    if _ops.cuda_library is not None:
        pytest.skip("this install has the CUDA library of torch's CUDA")
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)  # the CUDA kernels, called on CPU tensors
    t = torch.ones(3)
    calls = [
        lambda: torch.ops.nanscan.scan.default.redispatch(cuda, [t], False),
        lambda: torch.ops.nanscan.scale_.default.redispatch(cuda, [t], torch.tensor(0.5)),
        lambda: torch.ops.nanscan.unscale_scan_.default.redispatch(cuda, [t], torch.tensor(0.5)),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"holds no CUDA library for torch .*; it holds: .*CUDA_HOME"):
            call()
    assert torch.equal(t, torch.ones(3))


def _scan_counts_in_torchscript(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.ops.nanscan.scan(tensors, False, False)[0]


def test_list_ops_from_several_threads_and_from_a_thread_python_never_saw() -> None:
    """A list op takes the GIL once to free its tensor handles, on a thread Python knows
    (csrc/torch_api.cpp, TensorListArg): Python threads scanning at once neither deadlock nor mix
    their answers, and a thread of torch's own (TorchScript's fork, on the inter-op pool) still runs
    the op and frees its handles."""
    import threading

    torch.manual_seed(0)
    lists = [[torch.randn(7) for _ in range(50 + k)] for k in range(4)]
    for k, tensors in enumerate(lists):
        tensors[k][1] = math.nan
    want = [torch.ops.nanscan.scan.default(t)[0] for t in lists]
    got: dict[int, list[torch.Tensor]] = {k: [] for k in range(len(lists))}

    def scan_many(k: int) -> None:
        for _ in range(200):
            got[k].append(torch.ops.nanscan.scan.default(lists[k])[0])

    threads = [threading.Thread(target=scan_many, args=(k,)) for k in range(len(lists))]
    for thread in threads:
        thread.start()
    scan_many(0)  # the main thread too
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a scan thread never finished: a deadlock on the GIL?"
    for k, results in got.items():
        assert all(torch.equal(r, want[k]) for r in results)
    with warnings.catch_warnings():  # TorchScript is deprecated; its fork is what runs an op on torch's own thread
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(_scan_counts_in_torchscript)
        future = torch.jit._fork(scripted, lists[2])
        assert torch.equal(torch.jit._wait(future), want[2])
