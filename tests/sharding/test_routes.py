"""Routing a plan over the ranks of a sharded trainer: pure logic, real plans of the fixture models."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fixtures import model_dir
from refit.plan import RolloutModelInfo, SyncConfig, describe_weights, make_plan
from refit.sharding import Route, route_tensors


def plan(quantize_on: str = "trainer", arch: str = "qwen3"):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir(False, "bf16", arch=arch)))
    rollout = RolloutModelInfo.from_checkpoint(model_dir(False, "fp8_block", arch=arch), from_files=True)
    return make_plan(describe_weights(model), rollout, SyncConfig(bucket_bytes=1 << 20, quantize_on=quantize_on))


def fsdp_rows(the_plan, world: int) -> list[dict]:
    """What FSDP2's Shard(0) gives: torch.chunk of the rows over the ranks."""
    held = [{} for _ in range(world)]
    for t in the_plan.tensors:
        rows = t.shape[0]
        size = -(-rows // world)
        for rank in range(world):
            start, stop = min(rank * size, rows), min((rank + 1) * size, rows)
            if stop > start:
                held[rank][t.target] = (start, stop)
    return held


def test_block_aligned_shards_send_their_own_rows_and_split_blocks_are_gathered():
    the_plan = plan()
    routes = route_tensors(the_plan, fsdp_rows(the_plan, 2))
    q, k = routes["model.layers.0.self_attn.q_proj.weight"], routes["model.layers.0.self_attn.k_proj.weight"]
    assert q.route is Route.ROWS and q.rows == {0: (0, 128), 1: (128, 256)}  # 256 rows: one block each
    assert k.route is Route.GATHER and len(k.senders) == 1  # 128 rows: 64 each would split the block
    assert routes["model.embed_tokens.weight"].route is Route.ROWS  # bf16: any row split will do
    assert routes["model.norm.weight"].route is Route.ROWS


def test_rollout_side_quantization_never_needs_a_gather():
    the_plan = plan("rollout")
    routes = route_tensors(the_plan, fsdp_rows(the_plan, 2))
    assert {r.route for r in routes.values()} == {Route.ROWS}


def test_owners_of_gathered_tensors_alternate_so_no_rank_sends_everything():
    the_plan = plan()
    routes = route_tensors(the_plan, fsdp_rows(the_plan, 2))
    owners = [r.senders[0] for r in routes.values() if r.route is Route.GATHER]
    assert len(owners) == 4 and sorted(owners) == [0, 0, 1, 1]  # k and v of 2 layers


def test_a_tensor_one_rank_holds_whole_is_sent_by_it_alone():
    the_plan = plan(arch="qwen3_moe")
    held = [{}, {}]
    for t in the_plan.tensors:  # expert parallel: experts 0-1 on rank 0, 2-3 on rank 1; the rest replicated
        expert = int(t.target.split(".experts.")[1].split(".")[0]) if ".experts." in t.target else None
        for rank in range(2):
            if expert is None or expert // 2 == rank:
                held[rank][t.target] = (0, t.shape[0])
    routes = route_tensors(the_plan, held)
    assert routes["model.layers.1.mlp.experts.3.up_proj.weight"].senders == (1,)
    assert routes["model.layers.1.mlp.experts.0.up_proj.weight"].senders == (0,)
    assert all(r.route is Route.WHOLE for r in routes.values())
    replicated = [r.senders[0] for t, r in routes.items() if ".experts." not in t]
    assert 0 in replicated and 1 in replicated


def test_column_shards_gaps_and_overlaps_are_gathered():
    the_plan = plan()
    name = "model.layers.0.mlp.down_proj.weight"
    for held in ([{name: None}, {}], [{name: (0, 128)}, {name: (200, 256)}], [{name: (0, 200)}, {name: (128, 256)}]):
        assert route_tensors(the_plan, held)[name].route is Route.GATHER
