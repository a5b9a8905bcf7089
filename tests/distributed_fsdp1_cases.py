"""FSDP1 (torch's FullyShardedDataParallel) in real processes: run by tests/test_distributed.py.

Every sharding strategy, with ``use_orig_params`` False and True, on 2 and 4 gloo ranks, the same
batch on every rank. The references are FSDP's own: its ``clip_grad_norm_`` (the total, and the
clipped shards), and its full gradients (``summon_full_params(with_grads=True)`` of a twin with
``use_orig_params=True``, FSDP's one way to see them whole), not a plain model's: FSDP1 clamps a
hybrid strategy whose shard group is one rank to NO_SHARD over that rank, whose gradients are then
never averaged with the replicas' (and divided by the world size; see the case on it).

As in the other case files, every case makes all its collectives before its first assertion.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import Cast, assert_close, case, counted_all_reduces
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import MixedPrecision, ShardingStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy

import nanscan

STRATEGIES = list(ShardingStrategy)
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


def net(dims: tuple[int, ...] = (16, 24, 3, 5), seed: int = 0) -> torch.nn.Sequential:
    """Linear layers (a Tanh after the first): the same weights on every rank."""
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        layers.append(torch.nn.Linear(a, b))
        if i == 0:
            layers.append(torch.nn.Tanh())
    return torch.nn.Sequential(*layers)


def wrap(
    module: torch.nn.Module,
    strategy: ShardingStrategy,
    use_orig_params: bool,
    world: int,
    policy: Any = None,
    **kwargs: Any,
) -> FSDP:
    """FSDP1 with a unit per Linear (or ``policy``); the hybrid strategies on a (2, world / 2) mesh,
    two replicas of a model sharded over half the ranks, on 4 ranks or more; on 2, one replica sharded
    over both (FSDP1 clamps a shard group of one rank to NO_SHARD over that one rank, which never
    averages the replicas: fsdp1_hybrid_over_one_rank_shards_is_refused)."""
    if strategy in HYBRID:
        kwargs.setdefault("device_mesh", init_device_mesh("cpu", (2, world // 2) if world >= 4 else (1, world)))
    return FSDP(
        module,
        auto_wrap_policy=policy if policy is not None else ModuleWrapPolicy({torch.nn.Linear}),
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
        **kwargs,
    )


def backward(model: torch.nn.Module, dim: int = 16, seed: int = 1) -> None:
    torch.manual_seed(seed)
    model(torch.randn(8, dim)).float().square().mean().backward()


def full_gradients(model: FSDP) -> dict[str, torch.Tensor]:
    """FSDP's full gradients of a ``use_orig_params=True`` model, by the names the user wrote."""
    with FSDP.summon_full_params(model, with_grads=True):
        return {_clean(name): p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def gathered_full_gradients(model: FSDP) -> dict[str, torch.Tensor]:
    """FSDP's full gradients of a ``use_orig_params=False`` model gathered by hand (every rank's flat
    shard, laid end to end, cut by the flat parameter's sizes), where summon_full_params cannot
    (bf16 gradients kept by MixedPrecision: torch 2.13's FSDP refuses to unshard them), by name."""
    names = {id(m): n for n, m in model.named_modules()}
    full = {}
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat = handle.flat_param
        shards = [torch.empty_like(flat.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, flat.grad.contiguous())
        whole = torch.cat(shards)[: sum(flat._numels)]
        for info, piece, shape in zip(flat._param_infos, whole.split(list(flat._numels)), flat._shapes, strict=True):
            full[_clean(names[id(info.module)] + ".") + info.param_name] = piece.view(shape).clone()
    order = [name for name, _ in net().named_parameters()]
    return {name: full[name] for name in order}


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def local_flat_gradients(model: FSDP) -> list[torch.Tensor]:
    """Each unit's local flat gradient shard, copied."""
    return [m._handle.flat_param.grad.clone() for m in FSDP.fsdp_modules(model) if m._handle is not None]


def all_strategies() -> Iterator[tuple[ShardingStrategy, bool]]:
    for strategy in STRATEGIES:
        for use_orig_params in (False, True):
            yield strategy, use_orig_params


def assert_matches_full(report: nanscan.Report, full: dict[str, torch.Tensor], what: str) -> None:
    """The report's per-parameter statistics are those of FSDP's full gradients, every one named."""
    values = report.to_dict()["parameters"]
    assert list(values) == list(full), f"{what}: names {list(values)} != {list(full)}"
    for name, g in full.items():
        assert_close(values[name]["norm"], g.double().norm(), f"{what}: norm of {name}", 1e-6)
        assert values[name]["max"] == g.double().max().item(), f"{what}: max of {name}"
        assert values[name]["min"] == g.double().min().item(), f"{what}: min of {name}"


@case
def fsdp1_every_strategy_matches_fsdps_own(world: int) -> None:
    """check, clip_grad_norm_ (of the model, and of its parameters once seen) against FSDP's own
    clip and full gradients; collectives counted: two per check, one per clip."""
    for strategy, orig in all_strategies():
        what = f"{strategy.name}, use_orig_params={orig}"
        ours, theirs, whole = (wrap(net(), strategy, o, world) for o in (orig, orig, True))
        for model in (ours, theirs, whole):
            backward(model)
        full = full_gradients(whole)
        with counted_all_reduces() as check_calls:
            report = nanscan.check(ours)
            finite, ranks = report.finite, report.nonfinite_ranks
        with counted_all_reduces() as clip_calls:
            total = nanscan.clip_grad_norm_(ours, 0.05)
        want = theirs.clip_grad_norm_(0.05)
        # A list of the model's parameters, now that nanscan has seen the model (clipped once: its norm).
        again = nanscan.clip_grad_norm_(list(ours.parameters()), 0.05)
        want_again = theirs.clip_grad_norm_(0.05)
        # The other norm orders: inf from the fused scan, 1 and 3 from torch's norm of each part.
        orders = {
            p: (nanscan.clip_grad_norm_(ours, 1e9, p), theirs.clip_grad_norm_(1e9, p)) for p in (math.inf, 1.0, 3.0)
        }
        ours_shards, theirs_shards = local_flat_gradients(ours), local_flat_gradients(theirs)
        assert check_calls[0] == 2, f"{what}: {check_calls[0]} all-reduces for a check"
        assert clip_calls[0] == 1, f"{what}: {clip_calls[0]} all-reduces for a clip"
        assert finite and ranks == {}, what
        assert_matches_full(report, full, what)
        assert type(total) is torch.Tensor and total.dtype == want.dtype == torch.float32, (total.dtype, want.dtype)
        assert_close(total, want, f"{what}: total norm against FSDP's clip_grad_norm_", 1e-6)
        assert_close(report.total_norm, want, f"{what}: check's total norm", 1e-6)
        assert_close(again, want_again, f"{what}: the clip of the parameters' list", 1e-6)
        for order, (got, want_order) in orders.items():
            assert_close(got, want_order, f"{what}: the {order}-norm against FSDP's", 1e-5)
        for a, b in zip(ours_shards, theirs_shards, strict=True):
            assert_close(a, b, f"{what}: clipped gradient shard against FSDP's", 1e-6)


def _first_part(model: FSDP, unit: int) -> tuple[str, int] | None:
    """(the name of the first parameter with an element in this rank's shard of ``unit``, the element's
    offset in the shard), or None when the shard holds none."""
    handle = FSDP.fsdp_modules(model)[unit]._handle
    flat = handle.flat_param
    placed = [(info.offset_in_shard, i) for i, info in enumerate(flat._shard_param_infos) if info.in_shard]
    if not placed:
        return None
    offset, i = min(placed)
    module = {id(m): n for n, m in model.named_modules()}[id(flat._param_infos[i].module)]
    return f"{_clean(module + '.')}{flat._param_infos[i].param_name}", offset


@case
def fsdp1_nan_in_one_rank_part_is_named_on_every_rank(world: int) -> None:
    """A NaN planted in the last rank's local gradient (after FSDP's reduction): every rank's report
    is non-finite and names the parameter and the rank, whatever the strategy (also where the last
    rank's copy is not the one counted: NO_SHARD, the hybrid ones)."""
    bad = world - 1
    for strategy, orig in all_strategies():
        what = f"{strategy.name}, use_orig_params={orig}"
        model = wrap(net(), strategy, orig, world)
        backward(model)
        planted = _first_part(model, 2) if dist.get_rank() == bad else None  # unit 2: the second Linear
        if planted is not None:
            FSDP.fsdp_modules(model)[2]._handle.flat_param.grad[planted[1]] = math.nan
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, planted)
        report = nanscan.check(model)
        finite, nonfinite, ranks = report.finite, report.nonfinite, report.nonfinite_ranks
        try:
            nanscan.check(model, on_nonfinite="raise")
            raised = ""
        except nanscan.NonFiniteGradientError as error:
            raised = str(error)
        name = gathered[bad][0]
        assert not finite, f"{what}: a NaN on rank {bad} reported finite"
        assert nonfinite == [name], f"{what}: {nonfinite}"
        assert ranks == {name: [bad]}, f"{what}: {ranks}"
        assert f"{name} (rank {bad})" in raised, f"{what}: {raised!r}"


class Block(torch.nn.Module):
    """A decoder block's shape without attention: what transformer_auto_wrap_policy wraps."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyDecoder(torch.nn.Module):
    def __init__(self, vocab: int = 11, width: int = 8, blocks: int = 3, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(Block(width) for _ in range(blocks))
        self.head = torch.nn.Linear(width, 1)  # one output: a bias of one element, empty on most ranks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def decoder_backward(model: torch.nn.Module) -> None:
    torch.manual_seed(3)
    model(torch.randint(0, 11, (4, 6))).float().square().mean().backward()


def with_activation_checkpointing(model: torch.nn.Module) -> torch.nn.Module:
    """Each block in a checkpoint wrapper, applied to the FSDP model as Accelerate applies it."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda m: isinstance(m, Block)
    )
    return model


