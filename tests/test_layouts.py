"""Layouts in one process: names as the user wrote them through every wrapper, the wrappers that are
refused (before anything is read or written), and FSDP1's parameters in a world of one rank. The
layouts across real processes are in tests/distributed_cases.py and distributed_fsdp1_cases.py."""

from __future__ import annotations

import functools
import sys
import types
import weakref
from typing import Any

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

import nanscan
from nanscan import layouts
from nanscan.layouts import live
from nanscan.records import StepRecord


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.module = torch.nn.Linear(4, 4)  # a user's own attribute named "module": kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(torch.tanh(self.fc(x)))


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block())


WANT = ["0.fc.weight", "0.fc.bias", "0.module.weight", "0.module.bias", "1.fc.weight", "1.fc.bias"]
WANT += ["1.module.weight", "1.module.bias"]


def with_gradients(m: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1)
    m(torch.randn(3, 4)).square().mean().backward()
    return m


def checkpointed() -> torch.nn.Module:
    m = model()
    apply_activation_checkpointing(m, checkpoint_wrapper_fn=checkpoint_wrapper, check_fn=lambda x: isinstance(x, Block))
    assert any("_checkpoint_wrapped_module" in name for name, _ in m.named_parameters())
    return m


WRAPPED = {
    "torch.compile": lambda: torch.compile(model()),
    "activation checkpointing": checkpointed,
    "torch.compile of a checkpointed model": lambda: torch.compile(checkpointed()),
    "DataParallel": lambda: torch.nn.DataParallel(model()),
}


@pytest.mark.parametrize("wrapper", list(WRAPPED))
def test_names_are_as_the_user_wrote_them(wrapper: str) -> None:
    """Report, recorder and locate name parameters and modules without the wrappers' components, and
    keep an attribute of the user's that happens to be called ``module``."""
    m = with_gradients(WRAPPED[wrapper]())
    records: list[StepRecord] = []
    with nanscan.Recorder([records.append], every=1) as recorder:
        report = nanscan.check(m, max_norm=1.0, recorder=recorder)
    assert report.names == WANT, report.names
    assert records[0].names == WANT, records[0].names
    advisor = nanscan.amp.Advisor()
    advisor.observe(m)
    assert list(advisor.names or []) == WANT
    scaler = nanscan.amp.GradScaler("cpu").watch(m)
    assert sorted(scaler._names.values()) == sorted(WANT)
    if wrapper == "activation checkpointing":  # locate's hooks run eagerly (compile would trace them)
        with nanscan.locate(m) as trace:
            m(torch.full((3, 4), float("nan"))).sum().backward()
        assert trace.first is not None and trace.first.module in ("0", "0.fc"), trace.first


def test_ddp_names_drop_its_module(world_of_one: None) -> None:
    ddp = with_gradients(torch.nn.parallel.DistributedDataParallel(model()))
    assert nanscan.check(ddp).names == WANT
    assert list(nanscan.verify_replicas(ddp).names) == WANT


# ---- refused wrappers, planted in the shapes their packages give them (none is installed here) -----


def planted_class(module: str, name: str, base: type = torch.nn.Module) -> type:
    """A class that reads, to anything that looks at it, as ``module.name`` (the engines nanscan must
    recognise without importing them)."""
    return types.new_class(name, (base,), exec_body=lambda ns: ns.update({"__module__": module}))


ENGINES = [
    ("deepspeed.runtime.engine", "DeepSpeedEngine", "engine.get_global_grad_norm()"),
    ("deepspeed.runtime.pipe.engine", "PipelineEngine", "engine.get_global_grad_norm()"),
    ("deepspeed.runtime.pipe.dualpipev", "DualPipeVEngine", "engine.get_global_grad_norm()"),
    ("megatron.core.distributed.distributed_data_parallel", "DistributedDataParallel", "get_grad_norm"),
    ("megatron.core.distributed.fsdp.mcore_fsdp_adapter", "FullyShardedDataParallelV2", "get_grad_norm"),
    ("megatron.model.distributed", "DistributedDataParallel", "get_grad_norm"),  # before Oct 2023
    ("megatron.core.transformer.module", "Float16Module", "get_grad_norm"),
    ("fairscale.nn.data_parallel.fully_sharded_data_parallel", "FullyShardedDataParallel", "clip_grad_norm_"),
    ("fairscale.nn.data_parallel.sharded_ddp", "ShardedDataParallel", "OSS.clip_grad_norm"),
    ("colossalai.interface.model", "ModelWrapper", "get_grad_norm"),
    ("colossalai.zero.gemini.gemini_ddp", "GeminiDDP", "get_grad_norm"),
    ("torchrec.distributed.model_parallel", "DistributedModelParallel", "dense part"),
]


