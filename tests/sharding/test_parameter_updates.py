"""A stream first reads the parameters its layout's model holds now, and every rank agrees on the routes or refuses.

Megatron's distributed optimizer with `overlap_param_gather` leaves the
all-gather of updated parameters to the next forward pass, so a sync right
after `optimizer.step()` would read a mix of two steps; megatron-core's
DistributedDataParallel needs CUDA, so the wrapper here is a stand-in with its
attributes (`ddp_config`, `module`, `start_param_sync(force_sync=...)`, as in
megatron-core 0.16). FSDP2 registers other tensors in its parameters' places
while unsharded, and a parameter can be replaced outright. The streams are real
(a world of one, or two gloo ranks in processes of their own)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from refit.errors import PlanMismatchError
from refit.plan import RolloutModelInfo, SyncConfig, make_plan
from refit.sharding import RankSource
from refit.sharding.dtensor_layout import DTensorLayout
from refit.sharding.megatron.layout import _overlapped_param_gathers
from refit.transport.integrity import new_sync_key
from tests.support.fakes import FP8_BLOCK
from tests.support.gloo_ranks import gloo_rank, megatron_fixture_rank, report_stream, run_two_ranks


class _Ddp(torch.nn.Module):
    def __init__(self, module: torch.nn.Module, *, distributed_optimizer: bool, overlap: bool) -> None:
        super().__init__()
        self.module = module
        self.ddp_config = SimpleNamespace(use_distributed_optimizer=distributed_optimizer, overlap_param_gather=overlap)
        self.forced: list[bool] = []

    def start_param_sync(self, *unused, force_sync: bool = False, force_dispatch: bool = False) -> None:
        self.forced.append(force_sync)


class _Gpt(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder, self.config = torch.nn.Linear(2, 2), object()


@pytest.mark.parametrize("distributed_optimizer, overlap, finished", [(True, True, True), (True, False, False),
                                                                      (False, False, False)])
def test_only_an_overlapped_gather_of_a_distributed_optimizer_is_finished(distributed_optimizer, overlap, finished):
    ddp = _Ddp(SimpleNamespace(module=_Gpt()), distributed_optimizer=distributed_optimizer, overlap=overlap)
    assert _overlapped_param_gathers(ddp) == ([ddp] if finished else [])


def test_a_stream_finishes_the_layouts_updates_before_it_reads_a_weight():
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        events: list[str] = []

        class Layout(DTensorLayout):
            def finish_parameter_updates(self) -> None:
                events.append("finish")

            def rows(self, name, start, stop):
                events.append("read")
                return super().rows(name, start, stop)

        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False)).to(torch.bfloat16)
        layout = Layout(model)
        plan = make_plan(layout.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        assert len(list(RankSource(layout).stream(plan))) == len(plan.buckets)
        assert events[0] == "finish" and events.count("finish") == 1 and "read" in events
    finally:
        torch.distributed.destroy_process_group()


def test_a_parameter_whose_data_changed_dtype_or_shape_after_planning_is_refused_by_name_before_any_part():
    """Found by review: the layout described each parameter once, so after `model.half()` (which keeps the parameter
    objects and swaps their `.data`) a stream's preflight saw the old dtype and sent every part, which the replica
    then refused at its first bucket; a shape swapped the same way was sent as well."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256)).to(torch.bfloat16)
        source = RankSource(model)
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync(new_sync_key())
        model[0].half()
        model[1].bias.data = torch.zeros(128, dtype=torch.bfloat16)
        with pytest.raises(PlanMismatchError) as refused:
            next(iter(source.stream(plan)))
        assert "0.weight: (256, 256) float16 in the trainer, (256, 256) bfloat16 in the plan" in str(refused.value)
        assert "1.bias: (128,) bfloat16 in the trainer, (256,) bfloat16 in the plan" in str(refused.value)
        assert "1.weight" not in str(refused.value)
    finally:
        torch.distributed.destroy_process_group()


def test_a_parameter_removed_after_a_sync_is_refused_by_name_before_any_part():
    """Found by review: routes agreed for a plan are kept, so after a parameter was removed the next stream skipped
    the check that names a tensor a rank's model lacks (made while agreeing them) and failed in its preflight with a
    bare `KeyError` ('1.weight'), which the other ranks re-raised as that quoted name."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
        source = RankSource(model.to(torch.bfloat16))
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        assert len(list(source.stream(plan.for_sync(new_sync_key())))) == len(plan.buckets)
        del model[1]
        with pytest.raises(PlanMismatchError, match=r"trainer rank 0's model has no 1\.weight, which the plan holds"):
            next(iter(source.stream(plan.for_sync(new_sync_key()))))
    finally:
        torch.distributed.destroy_process_group()


def _fsdp2_world_of_one(*, reshard_after_forward: bool = True) -> torch.nn.Module:
    """Two fp32 Linear layers, each sharded by FSDP2 with bf16 mixed precision (as `TrainerRank` does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    mesh, mixed = init_device_mesh("cpu", (1,)), MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mixed, reshard_after_forward=reshard_after_forward)
    return fully_shard(model, mesh=mesh, mp_policy=mixed, reshard_after_forward=reshard_after_forward)