def framework_configurations(world: int) -> Iterator[tuple[str, Callable[[], torch.nn.Module]]]:
    """FSDP1 as Hugging Face's Trainer and Accelerate (transformer_auto_wrap_policy on the decoder's
    blocks, use_orig_params=True, bf16 MixedPrecision with fp32 reduction, activation checkpointing)
    and Lightning's FSDPStrategy (a ModuleWrapPolicy of the blocks, use_orig_params=True,
    ``precision="bf16-mixed"``'s MixedPrecision) configure it."""
    hf_policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)

    def hugging_face() -> torch.nn.Module:
        wrapped = wrap(TinyDecoder(), ShardingStrategy.FULL_SHARD, True, world, policy=hf_policy, mixed_precision=bf16)
        return with_activation_checkpointing(wrapped)

    def lightning() -> torch.nn.Module:
        lightning_bf16 = MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16
        )
        return wrap(
            TinyDecoder(),
            ShardingStrategy.FULL_SHARD,
            True,
            world,
            policy=ModuleWrapPolicy({Block}),
            mixed_precision=lightning_bf16,
        )

    def plain_fp32_no_orig() -> torch.nn.Module:
        return wrap(TinyDecoder(), ShardingStrategy.SHARD_GRAD_OP, False, world, policy=ModuleWrapPolicy({Block}))

    yield "Hugging Face / Accelerate", hugging_face
    yield "Lightning", lightning
    yield "SHARD_GRAD_OP, use_orig_params=False", plain_fp32_no_orig


