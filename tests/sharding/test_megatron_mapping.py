"""The Megatron mapping as pure logic: every rank's slots tile each checkpoint tensor once, in Megatron's layouts.

A checkpoint is written into every rank's local parameters through the
slots and read back; the local parameters are also checked against
Megatron's own conventions, written out independently here (q/k/v
interleaved per query group, gate rows then up rows, row-parallel columns,
GroupedMLP's transposed expert buffers). The real megatron-core ranks are in
tests/sync/test_megatron_source.py.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from refit.errors import ConfigError
from refit.sharding.megatron import CheckpointNames, MegatronDims, RankPlace, slots_of
from refit.sharding.megatron.checkpoint import untaken

DENSE = MegatronDims(hidden=32, heads=8, query_groups=4, head_dim=8, ffn=48, vocab=61, padded_vocab=64, tied=False)
MOE = MegatronDims(hidden=32, heads=4, query_groups=2, head_dim=8, ffn=48, vocab=64, padded_vocab=64, tied=False,
                   num_experts=4, moe_ffn=16, shared_ffn=24)


def local_shape(name: str, dims: MegatronDims, place: RankPlace) -> tuple[int, ...]:
    """Megatron's local shapes, from its sharding rules (not from the mapping)."""
    tp, etp = place.tp_size, place.etp_size
    per_group = (dims.heads // dims.query_groups + 2) * dims.head_dim
    table = {
        "embedding.word_embeddings.weight": (dims.padded_vocab // tp, dims.hidden),
        "output_layer.weight": (dims.padded_vocab // tp, dims.hidden),
        "decoder.final_layernorm.weight": (dims.hidden,),
        "decoder.layers.0.input_layernorm.weight": (dims.hidden,),
        "decoder.layers.0.self_attention.q_layernorm.weight": (dims.head_dim,),
        "decoder.layers.0.self_attention.linear_qkv.weight": (dims.query_groups // tp * per_group, dims.hidden),
        "decoder.layers.0.self_attention.linear_qkv.bias": (dims.query_groups // tp * per_group,),
        "decoder.layers.0.self_attention.linear_proj.weight": (dims.hidden, dims.heads * dims.head_dim // tp),
        "decoder.layers.0.pre_mlp_layernorm.weight": (dims.hidden,),
    }
    if dims.num_experts:
        local = dims.num_experts // place.ep_size
        table |= {
            "decoder.layers.0.mlp.router.weight": (dims.num_experts, dims.hidden),
            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight": (2 * dims.moe_ffn // etp, dims.hidden),
            "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight": (dims.hidden, dims.moe_ffn // etp),
            "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": (2 * dims.shared_ffn // tp, dims.hidden),
            "decoder.layers.0.mlp.shared_experts.linear_fc2.weight": (dims.hidden, dims.shared_ffn // tp),
            "decoder.layers.0.mlp.shared_experts.gate_weight": (1, dims.hidden),
        }
        if etp == 1:
            table |= {"decoder.layers.0.mlp.experts.weight1": (dims.hidden, local * 2 * dims.moe_ffn),
                      "decoder.layers.0.mlp.experts.weight2": (local * dims.moe_ffn, dims.hidden)}
    else:
        table |= {"decoder.layers.0.mlp.linear_fc1.weight": (2 * dims.ffn // tp, dims.hidden),
                  "decoder.layers.0.mlp.linear_fc2.weight": (dims.hidden, dims.ffn // tp)}
    return table[name]


def places(tp: int, ep: int = 1, etp: int = 1) -> list[RankPlace]:
    return [RankPlace(t, tp, e, ep, x, etp) for t, e, x in itertools.product(range(tp), range(ep), range(etp))]


def round_trip(dims: MegatronDims, ranks: list[RankPlace], names: list[str]) -> tuple[dict, dict]:
    """A random checkpoint written into every rank's locals and read back: (checkpoint, what the reads rebuilt)."""
    generator = torch.Generator().manual_seed(0)
    checkpoint: dict[str, torch.Tensor] = {}
    rebuilt: dict[str, torch.Tensor] = {}
    locals_: dict = {}
    for place in ranks:
        for name in names:
            shape = local_shape(name, dims, place)
            param = locals_.setdefault((place, name), torch.full(shape, float("nan")))
            for slot in slots_of(name, shape, dims, place, lambda i: i + 5):
                full = checkpoint.setdefault(slot.target, torch.randn(slot.shape, generator=generator))
                slot.write(param, full.narrow(slot.dim, slot.start, slot.stop - slot.start))
                got = rebuilt.setdefault(slot.target, torch.full(slot.shape, float("nan")))
                got.narrow(slot.dim, slot.start, slot.stop - slot.start).copy_(slot.read(param))
    for (place, name), param in locals_.items():
        if "word_embeddings" not in name and "output_layer" not in name:  # all but vocabulary padding is written
            assert not param.isnan().any(), (place, name)
    return checkpoint, rebuilt


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_dense_layers_tile_every_checkpoint_tensor_at_every_tp(tp):
    names = [n for n in ("embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
                         "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.self_attention.q_layernorm.weight",
                         "decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.self_attention.linear_qkv.bias",
                         "decoder.layers.0.self_attention.linear_proj.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
                         "decoder.layers.0.mlp.linear_fc1.weight", "decoder.layers.0.mlp.linear_fc2.weight")]
    checkpoint, rebuilt = round_trip(DENSE, places(tp), names)
    assert set(checkpoint) == {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} | {
        f"model.layers.5.{n}" for n in ("input_layernorm.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight",
                                       "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.q_proj.bias",
                                       "self_attn.k_proj.bias", "self_attn.v_proj.bias", "self_attn.o_proj.weight",
                                       "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                       "mlp.down_proj.weight")}
    for name, value in checkpoint.items():
        assert torch.equal(rebuilt[name], value), name
    assert checkpoint["model.embed_tokens.weight"].shape == (61, 32)  # the padding rows are Megatron's alone


@pytest.mark.parametrize("name, target", [
    ("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight", "model.layers.3.input_layernorm.weight"),
    ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "model.layers.3.post_attention_layernorm.weight"),
])
def test_transformer_engines_fused_norms_are_the_checkpoints_norms(name, target):
    """Found by review: the fused norm inside `linear_qkv` was checked against linear_qkv's weight shape and refused,
    so every model built with Transformer Engine's layer spec was refused."""
    (slot,) = slots_of(name, (DENSE.hidden,), DENSE, RankPlace(tp_rank=1, tp_size=2), lambda i: i + 3)
    assert (slot.target, slot.shape) == (target, (DENSE.hidden,))


def test_qkv_rows_interleave_per_query_group_as_megatron_lays_them_out():
    place = RankPlace(tp_rank=1, tp_size=2)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    shape = local_shape(name, DENSE, place)
    q, k, v = (torch.randn(rows, 32) for rows in (64, 32, 32))
    param = torch.empty(shape)
    for slot in slots_of(name, shape, DENSE, place, lambda i: i):
        full = {"q_proj": q, "k_proj": k, "v_proj": v}[slot.target.split(".")[-2]]
        slot.write(param, full[slot.start:slot.stop])
    # Rank 1 of 2 holds query groups 2 and 3; each: its two q heads, its k head, its v head (8 rows each).
    expected = torch.cat([torch.cat([q[16 * g:16 * g + 16], k[8 * g:8 * g + 8], v[8 * g:8 * g + 8]]) for g in (2, 3)])
    assert torch.equal(param, expected)


@pytest.mark.parametrize("tp, ep, etp", [(1, 1, 1), (2, 2, 1), (1, 4, 1), (2, 2, 2)])
def test_experts_router_and_shared_experts_tile_over_expert_parallel_ranks(tp, ep, etp):
    names = ["decoder.layers.0.mlp.router.weight", "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
             "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight",
             "decoder.layers.0.mlp.shared_experts.linear_fc1.weight", "decoder.layers.0.mlp.shared_experts.linear_fc2.weight",
             "decoder.layers.0.mlp.shared_experts.gate_weight"]
    checkpoint, rebuilt = round_trip(MOE, places(tp, ep, etp), names)
    experts = sorted(n for n in checkpoint if ".mlp.experts." in n)
    # Local expert 1 of each EP rank is global expert ep_rank * (4 / ep) + 1.
    assert {int(n.split(".")[5]) for n in experts} == {e * (4 // ep) + 1 for e in range(ep)}
    assert "model.layers.5.mlp.shared_expert.gate_proj.weight" in checkpoint
    assert "model.layers.5.mlp.shared_expert_gate.weight" in checkpoint
    for name, value in checkpoint.items():
        assert torch.equal(rebuilt[name], value), name


@pytest.mark.parametrize("experts", ["local_experts", "grouped"])
def test_a_family_names_its_moe_parts_its_own_way(experts):
    """Mixtral: `block_sparse_moe.gate` routes over `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down)."""
    mixtral = dataclasses.replace(MOE, shared_ffn=0, names=CheckpointNames.for_model_type("mixtral"))
    local = {"local_experts": ["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight",
                               "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"],
             "grouped": ["decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"]}[experts]
    checkpoint, rebuilt = round_trip(mixtral, places(1, 2, 1), ["decoder.layers.0.mlp.router.weight", *local])
    numbers = [1, 3] if experts == "local_experts" else [0, 1, 2, 3]
    assert set(checkpoint) == {"model.layers.5.block_sparse_moe.gate.weight"} | {
        f"model.layers.5.block_sparse_moe.experts.{e}.{w}.weight" for e in numbers for w in ("w1", "w2", "w3")}
    for name, value in checkpoint.items():
        assert torch.equal(rebuilt[name], value), name
    assert CheckpointNames.for_model_type("qwen3_moe") == CheckpointNames() == MOE.names


def test_checkpoint_tensors_of_the_ranks_layers_that_nothing_takes_are_named():
    """What `load_hf_checkpoint` refuses: a tensor of a layer the rank holds that none of its slots reads (a model built
    without the checkpoint's biases), but not another stage's layers, another EP rank's experts, or rotary frequencies."""
    place = RankPlace(ep_rank=1, ep_size=2)
    names = ["decoder.layers.0.self_attention.linear_qkv.weight", "decoder.layers.0.mlp.router.weight",
             "decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"]  # expert 3's gate and up rows
    taken = {slot.target for name in names for slot in slots_of(name, local_shape(name, MOE, place), MOE, place, lambda i: i + 2)}
    layer = "model.layers.2."
    checkpoint = [*taken, layer + "self_attn.q_proj.bias", layer + "self_attn.rotary_emb.inv_freq",
                  layer + "mlp.experts.0.gate_proj.weight", layer + "mlp.experts.1.up_proj.weight",  # EP rank 0's
                  layer + "mlp.experts.0.down_proj.weight",  # not taken for any expert here: fc2 was never built
                  "model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight", "model.visual.layers.2.qkv.weight"]
    assert untaken(checkpoint, taken) == [layer + "mlp.experts.0.down_proj.weight", layer + "self_attn.q_proj.bias"]


def test_grouped_mlp_buffers_compute_what_the_checkpoint_experts_compute():
    """GroupedMLP multiplies `x @ weight1.view(E, H, -1)[e]` (gate columns, then up) and `h @ weight2.view(E, -1, H)[e]`."""
    place = RankPlace(ep_rank=1, ep_size=2)
    checkpoint, _ = round_trip(MOE, [place], ["decoder.layers.0.mlp.experts.weight1", "decoder.layers.0.mlp.experts.weight2"])
    w1, w2 = torch.empty(32, 2 * 2 * 16), torch.empty(2 * 16, 32)
    for name, param in (("decoder.layers.0.mlp.experts.weight1", w1), ("decoder.layers.0.mlp.experts.weight2", w2)):
        for slot in slots_of(name, tuple(param.shape), MOE, place, lambda i: i):
            slot.write(param, checkpoint[slot.target.replace("layers.0.", "layers.5.")])
    x, h = torch.randn(3, 32), torch.randn(3, 16)
    for local, expert in enumerate((2, 3)):
        fc1 = x @ w1.view(2, 32, -1)[local]
        prefix = f"model.layers.5.mlp.experts.{expert}."
        assert torch.allclose(fc1[:, :16], x @ checkpoint[prefix + "gate_proj.weight"].T, atol=1e-5)
        assert torch.allclose(fc1[:, 16:], x @ checkpoint[prefix + "up_proj.weight"].T, atol=1e-5)
        assert torch.allclose(h @ w2.view(2, -1, 32)[local], h @ checkpoint[prefix + "down_proj.weight"].T, atol=1e-5)


def test_a_tied_output_layer_is_loaded_but_never_sent():
    tied = MegatronDims(hidden=32, heads=8, query_groups=4, head_dim=8, ffn=48, vocab=61, padded_vocab=64, tied=True)
    (slot,) = slots_of("output_layer.weight", (64, 32), tied, RankPlace(), lambda i: i)
    assert slot.target == "model.embed_tokens.weight" and not slot.sends


def test_a_rank_of_padding_rows_only_holds_no_slot():
    dims = MegatronDims(hidden=32, heads=8, query_groups=4, head_dim=8, ffn=48, vocab=40, padded_vocab=64, tied=False)
    assert slots_of("embedding.word_embeddings.weight", (16, 32), dims, RankPlace(3, 4), lambda i: i) == []


@pytest.mark.parametrize("name, shape, place, message", [
    ("decoder.layers.0.self_attention.linear_qkv.weight", (128, 32), RankPlace(0, 8),
     "the query groups .num_query_groups.: 4 does not split evenly over 8 ranks"),
    ("decoder.layers.0.mlp.linear_fc1.weight", (96, 16), RankPlace(),
     r"decoder.layers.0.mlp.linear_fc1.weight: local shape \(96, 16\), expected \(96, 32\)"),
    ("decoder.layers.0.self_attention.rotary.inv_freq", (4,), RankPlace(),
     "decoder.layers.0.self_attention.rotary.inv_freq .4,.: refit does not know where it goes"),
])
def test_what_the_mapping_cannot_place_is_refused_by_name(name, shape, place, message):
    with pytest.raises(ConfigError, match=message):
        slots_of(name, shape, DENSE, place, lambda i: i)


def test_megatron_core_is_imported_only_by_a_layout_or_a_rank_that_uses_it():
    """An optional extra: importing refit, its actors and its Megatron package pulls none of megatron-core in."""
    import subprocess
    import sys

    code = ("import sys, refit, actors, refit.sharding.megatron\n"
            "print(sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_ranks_virtual_pipeline_chunks_are_refused_naming_virtual_pipeline_parallelism():
    """Found by review: Megatron builds a list of model chunks per rank under virtual pipeline parallelism, and
    `megatron_source` refused it as "list is not a megatron-core GPTModel ... it has no decoder", naming neither the
    chunks nor the setting."""
    from refit.sharding.megatron.layout import unwrap

    chunks = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    for model in (chunks, torch.nn.ModuleList(chunks)):
        with pytest.raises(ConfigError, match=r"not a list of 2 model chunks: refit does not support virtual pipeline "
                                              r"parallelism \(virtual_pipeline_model_parallel_size\)"):
            unwrap(model)