def _streamed_equals_held(source: RankSource, model: torch.nn.Module) -> list[str]:
    """The names whose streamed bytes differ from those of the weights the model holds now (its `state_dict`)."""
    from refit.plan import loadable_tensors, produce_buckets

    plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync(new_sync_key())
    parts = list(source.stream(plan))  # before `state_dict()`, which reshards FSDP2's modules
    held = {name: value.full_tensor().to(torch.bfloat16) for name, value in model.state_dict().items()}
    wrong = []
    for part, whole in zip(parts, produce_buckets(plan, held.__getitem__), strict=True):
        got, want = dict(loadable_tensors(plan, part)), dict(loadable_tensors(plan, whole))
        wrong += [name for name in want if not torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8))]
    return wrong


def test_a_stream_sends_parameters_that_replaced_the_ones_its_source_was_made_with():
    """Found by review: the layout read the parameter objects it captured when made, so after
    `load_state_dict(..., assign=True)` (which FSDP2 adopts, as the forward then computes with the new weights)
    every sync sent the old weights, silently."""
    from torch.distributed.tensor import DTensor

    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        model = _fsdp2_world_of_one()
        source = RankSource(model, wire_dtype=torch.bfloat16)
        new = {name: DTensor.from_local(torch.randn_like(value.to_local()), value.device_mesh, value.placements)
               for name, value in model.state_dict().items()}
        model.load_state_dict(new, assign=True)
        assert _streamed_equals_held(source, model) == []
    finally:
        torch.distributed.destroy_process_group()


def test_a_source_made_while_fsdp2_holds_unsharded_parameters_sends_the_masters():
    """Found by review: with `reshard_after_forward=False`, a source made after a forward captured FSDP2's unsharded
    bf16 copies; an optimizer step changes only the sharded fp32 masters, so the sync sent the copies' old values
    (and after a reshard frees them, reading them crashed the process)."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        model = _fsdp2_world_of_one(reshard_after_forward=False)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        with torch.no_grad():
            model(torch.randn(2, 256))
        source = RankSource(model, wire_dtype=torch.bfloat16)
        for parameter in optimizer.param_groups[0]["params"]:
            parameter.grad = torch.ones_like(parameter)
        optimizer.step()
        assert _streamed_equals_held(source, model) == []
    finally:
        torch.distributed.destroy_process_group()


def _rank_lacking_a_planned_tensor(rank: int, store_path: str, outcomes) -> None:
    """Rank `rank` of 2 (gloo, 30 s group timeout): rank 1's model holds `extra.weight`, rank 0's does not."""
    from refit.plan import TensorMeta

    with gloo_rank(rank, store_path, timeout_s=30):
        layers = {"weight": torch.nn.Linear(256, 256, bias=False)} | ({"extra": torch.nn.Linear(256, 256, bias=False)} if rank else {})
        source = RankSource(torch.nn.ModuleDict(layers).to(torch.bfloat16))
        extra = TensorMeta("extra.weight", (256, 256), "bfloat16", ("Linear",))
        metas = [m for m in source.metadata() if m.name != "extra.weight"] + [extra]
        plan = make_plan(metas, RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync("s1")
        report_stream(outcomes, rank, 0, source.stream, plan)


def test_a_planned_tensor_one_rank_lacks_is_refused_by_name_on_every_rank_at_once(tmp_path):
    """Found by review: a plan holding a tensor one rank reported and another rank's model lacks (ranks whose models
    disagree) made `DTensorLayout.held` raise a bare `KeyError` inside `RankSource.routes`, before its all-gather,
    while the other rank waited there until the group's timeout (20 s of 20 s measured), which breaks a gloo group
    for good. Two real ranks (processes), gloo."""
    seen = run_two_ranks(_rank_lacking_a_planned_tensor, tmp_path, reports=2, timeout_s=120)
    for rank, _, outcome, seconds in seen:
        assert outcome.startswith("PlanMismatchError: refusing to send any weight: trainer rank 0's model has no "
                                  "extra.weight, which the plan holds"), (rank, outcome)
        assert seconds < 20, (rank, seconds)  # refused at once on both, not at the group's timeout


@contextlib.contextmanager
def _megatron_world_of_one(arch: str = "qwen3") -> Iterator[tuple[torch.nn.Module, dict]]:
    """A real megatron-core `GPTModel` of the untied `arch` fixture's shape (its parameters uninitialized), and the
    fixture's config, in a world of one over gloo."""
    import json
    from pathlib import Path

    from megatron.core import parallel_state

    from actors.megatron_group import MegatronParallel, _gpt_model, _quiet_megatron_imports
    from fixtures import model_dir
    from refit.provenance.tracker import checkpoint_tensor_names

    _quiet_megatron_imports()
    checkpoint = model_dir(False, "bf16", arch=arch)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(1)
        config = json.loads((Path(checkpoint) / "config.json").read_text())
        yield _gpt_model(config, checkpoint_tensor_names(checkpoint), MegatronParallel()), config
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _megatron_source_of_the_fixture(model: torch.nn.Module, config: dict):
    """`megatron_source` of `model`, loaded with the untied Qwen3 fixture's weights."""
    from fixtures import model_dir
    from refit.sharding.megatron import load_hf_checkpoint, megatron_source

    source = megatron_source(model, vocab_size=config["vocab_size"])
    load_hf_checkpoint(source.layout, model_dir(False, "bf16"))
    return source