@case
def fsdp1_as_the_frameworks_configure_it(world: int) -> None:
    """The decoder wrapped as the frameworks wrap it: names as the user wrote them (no FSDP or
    checkpointing prefix), every parameter on every rank (the head's one-element bias too, empty on
    most ranks), the same report from the root and from the model inside it (what Hugging Face's
    Trainer and Lightning hand their callbacks), and totals equal to FSDP's own clip."""
    want_names = [name for name, _ in TinyDecoder().named_parameters()]
    for what, make in framework_configurations(world):
        ours, theirs = make(), make()
        decoder_backward(ours)
        decoder_backward(theirs)
        root = nanscan.check(ours)
        inside = nanscan.check(ours.module)  # the model FSDP wraps: the root's handle is above it
        names, totals = root.names, (root.total_norm, inside.total_norm)
        inside_names, inside_norms = inside.names, inside.to_dict()["parameters"]
        root_norms = root.to_dict()["parameters"]
        total = nanscan.clip_grad_norm_(ours.module, 0.01)
        want = theirs.clip_grad_norm_(0.01)
        assert names == want_names, f"{what}: {names}"
        assert inside_names == want_names, f"{what}: inside the root: {inside_names}"
        assert root_norms == inside_norms, what
        assert_close(totals[0], want, f"{what}: check's total against FSDP's clip", 1e-5)
        assert_close(totals[1], want, f"{what}: check's total, inside the root", 1e-5)
        assert_close(total, want, f"{what}: clip's total against FSDP's", 1e-5)
        assert total.dtype == want.dtype, (total.dtype, want.dtype)


@case
def fsdp1_mixed_precision_and_a_bf16_unit(world: int) -> None:
    """FSDP1's MixedPrecision (gradients kept in bf16 or cast back to fp32) and a unit whose parameters
    are bf16: statistics of FSDP's full gradients, totals equal to FSDP's clip."""
    mixed = [
        ("bf16 compute, fp32 gradients", MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        (
            "bf16 gradients kept",
            MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16, keep_low_precision_grads=True),
        ),
    ]
    for what, precision in mixed:
        ours, theirs = (
            wrap(net(), ShardingStrategy.FULL_SHARD, False, world, mixed_precision=precision) for _ in range(2)
        )
        for model in (ours, theirs):
            backward(model)
        full = gathered_full_gradients(theirs)
        report = nanscan.check(ours)
        want = theirs.clip_grad_norm_(1e9)
        assert_matches_full(report, full, what)
        assert_close(report.total_norm, want, f"{what}: total against FSDP's clip", 1e-3)

    def bf16_unit() -> torch.nn.Module:
        model = net((16, 24, 8, 5))
        model[2].to(torch.bfloat16)  # the second Linear: a bf16 unit among fp32 ones
        model.insert(2, Cast(torch.bfloat16))
        model.insert(4, Cast(torch.float32))
        return wrap(model, ShardingStrategy.FULL_SHARD, True, world)

    ours, theirs = bf16_unit(), bf16_unit()
    backward(ours)
    backward(theirs)
    report = nanscan.check(ours, max_norm=1e9)
    try:
        want = theirs.clip_grad_norm_(1e9)
    except ValueError as error:
        # torch 2.10's FSDP clip refuses gradients of mixed dtypes ("Requires uniform dtype"); later
        # ones promote them. The reference is then what that clip computes, by hand: each rank's
        # local shards' sum of squares, summed over the ranks, in float64, returned as float32.
        if "uniform dtype" not in str(error):
            raise
        local = [p.grad.detach().double().pow(2).sum() for p in theirs.parameters() if p.grad is not None]
        squares = torch.stack(local).sum() if local else torch.zeros((), dtype=torch.float64)
        dist.all_reduce(squares)
        want = squares.sqrt().float()
    dtypes = {report.total_norm_tensor.dtype, want.dtype}
    assert report.names == ["0.weight", "0.bias", "3.weight", "3.bias", "5.weight", "5.bias"], report.names
    assert dtypes == {torch.float32}, dtypes
    assert_close(report.total_norm, want, "a bf16 unit: total against FSDP's clip", 1e-3)