def engine_model(module: str, name: str) -> torch.nn.Module:
    engine = planted_class(module, name)()
    engine.module = with_gradients(model())
    return engine


def refused_calls(target: Any) -> dict[str, Any]:
    return {
        "check": lambda: nanscan.check(target, max_norm=1.0),
        "clip_grad_norm_": lambda: nanscan.clip_grad_norm_(target, 1.0),
        "verify_replicas": lambda: nanscan.verify_replicas(target),
        "Advisor.observe": lambda: nanscan.amp.Advisor().observe(target),
        "GradScaler.watch": lambda: nanscan.amp.GradScaler("cpu").watch(target),
    }


@pytest.mark.parametrize(("module", "name", "instead"), ENGINES, ids=[f"{m}.{n}" for m, n, _ in ENGINES])
def test_engines_that_shard_gradients_are_refused_before_anything_is_read(module: str, name: str, instead: str) -> None:
    engine = engine_model(module, name)
    before = [p.grad.clone() for p in engine.parameters()]
    for call_name, call in refused_calls(engine).items():
        with pytest.raises(
            ValueError, match=rf"{module}\.{name} is .*this rank holds only its part.*{instead}"
        ) as error:
            call()
        assert "process_group=" in str(error.value), call_name
    assert all(torch.equal(a, p.grad) for a, p in zip(before, engine.parameters(), strict=True))
    # A subclass of the engine is the engine too.
    subclass = planted_class("my_project.engines", "MyEngine", type(engine))()
    with pytest.raises(ValueError, match=name):
        nanscan.check(subclass)


MARKS = [
    ("megatron", "main_grad", torch.zeros(4), r"\.main_grad"),
    ("transformer_engine", "main_grad", torch.zeros(4), r"\.main_grad"),
    ("fairscale", "_is_sharded", True, "fairscale flat parameter"),
    ("colossalai", "_gemini_reduced", False, "ColossalAI Gemini parameter"),
]