def test_a_megatron_stream_sends_parameters_that_replaced_the_ones_its_source_was_made_with():
    """Found by review: `MegatronLayout` read the parameter objects it captured when made, so after
    `load_state_dict(..., assign=True)` (the model then computes with the new weights) every sync sent the old
    weights, silently. A real megatron-core `GPTModel` (the Qwen3 fixture), a world of one over gloo."""
    from refit.plan import loadable_tensors, produce_buckets
    from refit.sharding.megatron.layout import megatron_slots

    with _megatron_world_of_one() as (model, config):
        source = _megatron_source_of_the_fixture(model, config)
        model.load_state_dict({name: torch.randn_like(value) if value is not None and value.is_floating_point() else value
                               for name, value in model.state_dict().items()}, assign=True)
        layout = source.layout
        held = {slot.target: slot.read(param.detach()).to(torch.bfloat16)
                for _, param, slot in megatron_slots(layout.model, layout.dims, layout.place) if slot.sends}
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync(new_sync_key())
        wrong = []
        for part, whole in zip(source.stream(plan), produce_buckets(plan, held.__getitem__), strict=True):
            got, want = dict(loadable_tensors(plan, part)), dict(loadable_tensors(plan, whole))
            wrong += [name for name in want if not torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8))]
        assert wrong == []