@case
def fsdp1_grad_scaler_overflow_on_one_rank_skips_on_every_rank(world: int) -> None:
    """nanscan's GradScaler under FSDP1 (``watch(model)``): an Inf on one rank's shard only, and every
    rank skips the step and lowers the scale, as torch's ShardedGradScaler makes them; a clean step
    then steps on every rank exactly as ShardedGradScaler's does. A scaler that was not shown the
    model finds it among those the process made (nanscan.layouts.live) and skips on every rank too,
    never deciding on one rank's shard."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    bad = world - 1
    for orig in (False, True):
        what = f"use_orig_params={orig}"
        ours, theirs = (wrap(net(), ShardingStrategy.FULL_SHARD, orig, world) for _ in range(2))
        scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0**10).watch(ours)
        opt, ref_opt = torch.optim.SGD(ours.parameters(), lr=0.1), torch.optim.SGD(theirs.parameters(), lr=0.1)
        before = [p.detach().clone() for p in ours.parameters()]
        torch.manual_seed(1)
        x = torch.randn(8, 16)
        scaler.scale(ours(x).square().mean()).backward()
        if dist.get_rank() == bad:
            FSDP.fsdp_modules(ours)[1]._handle.flat_param.grad[0] = math.inf
        scaler.step(opt)
        scaler.update()
        skipped_weights = [p.detach().clone() for p in ours.parameters()]
        skipped, scale = scaler.skipped, scaler.get_scale()
        ranks = scaler.last_report.nonfinite_ranks if scaler.last_report is not None else None
        # A clean step, beside ShardedGradScaler's on the twin (which never saw the overflow), from the
        # scale ours has after its skipped step.
        reference = ShardedGradScaler("cpu", init_scale=scale)
        opt.zero_grad()
        scaler.scale(ours(x).square().mean()).backward()
        scaler.step(opt)
        scaler.update()
        reference.scale(theirs(x).square().mean()).backward()
        reference.step(ref_opt)
        reference.update()
        stepped = [
            (a.detach().clone(), b.detach().clone())
            for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
        ]
        unseen = wrap(net(), ShardingStrategy.FULL_SHARD, orig, world)
        unseen_opt = torch.optim.SGD(unseen.parameters(), lr=0.1)
        unseen_before = [p.detach().clone() for p in unseen.parameters()]
        fresh = nanscan.amp.GradScaler("cpu")
        fresh.scale(unseen(x).square().mean()).backward()
        if dist.get_rank() == bad:
            FSDP.fsdp_modules(unseen)[1]._handle.flat_param.grad[0] = math.inf
        fresh.step(unseen_opt)
        fresh.update()
        assert skipped, f"{what}: rank {dist.get_rank()} did not skip"
        assert scale == 2.0**9, f"{what}: scale {scale}"
        assert all(torch.equal(a, b) for a, b in zip(before, skipped_weights, strict=True)), (
            f"{what}: a skipped step changed weights"
        )
        assert ranks is not None and list(ranks.values()) == [[bad]], f"{what}: {ranks}"
        assert not scaler.skipped and scaler.get_scale() == reference.get_scale(), what
        for a, b in stepped:
            assert_close(a, b, f"{what}: a stepped parameter against ShardedGradScaler's", 1e-6)
        assert fresh.skipped, f"{what}: a scaler not shown the model did not skip on rank {dist.get_rank()}"
        assert all(torch.equal(a, b) for a, b in zip(unseen_before, unseen.parameters(), strict=True)), what


@case
def fsdp1_recorder_advisor_and_replicas(world: int) -> None:
    """The recorder keeps the global statistics (the rank of a NaN too); the Advisor observes the
    whole model; verify_replicas compares NO_SHARD's copies and names the rank whose copy drifted."""
    bad = world - 1
    model = wrap(net(), ShardingStrategy.FULL_SHARD, True, world)
    sink_records: list[Any] = []
    recorder = nanscan.Recorder([sink_records.append], every=10)
    reports = []
    for step in range(3):
        model.zero_grad()
        backward(model, seed=10 + step)
        if step == 1 and dist.get_rank() == bad:
            FSDP.fsdp_modules(model)[1]._handle.flat_param.grad[0] = math.nan
        reports.append(nanscan.check(model, recorder=recorder))
    recorder.close()
    advisor = nanscan.amp.Advisor()
    advisor.observe(model)
    advice = advisor.advise()
    shared = wrap(net(), ShardingStrategy.NO_SHARD, False, world)
    backward(shared)
    clean = nanscan.verify_replicas(shared, gradients=True)
    clean_ok = clean.consistent
    if dist.get_rank() == bad:
        FSDP.fsdp_modules(shared)[1]._handle.flat_param.grad[3] += 1.0
    drifted = nanscan.verify_replicas(shared, gradients=True)
    divergent = drifted.divergent
    hybrid = wrap(net(), ShardingStrategy.HYBRID_SHARD, True, world)
    backward(hybrid)
    copies = 2 if world >= 4 else 1  # two replicas of the sharded model on 4 ranks, one on 2
    if dist.get_rank() == bad:
        FSDP.fsdp_modules(hybrid)[1]._handle.flat_param.grad[0] += 1.0
    with counted_all_reduces() as calls:
        hybrid_divergent = nanscan.verify_replicas(hybrid, gradients=True).divergent
    sharded = wrap(net(), ShardingStrategy.FULL_SHARD, False, world)
    backward(sharded)
    with counted_all_reduces() as sharded_calls:
        sharded_check = nanscan.verify_replicas(sharded, gradients=True)
    names = [r.nonfinite_ranks for r in sink_records]
    assert [r.finite for r in sink_records] == [True, False, True], [r.finite for r in sink_records]
    assert names[1] == reports[1].nonfinite_ranks and list(names[1].values()) == [[bad]], names
    assert_close(
        sink_records[2].norm, [v["norm"] for v in reports[2].to_dict()["parameters"].values()], "recorded norms"
    )
    assert advisor.names == reports[0].names and advice.recommendation != "nonfinite", advice
    assert clean_ok, "NO_SHARD's copies agree after the all-reduce"
    want = [0, 1] if world == 2 else [bad]  # two copies: no majority, both named
    assert divergent == {"0.weight": want}, divergent
    # HSDP on 4 ranks: rank 3's shard has its copy on rank 1 (the same position of the other replica).
    if copies == 2:
        assert hybrid_divergent == {"0.weight": [bad - world // 2, bad]}, hybrid_divergent
    else:
        assert hybrid_divergent == {}, hybrid_divergent  # one replica: no copies to differ
    assert calls[0] == 2, f"{calls[0]} all-reduces for the hybrid replica check"
    assert sharded_check.consistent and sharded_calls[0] == 0, "FULL_SHARD's parts have no copies to compare"


@case
def fsdp1_hybrid_over_one_rank_shards_is_warned_of(world: int) -> None:
    """HYBRID_SHARD on a (world, 1) mesh: FSDP1 makes each rank NO_SHARD over itself alone, so the
    replicas are never averaged (and each rank's report is its own, as its gradients are): warned."""
    import warnings

    model = wrap(net(), ShardingStrategy.HYBRID_SHARD, False, world, device_mesh=init_device_mesh("cpu", (world, 1)))
    torch.manual_seed(20 + dist.get_rank())  # different data per rank: the replicas now differ
    model(torch.randn(8, 16)).square().mean().backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = nanscan.check(model)
    norms = report.to_dict()["parameters"]["0.weight"]["norm"]
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, norms)
    messages = [str(w.message) for w in caught if "nanscan" in str(w.message)]
    assert len(messages) == 1 and "never averages" in messages[0], messages
    assert len(set(gathered)) == world, f"each rank's own gradient: {gathered}"


def attempt(call: Callable[..., Any], *args: Any) -> Any:
    """What ``call(*args)`` returned, else its error's type and message (a str)."""
    try:
        return call(*args)
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"


def outcome(call: Callable[..., Any], *args: Any) -> str:
    """'' where ``call(*args)`` returned, else its error's type and message."""
    got = attempt(call, *args)
    return got if isinstance(got, str) else ""


def on_every_rank(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def rank_batch(dim: int = 16) -> torch.Tensor:
    """A batch of this rank's own: what data parallelism feeds each rank."""
    torch.manual_seed(100 + dist.get_rank())
    return torch.randn(8, dim)


@case
def fsdp1_ignored_modules_with_gradients_are_refused(world: int) -> None:
    """FSDP never reduces the gradients of ``ignored_modules``: with each rank on its own data each
    rank's differ, so check, the clips and the GradScaler refuse them on every rank (decided by
    ``requires_grad``, alike on every rank) rather than report one rank's as the model's; the list of
    the parameters FSDP manages is reduced as FSDP reduces them, and a frozen ignored module is no
    obstacle."""

    def make(orig: bool, frozen: bool = False) -> FSDP:
        model = TinyDecoder()
        if frozen:
            model.head.requires_grad_(False)
        return wrap(
            model,
            ShardingStrategy.FULL_SHARD,
            orig,
            world,
            policy=ModuleWrapPolicy({Block}),
            ignored_modules=[model.head],
        )

    def run(model: torch.nn.Module) -> None:
        torch.manual_seed(200 + dist.get_rank())
        model(torch.randint(0, 11, (4, 6))).float().square().mean().backward()

    for orig in (False, True):
        what = f"use_orig_params={orig}"
        ours, theirs = make(orig), make(orig)
        run(ours)
        run(theirs)
        opt = torch.optim.SGD(ours.parameters(), lr=0.1)
        scaler = nanscan.amp.GradScaler("cpu", init_scale=1.0)
        scaler.scale(torch.ones(()))  # a scale to unscale by (no need to scale the loss by 1)
        refusals = [
            outcome(nanscan.check, ours),
            outcome(nanscan.clip_grad_norm_, ours, 1e9),
            outcome(nanscan.clip_grad_norm_, list(ours.parameters()), 1e9),
            outcome(scaler.watch(ours).unscale_, opt),
        ]
        head = {id(p) for p in ours.module.head.parameters()}
        managed = [p for p in ours.parameters() if id(p) not in head]
        total = nanscan.clip_grad_norm_(managed, 1e9)
        want = theirs.clip_grad_norm_(1e9)  # the managed ones reduced, plus this rank's own head
        own_head = torch.cat([p.grad.reshape(-1) for p in theirs.module.head.parameters()]).double().norm()
        heads = on_every_rank(own_head.item())
        frozen_ours, frozen_theirs = make(orig, frozen=True), make(orig, frozen=True)
        run(frozen_ours)
        run(frozen_theirs)
        frozen = nanscan.check(frozen_ours).total_norm
        frozen_want = frozen_theirs.clip_grad_norm_(1e9)
        everywhere = on_every_rank(refusals)
        assert len(set(heads)) == world, f"{what}: the ranks' data should make their heads differ: {heads}"
        for rank_refusals in everywhere:
            for message in rank_refusals:
                assert message.startswith("ValueError") and "head.weight" in message, f"{what}: {message!r}"
                assert "FSDP never reduces" in message, f"{what}: {message!r}"
        assert_close(total, (want.double().square() - own_head.square()).sqrt(), f"{what}: the managed ones", 1e-5)
        assert_close(frozen, frozen_want, f"{what}: a frozen ignored module", 1e-5)


@case
def fsdp1_no_sync_accumulation_is_refused_on_every_rank(world: int) -> None:
    """A backward under ``model.no_sync()`` leaves each rank its own unreduced gradient (unsharded,
    for a sharded strategy): check, the clips (of the model, of its parameters), the gradients' norm
    and the GradScaler refuse it on every rank, naming no_sync, for every strategy; after the
    backward that synchronises, the accumulated gradients are reported as FSDP's own clip sees them."""
    for strategy, orig in all_strategies():
        what = f"{strategy.name}, use_orig_params={orig}"
        ours, theirs = wrap(net(), strategy, orig, world), wrap(net(), strategy, orig, world)
        nanscan.check(ours)  # seen before the accumulation (no gradient yet)
        x = rank_batch()
        for model in (ours, theirs):
            with model.no_sync():
                model(x).square().mean().backward()
        opt = torch.optim.SGD(ours.parameters(), lr=0.1)
        scaler = nanscan.amp.GradScaler("cpu", init_scale=1.0).watch(ours)
        scaler.scale(torch.ones(()))  # a scale to unscale by (no need to scale the loss by 1)
        refusals = [
            outcome(nanscan.check, ours),
            outcome(nanscan.clip_grad_norm_, ours, 1e9),
            outcome(nanscan.clip_grad_norm_, list(ours.parameters()), 1e9),
            outcome(scaler.unscale_, opt),
        ]
        if not orig:  # the flat gradients themselves (with use_orig_params, refused as views anyway)
            grads = [p.grad for p in ours.parameters() if p.grad is not None]
            refusals.append(outcome(nanscan.get_total_norm, grads))
        for model in (ours, theirs):
            model(x).square().mean().backward()  # synchronises: the accumulated gradients reduced
        total = nanscan.check(ours).total_norm
        want = theirs.clip_grad_norm_(1e9)
        everywhere = on_every_rank(refusals)
        for rank_refusals in everywhere:
            for message in rank_refusals:
                assert message.startswith("ValueError") and "no_sync()" in message, f"{what}: {message!r}"
        assert_close(total, want, f"{what}: after the synchronising backward", 1e-5)


@case
def fsdp1_gradient_lists_are_the_models(world: int) -> None:
    """``get_total_norm`` and ``scan`` given the gradients (``[p.grad for p in model.parameters() if
    p.grad is not None]``) of an FSDP1 model, the first thing nanscan is handed of it (the model is
    found among those the process made, nanscan.layouts.live): FSDP1's flat gradients
    (use_orig_params=False) are reduced as their parameters are, equal to FSDP's clip on every rank;
    the views FSDP hands out as the original parameters' (use_orig_params=True), which differ from
    rank to rank, are refused. Never one rank's shard, read as the model's."""
    for strategy, orig in all_strategies():
        what = f"{strategy.name}, use_orig_params={orig}"
        ours, theirs = wrap(net(), strategy, orig, world), wrap(net(), strategy, orig, world)
        x = rank_batch()
        for model in (ours, theirs):
            model(x).square().mean().backward()
        grads = [p.grad for p in ours.parameters() if p.grad is not None]
        got = [attempt(nanscan.get_total_norm, grads), attempt(nanscan.scan, grads)]
        mixed = outcome(nanscan.get_total_norm, [*grads, torch.ones(3)]) if not orig else ""
        want = theirs.clip_grad_norm_(1e9)
        everywhere = on_every_rank([g if isinstance(g, str) else None for g in got])
        if orig:
            for rank, messages in enumerate(everywhere):
                for message in messages:
                    assert message is not None and "use_orig_params=True" in message, f"{what}, rank {rank}: {message}"
            continue
        total, scanned = got
        assert isinstance(total, torch.Tensor), f"{what}: {total}"
        assert_close(total, want, f"{what}: get_total_norm of the flat gradients", 1e-5)
        assert_close(scanned.total_norm, want, f"{what}: scan of the flat gradients", 1e-5)
        assert list(scanned.names or ()) == [n for n, _ in net().named_parameters()], f"{what}: {scanned.names}"
        assert "not one of the FSDP1 model's" in mixed, f"{what}: {mixed!r}"


def _head_bias_optimizers(model: FSDP) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(every parameter but the last Linear's bias, that bias): with a unit per Linear and
    use_orig_params=True the bias lies at the end of its unit's flat parameter, so only the last
    rank's shard holds any of it; the other ranks hold no gradient of it."""
    named = list(model.named_parameters())
    last = named[-1][1]
    return [p for _, p in named[:-1]], [last]


@case
def fsdp1_grad_scaler_rank_without_gradients_joins_the_reduction(world: int) -> None:
    """nanscan's GradScaler on an optimizer whose parameters have no element in some ranks' shards
    (use_orig_params=True: their ``.grad`` is None there): those ranks still join the reduction, so an
    Inf on the last rank skips the step on every rank, as torch's ShardedGradScaler makes them, and a
    clean step (and the scaler's clip) matches ShardedGradScaler's."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    bad = world - 1
    ours, theirs = (wrap(net(), ShardingStrategy.FULL_SHARD, True, world) for _ in range(2))
    body, bias = _head_bias_optimizers(ours)
    ref_body, ref_bias = _head_bias_optimizers(theirs)
    opts = [torch.optim.SGD(body, lr=0.1), torch.optim.Adam(bias, lr=0.1)]
    ref_opts = [torch.optim.SGD(ref_body, lr=0.1), torch.optim.Adam(ref_bias, lr=0.1)]
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0**10).watch(ours)
    reference = ShardedGradScaler("cpu", init_scale=2.0**10)
    x = rank_batch()
    # Step 1: an Inf in the last rank's part of the bias: the bias's optimizer skips on every rank (the
    # other one steps: found_inf is per optimizer, as torch's), and the scale falls.
    for model, grad_scaler, last in ((ours, scaler, bias[0]), (theirs, reference, ref_bias[0])):
        grad_scaler.scale(model(x).square().mean()).backward()
        if dist.get_rank() == bad:
            last.grad[0] = math.inf
    holds = bias[0].grad is not None
    skips = []
    for opt in opts:
        scaler.step(opt)
        skips.append(scaler.skipped)
    scaler.update()
    for opt in ref_opts:
        reference.step(opt)
    reference.update()
    scales = (scaler.get_scale(), reference.get_scale())
    # Step 2, clean: the scaler's clip of the bias's optimizer, then both steps, beside ShardedGradScaler's.
    for opt in (*opts, *ref_opts):
        opt.zero_grad()
    scaler.scale(ours(x).square().mean()).backward()
    reference.scale(theirs(x).square().mean()).backward()
    clipped = scaler.clip_grad_norm_(opts[1], 1e9)
    for opt in opts:
        scaler.step(opt)
    scaler.update()
    reference.unscale_(ref_opts[1])
    bias_norm = (
        ref_bias[0].grad.double().square().sum()
        if ref_bias[0].grad is not None
        else torch.zeros((), dtype=torch.float64)
    )
    dist.all_reduce(bias_norm)
    for opt in ref_opts:
        reference.step(opt)
    reference.update()
    stepped = [
        (a.detach().clone(), b.detach().clone()) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True)
    ]
    held = on_every_rank(holds)
    assert not all(held), f"some rank should hold none of the bias: {held}"
    assert skips == [False, True], f"rank {dist.get_rank()}: skipped {skips}"
    assert scales == (2.0**9, 2.0**9), scales
    assert_close(clipped, bias_norm.sqrt(), "the scaler's clip of the bias's optimizer", 1e-5)
    assert scaler.get_scale() == reference.get_scale()
    for a, b in stepped:
        assert_close(a, b, "a stepped parameter against ShardedGradScaler's", 1e-6)


@case
def fsdp1_check_state_rank_without_state(world: int) -> None:
    """check_state of an optimizer whose parameters have no element in some ranks' shards (so no
    state there): every rank agrees first, and reports the state the last rank keeps; an optimizer
    without state on any rank is refused on every rank alike, and accepted after its first step."""
    model = wrap(net(), ShardingStrategy.FULL_SHARD, True, world)
    body, bias = _head_bias_optimizers(model)
    opts = [torch.optim.Adam(body, lr=0.1), torch.optim.Adam(bias, lr=0.1)]
    model(rank_batch()).square().mean().backward()
    before = outcome(nanscan.check_state, model, opts[1])
    for opt in opts:
        opt.step()
    kept = len(opts[1].state)
    report = nanscan.check_state(model, opts[1])
    name = "3.bias:exp_avg_sq"
    got = report.to_dict()["parameters"][name]["norm"]
    mine = opts[1].state[bias[0]]["exp_avg_sq"].double().norm().item() if kept else 0.0
    want = math.sqrt(sum(n * n for n in on_every_rank(mine)))
    everywhere = on_every_rank((before, kept))
    assert any(k == 0 for _, k in everywhere), f"some rank should keep no state: {everywhere}"
    for message, _ in everywhere:
        assert "no state yet on any rank" in message, message
    assert report.finite
    assert_close(got, want, f"{name} on rank {dist.get_rank()}", 1e-6)


@case
def fsdp1_check_state_matches_a_plain_twin_and_names_a_bad_moment(world: int) -> None:
    """check_state of an FSDP1 model, every strategy, use_orig_params False (the optimizer keeps flat
    shards) and True (the original parameters' parts): each parameter's values and Adam moments, cut
    and reduced over FSDP's groups, and its update ratio (watch_updates), equal those of a plain twin
    trained on the same batch; then a NaN planted in the last rank's part of one moment is named on
    every rank, with that rank."""
    bad = world - 1
    twin = net()
    twin_optimizer = torch.optim.Adam(twin.parameters(), lr=1e-2)
    backward(twin)
    before = [p.detach().double().clone() for p in twin.parameters()]
    twin_optimizer.step()
    want_ratios = {
        name: ((p.detach().double() - b).norm() / p.detach().double().norm()).item()
        for (name, p), b in zip(twin.named_parameters(), before, strict=True)
    }
    # The weights, then each parameter's moments: check_state's order, FSDP1's or not.
    want = {name: p.detach().double() for name, p in twin.named_parameters()}
    for name, p in twin.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            want[f"{name}:{key}"] = twin_optimizer.state[p][key].double()
    for strategy, orig in all_strategies():
        what = f"{strategy.name}, use_orig_params={orig}"
        model = wrap(net(), strategy, orig, world)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        updates = nanscan.watch_updates(optimizer, model)
        # Every part is under 4096 elements, so the sketches are the values: exact, through the same cut
        # and reduction.
        sketched = nanscan.watch_updates(optimizer, model, sketch=4096)
        backward(model)
        optimizer.step()
        ratios = updates.ratios()
        sketched_ratios = sketched.ratios()
        updates.remove()
        sketched.remove()
        report = nanscan.check_state(model, optimizer)
        values = report.to_dict()["parameters"]
        planted = _plant_in_moment(model, optimizer, 2) if dist.get_rank() == bad else None
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, planted)
        after = nanscan.check_state(model, optimizer)
        nonfinite, ranks = after.nonfinite, after.nonfinite_ranks
        assert report.finite, what
        assert list(ratios) == list(want_ratios), f"{what}: {list(ratios)}"
        assert list(sketched_ratios) == list(want_ratios), f"{what}: {list(sketched_ratios)}"
        for name, ratio in want_ratios.items():
            assert_close(ratios[name], ratio, f"{what}: update ratio of {name}", 1e-5)
            assert_close(sketched_ratios[name], ratio, f"{what}: update ratio of {name} from the sketches", 1e-5)
        assert list(values) == list(want), f"{what}: {list(values)}"
        for name, tensor in want.items():
            assert_close(values[name]["norm"], tensor.norm(), f"{what}: norm of {name}", 1e-6)
            assert_close(values[name]["max"], tensor.max(), f"{what}: max of {name}", 1e-6)
            assert_close(values[name]["min"], tensor.min(), f"{what}: min of {name}", 1e-6)
        name = gathered[bad]
        assert nonfinite == [name] and ranks == {name: [bad]}, f"{what}: {nonfinite} {ranks}"


def _plant_in_moment(model: FSDP, optimizer: torch.optim.Optimizer, unit: int) -> str | None:
    """A NaN in this rank's first element of ``unit``'s ``exp_avg_sq``: in the flat state of a
    ``use_orig_params=False`` unit, in the original parameter's of a ``True`` one; the moment's name."""
    first = _first_part(model, unit)
    if first is None:
        return None
    name, offset = first
    flat = FSDP.fsdp_modules(model)[unit]._handle.flat_param
    if flat._params is None:  # use_orig_params=False: the optimizer keeps the flat shard's state
        optimizer.state[flat]["exp_avg_sq"][offset] = math.nan
    else:
        placed = [i for i, info in enumerate(flat._shard_param_infos) if info.in_shard]
        first_param = min(placed, key=lambda i: flat._shard_param_infos[i].offset_in_shard)
        optimizer.state[flat._params[first_param]]["exp_avg_sq"].view(-1)[0] = math.nan
    return f"{name}:exp_avg_sq"