@pytest.mark.parametrize(("package", "attribute", "value", "what"), MARKS, ids=[f"{p}.{a}" for p, a, _, _ in MARKS])
def test_parameters_an_engine_marked_are_refused(
    package: str, attribute: str, value: Any, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parameters the engine marks (gradients kept in .main_grad, a flat parameter's shard): refused
    wherever they are passed, once the engine's package is loaded (never otherwise: no cost)."""
    m = with_gradients(model())
    params = list(m.parameters())
    setattr(params[3], attribute, value)
    for loaded in ("deepspeed", "megatron", "transformer_engine", "fairscale", "colossalai"):
        monkeypatch.delitem(sys.modules, loaded, raising=False)  # (accelerate imports an installed deepspeed)
    assert nanscan.check(m).names == WANT  # the package is not loaded: no engine could have marked it
    monkeypatch.setitem(sys.modules, package, types.ModuleType(package))
    calls = {
        **refused_calls(m),
        "check(params)": lambda: nanscan.check(params),
        "clip_grad_norm_(params)": lambda: nanscan.clip_grad_norm_(params, 1.0),
        "scan(params)": lambda: nanscan.scan(params),
    }
    calls.pop("GradScaler.watch")  # watching reads no gradient: the scaler refuses them at its unscale
    for call_name, call in calls.items():
        with pytest.raises(ValueError, match=rf"entry 3 is .*{what}"):
            call()
        del call_name
    scaler = nanscan.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=what):
        scaler.unscale_(torch.optim.SGD(params, lr=0.1))


ZERO_MARKS = [
    ("_hp_mapping", None, "of DeepSpeed's ZeRO-1/2 or bf16 optimizer"),  # None: a rank that holds no piece
    ("ds_id", 7, "partitioned by DeepSpeed ZeRO stage 3"),
]


@pytest.mark.parametrize(("attribute", "value", "what"), ZERO_MARKS, ids=[a for a, _, _ in ZERO_MARKS])
def test_a_zero_mark_beside_parameters_no_optimizer_trains_is_refused(
    attribute: str, value: Any, what: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSpeed's ZeRO-1/2 and ZeRO-3 marks: the entry points that read gradients read ZeRO's pieces
    (tests/test_deepspeed.py), and refuse, by name, the parameters beside them that require a
    gradient which nothing reduces; the others refuse the mark."""
    m = with_gradients(model())
    params = list(m.parameters())
    setattr(params[3], attribute, value)
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    untrained = "require a gradient, but DeepSpeed's ZeRO optimizer does not train them"
    for call in (
        lambda: nanscan.check(m, max_norm=1.0),
        lambda: nanscan.clip_grad_norm_(m, 1.0),
        lambda: nanscan.check(params),
        lambda: nanscan.clip_grad_norm_(params, 1.0),
        lambda: nanscan.amp.Advisor().observe(m),
    ):
        with pytest.raises(ValueError, match=untrained):
            call()
    marked = f"entry 3 is a parameter {what}"
    for call in (lambda: nanscan.verify_replicas(m), lambda: nanscan.scan(params)):
        with pytest.raises(ValueError, match=marked):
            call()
    scaler = nanscan.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match=marked):
        scaler.unscale_(torch.optim.SGD(params, lr=0.1))


class _Stage3Optimizer:
    """DeepSpeed's ZeRO-3 optimizer as nanscan reads it (tests/test_deepspeed.py runs the real one):
    its parameter groups, its flags, its table of gradient partitions by ds_id (a name-mangled private
    attribute) and the list of them its step reads."""

    def __init__(self, params: list[torch.nn.Parameter], partitions: list[torch.Tensor]) -> None:
        self.fp16_groups = [params]
        self.offload_optimizer = self.offload_param = self.zenflow = False
        self.zero_hpz_partition_size = 1
        self.boundary = True
        self.averaged_gradients: dict[int, list[torch.Tensor] | None] = {0: partitions}
        # DeepSpeed's ``self.__param_id_to_grad_partition``, as its class mangles it (one leading _: not mangled here).
        self._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition = dict(enumerate(partitions))

    def is_gradient_accumulation_boundary(self) -> bool:
        return self.boundary


def zero3_model() -> tuple[torch.nn.Module, _Stage3Optimizer, dict[str, torch.Tensor]]:
    """A model partitioned as ZeRO-3 partitions it over one rank: each parameter a placeholder, its
    gradient in the optimizer's table, one element longer than the parameter (the padding a last rank
    holds, a NaN here that nanscan must not read). Returns the model, its optimizer and the gradients."""
    import torch.distributed as dist

    m = with_gradients(model())
    grads = {name: p.grad.clone() for name, p in m.named_parameters()}
    params = list(m.parameters())
    partitions = [torch.cat([p.grad.reshape(-1), torch.tensor([float("nan")])]) for p in params]
    optimizer = _Stage3Optimizer(params, partitions)
    for i, p in enumerate(params):
        p.ds_id, p.ds_numel, p.ds_shape = i, p.numel(), p.shape
        p.partition_numel = functools.partial(int, p.numel() + 1)  # type: ignore[attr-defined]
        p.ds_process_group = dist.group.WORLD
        p._z3_optimizer = optimizer
        p.grad = None
        p.data = torch.empty(0)  # the placeholder ZeRO-3 leaves between forwards
    return m, optimizer, grads


def test_zero_3_partitions_are_read_without_their_padding_and_refused_where_they_are_not_the_models(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ZeRO-3's partitions, each ending in padding: read without it (the figures are the gradients'),
    clipped in place; and every state in which they are not the model's gradient, or that nanscan
    does not read, refused by check and clip alike."""
    monkeypatch.setitem(sys.modules, "deepspeed", types.ModuleType("deepspeed"))
    m, optimizer, grads = zero3_model()
    report = nanscan.check(m, max_norm=1e9)
    assert report.finite and list(report.names) == WANT  # the padding's NaN left out
    want = torch.stack([g.double().norm() for g in grads.values()])
    assert torch.allclose(report.stats.norm, want, rtol=1e-6)
    whole = [g.numel() for g in grads.values()]  # the parameters' sizes, not their placeholders'
    assert layouts.numels(layouts.of_module(m)) == whole
    # A clip scales the partitions in place, which the step reads.
    total = float(nanscan.clip_grad_norm_(m, 0.5))
    assert total == pytest.approx(float(want.norm()), rel=1e-6)
    table = vars(optimizer)["_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"]
    assert torch.allclose(table[0][:-1], grads["0.fc.weight"].reshape(-1) * (0.5 / (total + 1e-6)))

    window = "not the model's now"
    refusals: list[tuple[str, Any, str]] = [
        ("boundary", False, window),  # between the micro-batches of a window
        ("averaged_gradients", {0: None}, window),  # after the step
        ("averaged_gradients", {}, window),  # before any backward
        ("offload_optimizer", True, "offload"),
        ("offload_param", True, "offload"),
        ("zenflow", True, "ZenFlow"),
        ("zero_hpz_partition_size", 2, "hierarchical partitioning"),
        (
            "fp16_groups",
            [list(m.parameters())[1:]],
            "0.fc.weight require a gradient, but DeepSpeed's ZeRO optimizer does not train them",
        ),
        ("_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition", None, "no table of gradient partitions"),
    ]
    for attribute, value, message in refusals:
        kept = vars(optimizer)[attribute]
        setattr(optimizer, attribute, value)
        for call in (lambda: nanscan.check(m), lambda: nanscan.clip_grad_norm_(m, 1.0)):
            with pytest.raises(ValueError, match=message):
                call()
        setattr(optimizer, attribute, kept)
    table[2] = table[2][:-1]  # a partition of another size than the parameter says
    with pytest.raises(ValueError, match="a layout this version of nanscan does not know"):
        nanscan.check(m)
    for p in m.parameters():
        p._z3_optimizer = None  # zero.Init alone: partitioned, with no optimizer
    with pytest.raises(ValueError, match="without one ZeRO-3 optimizer"):
        nanscan.check(m)


# ---- FSDP1 in a world of one rank -----------------------------------------------------------------


def fsdp1(m: torch.nn.Module, use_orig_params: bool) -> torch.nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        return FullyShardedDataParallel(
            m,
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )


def forget_the_models_made(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes nanscan unaware of the DDP and FSDP1 models made so far, as it is of a model made without
    its constructor (copied): nanscan.layouts.live."""
    monkeypatch.setattr(live, "_ddp_models", weakref.WeakSet())
    monkeypatch.setattr(live, "_fsdp1_undecided", weakref.WeakSet())
    monkeypatch.setattr(live, "_looked", [True])


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_parameters_are_the_models_and_refused_only_where_their_model_is_unknown(
    world_of_one: None, use_orig_params: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A list of FSDP1's parameters is a rank's shards: reduced as the model is, without the model ever
    being passed (nanscan knows the FSDP1 models the process makes, nanscan.layouts.live); where
    nanscan cannot know the model, refused before anything is written, naming the way out."""
    wrapped = with_gradients(fsdp1(model(), use_orig_params))
    reference = with_gradients(model())
    params = list(wrapped.parameters())
    before = [p.grad.clone() for p in params if p.grad is not None]
    with monkeypatch.context() as unknown:
        forget_the_models_made(unknown)
        for call in (
            lambda: nanscan.clip_grad_norm_(params, 1e-3),
            lambda: nanscan.check(params),
            lambda: nanscan.scan(params),
            lambda: nanscan.amp.Advisor().observe(params),
        ):
            with pytest.raises(ValueError, match=r"FSDP1 \(FullyShardedDataParallel\) has flattened and sharded"):
                call()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, (p for p in params if p.grad is not None), strict=True))
    assert nanscan.check(params).names == WANT  # the model never passed: found among those made
    total = nanscan.clip_grad_norm_(params, 1e9)
    report = nanscan.check(wrapped)
    assert report.names == WANT
    for values, p in zip(report.to_dict()["parameters"].values(), reference.parameters(), strict=True):
        assert values["norm"] == pytest.approx(p.grad.norm().item(), rel=1e-6)
    assert total.item() == pytest.approx(report.total_norm, rel=1e-6)
    assert nanscan.scan(params).names == tuple(WANT)  # the parameters' values, named
    weights = nanscan.verify_replicas(wrapped)  # the parameters' values, by their parts
    assert weights.consistent and list(weights.names) == WANT


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_a_model_inside_one_fsdp1_unit(
    world_of_one: None, use_orig_params: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model inside a root-only FSDP1 (no auto-wrap: one unit, outside the model) holds the unit's
    flat parameter, or its original parameters marked flattened, and no unit: the root's report of
    those parameters, the root found among the models made; refused where nanscan cannot know it."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        root = FullyShardedDataParallel(model(), use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    with_gradients(root)
    inner = root.module
    with monkeypatch.context() as unknown:
        forget_the_models_made(unknown)
        with pytest.raises(ValueError, match="flattened and sharded"):
            nanscan.check(inner)
    found = nanscan.check(inner).to_dict()
    whole = nanscan.check(root)
    assert whole.names == WANT
    assert found == whole.to_dict()


def test_the_ddp_and_fsdp1_models_made_are_known_by_their_construction_or_one_look(
    world_of_one: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nanscan.layouts.live: a DDP model and every FSDP1 unit are noted as they are made (a module-
    registration hook); those made while the hook was absent (before nanscan's import) by one look
    through the live objects, the first time they are asked for, and never again; weakly."""
    import gc

    from torch.distributed.fsdp import FullyShardedDataParallel

    monkeypatch.setattr(live, "_looked", [True])  # no look: only the hook can know what is made now
    made = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    assert made in live.ddp_models()
    live._hook.remove()  # as before nanscan's import
    try:
        before_import = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
            unit = FullyShardedDataParallel(torch.nn.Linear(4, 2), device_id=torch.device("cpu"))
    finally:
        live._hook = torch.nn.modules.module.register_module_module_registration_hook(live._registered)
    looks: list[None] = []
    real = gc.get_objects
    monkeypatch.setattr(gc, "get_objects", lambda *a, **k: looks.append(None) or real(*a, **k))
    live._looked.clear()  # the look is due again (the list is the one patched above)
    assert before_import in live.ddp_models() and made in live.ddp_models()
    assert unit in live._fsdp1_undecided and unit not in live.unseen_fsdp1_roots()  # no forward yet
    unit(torch.randn(3, 4)).sum().backward()
    assert unit in live.unseen_fsdp1_roots()  # FSDP made it the root at its first forward
    live.seen(unit)
    assert unit not in live.unseen_fsdp1_roots()
    assert len(looks) == 1, f"{len(looks)} looks through the live objects"
    plain = torch.nn.Sequential(torch.nn.Linear(4, 2))
    assert plain not in live._ddp_models and plain not in live._fsdp1_undecided
    gone = weakref.ref(made)
    del made
    gc.collect()
    assert gone() is None, "knowing a model keeps it alive"


def test_the_module_registration_hook_keeps_no_class_alive() -> None:
    """Every module made meets nanscan.layouts.live's hook, and torch.fx makes a class per GraphModule:
    the FSDP1 check's answers per class are kept weakly, so 200 traces leave no class behind."""
    import gc

    from nanscan.layouts import fsdp1

    m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
    gc.collect()
    before = len(fsdp1._is_fsdp1)
    for _ in range(200):
        traced = torch.fx.symbolic_trace(m)
    del traced
    gc.collect()
    assert len(fsdp1._is_fsdp1) <= before + 2, f"{len(fsdp1._is_fsdp1) - before} classes kept"