def test_a_megatron_routers_expert_bias_is_sent_in_its_own_dtype_and_an_unknown_saved_buffer_is_refused_by_name():
    """Found by review: the layout read parameters only, so the router's `expert_bias` (a saved fp32 buffer that
    megatron-core trains with `moe_router_enable_expert_bias` and that picks the experts) was never sent and never
    refused: the rollouts routed without it. megatron-core makes that buffer on CUDA only, so it is registered here as
    megatron-core registers it, on a real `GPTModel` (the Qwen3-MoE fixture's shape), a world of one over gloo."""
    from refit.errors import ConfigError
    from refit.plan import loadable_tensors
    from refit.sharding.megatron import megatron_source

    with _megatron_world_of_one("qwen3_moe") as (model, config):
        torch.manual_seed(0)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.02)
        biases = {}
        for i, layer in enumerate(model.decoder.layers):
            router = layer.mlp.router
            del router.local_tokens_per_expert, router.expert_bias  # None where the expert bias is off
            router.register_buffer("local_tokens_per_expert", torch.zeros(config["num_local_experts"]), persistent=False)
            router.register_buffer("expert_bias", torch.randn(config["num_local_experts"], dtype=torch.float32))
            biases[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = router.expert_bias
        source = megatron_source(model, vocab_size=config["vocab_size"])
        metas = {m.name: m for m in source.metadata()}
        assert {name: (metas[name].shape, metas[name].dtype) for name in biases} == {
            name: ((config["num_local_experts"],), "float32") for name in biases}
        assert not any("local_tokens_per_expert" in name for name in metas)
        plan = make_plan(list(metas.values()), RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync(new_sync_key())
        sent = {name: value for part in source.stream(plan) for name, value in loadable_tensors(plan, part)}
        assert all(torch.equal(sent[name], bias) for name, bias in biases.items())

        model.decoder.layers[0].mlp.register_buffer("token_counts", torch.zeros(4))
        with pytest.raises(ConfigError, match=r"decoder\.layers\.0\.mlp\.token_counts \(4,\): refit does not know"):
            megatron_source(model, vocab_size=config["vocab_size"])


def test_a_megatron_parameter_whose_data_took_another_shape_is_refused_by_name_before_any_part():
    """Found by review: the Megatron layout re-read only parameters replaced by other objects, so a parameter whose
    `.data` was swapped for another shape in place was read through slots made for the old one. A real megatron-core
    `GPTModel` (the Qwen3 fixture), a world of one over gloo."""
    from refit.errors import ConfigError

    with _megatron_world_of_one() as (model, config):
        source = _megatron_source_of_the_fixture(model, config)
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync(new_sync_key())
        fc2 = model.decoder.layers[0].mlp.linear_fc2.weight
        fc2.data = torch.zeros(fc2.shape[0], fc2.shape[1] // 2, dtype=fc2.dtype)
        with pytest.raises(ConfigError, match=r"decoder\.layers\.0\.mlp\.linear_fc2\.weight: local shape"):
            next(iter(source.stream(plan)))


def test_a_megatron_parameter_removed_after_planning_is_refused_by_name_before_any_part():
    """Found by review: a parameter removed from the model after the plan was made simply vanished from the layout, so
    the stream routed the tensors it held as a gather no rank joins, and the rank chosen to send them failed mid-stream
    with an internal error ("its layout says it joins no gather of it") naming neither the parameter nor the cause. A
    real megatron-core `GPTModel` (the Qwen3 fixture), a world of one over gloo."""
    from refit.errors import ConfigError

    with _megatron_world_of_one() as (model, config):
        source = _megatron_source_of_the_fixture(model, config)
        plan = make_plan(source.metadata(), RolloutModelInfo(FP8_BLOCK, False), SyncConfig()).for_sync(new_sync_key())
        del model.decoder.layers[1].self_attention.q_layernorm.weight
        with pytest.raises(ConfigError, match=r"megatron parameter decoder\.layers\.1\.self_attention\.q_layernorm\."
                                              r"weight is gone from the model.*model\.layers\.1\.self_attn\.q_norm\.weight"):
            next(iter(source.stream(plan)))


def _megatron_stage_that_changes(rank: int, store_path: str, outcomes, change: str) -> None:
    """Pipeline stage `rank` of 2 (gloo, 30 s group timeout) of the Qwen3 fixture; after its source is made (`"add"`)
    or after its first stream (`"remove"`), stage 1's layer gains a parameter the mapping cannot place (as an adapter
    a job adds would be) or loses its q norm's weight. Streams three times."""
    with megatron_fixture_rank(rank, store_path, pp=2) as (model, source, metas):
        plan = make_plan(metas, RolloutModelInfo(FP8_BLOCK, False), SyncConfig())
        for attempt in range(3):
            if rank == 1 and attempt == 0 and change == "add":
                model.decoder.layers[0].self_attention.register_parameter("adapter", torch.nn.Parameter(torch.zeros(4)))
            if rank == 1 and attempt == 1 and change == "remove":  # after a stream, whose routes the source keeps
                del model.decoder.layers[0].self_attention.q_layernorm.weight
            report_stream(outcomes, rank, attempt, source.stream, plan.for_sync(b"key", f"s{attempt}", 30.0))


def test_a_megatron_parameter_the_mapping_cannot_place_added_on_one_stage_is_refused_on_every_rank_at_once(tmp_path):
    """A parameter added after the source was made, on one pipeline stage only, is refused by name on both stages, at
    once and on every later sync: read as the stream starts, its refusal on that stage alone would leave the other
    in a collective until the group's timeout, which breaks a gloo group for good. Real megatron-core, two gloo
    ranks (processes)."""
    for rank, attempt, outcome, seconds in _two_megatron_stages_changing(tmp_path, "add"):
        assert outcome.startswith("ConfigError: "), (rank, attempt, outcome)
        assert "megatron parameter decoder.layers.0.self_attention.adapter (4,): refit does not know" in outcome
        assert seconds < 20, (rank, attempt, seconds)  # refused at once on both, not at the group's timeout


def test_a_megatron_parameter_removed_on_one_stage_after_a_sync_is_refused_by_name_on_every_rank_at_once(tmp_path):
    """Found by review: the routes a source agreed for a plan are kept, so after a parameter was removed on one stage
    the next stream still made that stage send its tensor, and reading it raised a bare `KeyError` (the checkpoint
    name) there, mid-stream, while the other stage streamed on. Now both refuse before any part, naming the
    parameter, on every later sync too. Real megatron-core, two gloo ranks (processes)."""
    for rank, attempt, outcome, seconds in _two_megatron_stages_changing(tmp_path, "remove"):
        if attempt == 0:
            assert outcome.startswith("streamed"), (rank, outcome)
            continue
        assert outcome.startswith("ConfigError: "), (rank, attempt, outcome)
        assert ("megatron parameter decoder.layers.0.self_attention.q_layernorm.weight is gone from the model on "
                "trainer rank 1") in outcome, (rank, attempt, outcome)
        assert seconds < 20, (rank, attempt, seconds)


def _two_megatron_stages_changing(tmp_path, change: str) -> list[tuple]:
    """(rank, attempt, outcome, seconds) of `_megatron_stage_that_changes` on two real ranks (processes)."""
    return run_two_ranks(_megatron_stage_that_changes, tmp_path, change, reports=6)
