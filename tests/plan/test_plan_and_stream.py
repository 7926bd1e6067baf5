"""The transfer plan and both stream ends, without Ray or an engine.

The rollout side is described by the real fixture configs, the trainer side
by real transformers models, so names and module classes are the real ones.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from fixtures import model_dir
from refit.errors import ConfigError, InvalidTensorError, PlanMismatchError
from refit.plan import RolloutModelInfo, SyncConfig, TensorMeta, describe_weights, loadable_tensors, make_plan, produce_buckets
from refit.plan.transfer_plan import TransferPlan, bucket_bound
from refit.quantizer import quantize_fp8_block
from refit.quantizer.fp8_block import loadable_form
from refit.transport.buckets import pack_bucket
from refit.transport.integrity import new_sync_key


def rollout_model(tied: bool, quantized: bool) -> RolloutModelInfo:
    config = json.loads((model_dir(tied, "fp8_block" if quantized else "bf16") / "config.json").read_text())
    return RolloutModelInfo.from_hf_config(config)


def config(bucket_bytes: int, quantize_on: str = "trainer") -> SyncConfig:
    return SyncConfig(bucket_bytes=bucket_bytes, quantize_on=quantize_on)


def trainer_model(tied: bool) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir(tied, "bf16"), dtype=torch.bfloat16)


def lookup(model: torch.nn.Module):
    return dict(model.named_parameters(remove_duplicate=False)).__getitem__


def test_plan_quantizes_exactly_the_linears_and_orders_buckets_by_layer():
    model = trainer_model(tied=True)
    plan = make_plan(describe_weights(model), rollout_model(True, True), config(200_000))
    names = [t.target for t in plan.tensors]
    assert names[0] == "model.embed_tokens.weight"
    assert names.index("model.layers.0.mlp.down_proj.weight") < names.index("model.layers.1.self_attn.q_proj.weight")
    assert names[-1] == "model.norm.weight"
    quantized = {t.target for t in plan.tensors if t.is_quantized}
    assert len(quantized) == 14 and all(n.endswith("_proj.weight") for n in quantized)
    # The tied alias is loaded from the embedding's bytes, never sent again (and not quantized: ignored by config).
    assert plan.copies == (("lm_head.weight", "model.embed_tokens.weight"),) and "lm_head.weight" not in names
    assert plan.targets[-1] == "lm_head.weight"
    sizes = [[t.wire_bytes(plan.quantize_on) for t in bucket] for bucket in plan.buckets]
    bounds = [bucket_bound(i, 200_000) for i in range(len(sizes))]
    assert bounds[:3] == [50_000, 100_000, 200_000] and len(sizes) > 3  # the first two ramp up
    for bucket, bound, following in zip(sizes, bounds, sizes[1:] + [[]]):
        assert len(bucket) == 1 or sum(bucket) <= bound  # bounded, except a tensor bigger than its bucket travels alone
        assert not following or sum(bucket) + following[0] > bound  # greedy: the next tensor did not fit
    assert plan.wire_bytes < 0.6 * sum(t.source_bytes for t in plan.tensors)


def test_tied_engine_and_a_state_dict_without_lm_head_gets_the_alias():
    metas = [m for m in describe_weights(trainer_model(tied=True)) if m.name != "lm_head.weight"]
    plan = make_plan(metas, rollout_model(True, True), config(1 << 20))
    assert dict(plan.copies)["lm_head.weight"] == "model.embed_tokens.weight"


def test_a_plan_is_encoded_once_and_each_process_decodes_it_once_whatever_the_sync():
    """Every sync hands the plan to every member; the text is the plan's, made once, and a receiver's decoding of a
    text it has seen is its earlier plan with the new sync's key."""
    plan = make_plan(describe_weights(trainer_model(tied=True)), rollout_model(True, True), config(200_000))
    first, second = plan.for_sync(new_sync_key(), "sync-a", 60), plan.for_sync(new_sync_key(), "sync-b", 7.5)
    assert first.to_plain()["plan"] is second.to_plain()["plan"]
    arrived = [pickle.loads(pickle.dumps(sent)) for sent in (first, second)]  # as over Ray
    assert arrived == [first, second] and [p.integrity_key for p in arrived] == [first.integrity_key, second.integrity_key]
    assert [(p.sync_id, p.timeout_s) for p in arrived] == [("sync-a", 60), ("sync-b", 7.5)]
    assert arrived[1].buckets is arrived[0].buckets and arrived[1].to_plain()["plan"] is arrived[0].to_plain()["plan"]
    over_http = TransferPlan.from_plain(json.loads(json.dumps(second.to_plain())))  # as to a server's workers
    assert over_http == second and (over_http.integrity_key, over_http.sync_id, over_http.timeout_s) == (
        second.integrity_key, "sync-b", 7.5)
    assert TransferPlan.from_plain(plan.for_sync(None).to_plain()).integrity_key is None


def test_data_that_is_not_a_plan_is_refused_as_such():
    text = make_plan(describe_weights(trainer_model(tied=True)), rollout_model(True, True), config(200_000)).to_plain()["plan"]
    no_sync = {"sync_id": None, "timeout_s": None}
    for bad in ([], {"plan": text}, {"plan": text, "integrity_key": None}, {"plan": 5, "integrity_key": None, **no_sync},
                {"plan": "{", "integrity_key": None, **no_sync}, {"plan": json.dumps({"buckets": []}), "integrity_key": None, **no_sync},
                {"plan": text, "integrity_key": "not hex", **no_sync},
                {"plan": json.dumps({"quantize_on": "trainer", "buckets": [[["w", "w", "3", "bfloat16", None]]], "copies": []}),
                 "integrity_key": None, **no_sync},
                {"plan": text, "integrity_key": None, "sync_id": 5, "timeout_s": 60},
                {"plan": text, "integrity_key": None, "sync_id": "a", "timeout_s": "60"},
                {"plan": text, "integrity_key": None, "sync_id": "a", "timeout_s": float("nan")},
                {"plan": text, "integrity_key": None, "sync_id": "a", "timeout_s": None}):
        with pytest.raises(PlanMismatchError, match="not a transfer plan"):
            TransferPlan.from_plain(bad)
    assert TransferPlan.from_plain({"plan": text, "integrity_key": None, "sync_id": "a", "timeout_s": 60}).sync_id == "a"


def test_a_quantized_target_that_is_not_2d_is_refused_at_plan_time():
    metas = describe_weights(trainer_model(tied=False))
    bad = [
        TensorMeta(m.name, (m.shape[0] * m.shape[1],), m.dtype, m.module_classes) if m.name.endswith("up_proj.weight") else m
        for m in metas
    ]
    with pytest.raises(InvalidTensorError) as error:
        make_plan(bad, rollout_model(False, True), config(1 << 20))
    assert "model.layers.0.mlp.up_proj.weight" in str(error.value) and "model.layers.1.mlp.up_proj.weight" in str(error.value)


@pytest.mark.parametrize("quantize_on", ["trainer", "rollout"])
def test_buckets_carry_what_the_quantizer_makes(quantize_on):
    model = trainer_model(tied=False)
    plan = make_plan(describe_weights(model), rollout_model(False, True), config(300_000, quantize_on)).for_sync(new_sync_key())
    received = dict(t for b in produce_buckets(plan, lookup(model)) for t in loadable_tensors(plan, b))
    q, s = quantize_fp8_block(model.model.layers[1].mlp.gate_proj.weight.detach())
    assert torch.equal(received["model.layers.1.mlp.gate_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(received["model.layers.1.mlp.gate_proj.weight_scale"], s)
    assert torch.equal(received["model.norm.weight"], model.model.norm.weight.detach())
    assert len(received) == len(plan.tensors) + 14


def test_a_changed_model_is_refused_before_any_bucket_with_every_mismatch_listed():
    model = trainer_model(tied=False)
    plan = make_plan(describe_weights(model), rollout_model(False, True), config(1 << 20))
    params = dict(model.named_parameters())
    params["model.norm.weight"] = torch.zeros(128, dtype=torch.bfloat16)
    params["model.layers.0.self_attn.o_proj.weight"] = params["model.layers.0.self_attn.o_proj.weight"].float()
    del params["lm_head.weight"]
    stream = produce_buckets(plan, params.__getitem__)
    with pytest.raises(PlanMismatchError) as error:
        next(stream)
    message = str(error.value)
    for name in ("model.norm.weight", "model.layers.0.self_attn.o_proj.weight", "lm_head.weight"):
        assert name in message


def test_non_finite_values_anywhere_are_refused_before_any_bucket():
    model = trainer_model(tied=False)
    plan = make_plan(describe_weights(model), rollout_model(False, True), config(1 << 20))
    with torch.no_grad():
        model.model.layers[1].post_attention_layernorm.weight[5] = float("inf")
    with pytest.raises(InvalidTensorError, match=r"model\.layers\.1\.post_attention_layernorm\.weight: holds NaN or Inf"):
        next(produce_buckets(plan, lookup(model)))


def test_a_tensor_without_values_or_not_a_tensor_is_refused_by_name_before_any_bucket():
    """A parameter left on the meta device (an offloaded or never materialized model), a sparse tensor, or a lookup
    that returns something else failed the preflight with torch's own error, naming no tensor."""
    model = trainer_model(tied=False)
    plan = make_plan(describe_weights(model), rollout_model(False, True), config(1 << 20))
    params = dict(model.named_parameters())
    params["model.layers.0.self_attn.q_proj.weight"] = torch.empty(256, 256, dtype=torch.bfloat16, device="meta")
    params["model.norm.weight"] = params["model.norm.weight"].detach().to_sparse()
    params["model.layers.1.input_layernorm.weight"] = params["model.layers.1.input_layernorm.weight"].tolist()
    with pytest.raises(PlanMismatchError) as error:
        next(produce_buckets(plan, params.__getitem__))
    message = str(error.value)
    assert "model.layers.0.self_attn.q_proj.weight: on the meta device" in message
    assert "model.norm.weight: a sparse_coo tensor; refit sends dense tensors" in message
    assert "model.layers.1.input_layernorm.weight: a list, not a torch.Tensor" in message


def test_metadata_a_weight_source_writes_by_hand_is_checked_naming_each_tensor():
    """A torch.dtype failed as `attribute name must be string`, an alias of a name nobody reports as a bare KeyError,
    and a list shape as a mismatch with the rollout's equal tuple ("[256, 256] from the trainer, (256, 256)")."""
    metas = describe_weights(trainer_model(tied=False))
    by_hand = [dataclasses.replace(m, shape=list(m.shape)) for m in metas]  # a list is the shape it lists
    assert make_plan(by_hand, checked(False, from_files=True), config(1 << 20)).tensors == \
        make_plan(metas, checked(False, from_files=True), config(1 << 20)).tensors
    q, norm = "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"
    bad = [dataclasses.replace(m, dtype=torch.bfloat16) if m.name == q else
           dataclasses.replace(m, shape=(-256,)) if m.name == norm else m for m in metas]
    bad += [TensorMeta("lm_head.bias", (512,), "bfloat16", ("Linear",), alias_of="lm_head.b"), ("a", (1,))]
    with pytest.raises(PlanMismatchError) as error:
        make_plan(bad, checked(False, from_files=True), config(1 << 20))
    message = str(error.value)
    assert f"{q}: dtype torch.bfloat16, expected torch's name as a str" in message
    assert f"{norm}: shape (-256,), expected a tuple of non-negative ints" in message
    assert "lm_head.bias: alias_of='lm_head.b', which the trainer does not report" in message
    assert f"entry {len(metas) + 1}: a tuple, not a refit.TensorMeta" in message


# -- the plan checked against the rollout's own weights (before any byte moves) ---------------------------------


def checked(tied: bool, *, from_files: bool) -> RolloutModelInfo:
    return RolloutModelInfo.from_checkpoint(model_dir(tied, "fp8_block"), from_files=from_files)


@pytest.mark.parametrize("from_files", [True, False], ids=["checkpoint-headers", "config-only"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_a_matching_trainer_passes_the_rollout_check(tied, from_files):
    plan = make_plan(describe_weights(trainer_model(tied)), checked(tied, from_files=from_files), config(1 << 20))
    assert set(plan.targets) == {n for n, _ in trainer_model(tied).named_parameters(remove_duplicate=False)}


def test_the_rollout_check_reads_only_the_files_the_checkpoints_index_names(tmp_path):
    """Regression: every *.safetensors file was read, but vLLM loads only those model.safetensors.index.json names
    when there is one; Mistral's repositories ship a consolidated.safetensors of other names beside the shards."""
    rollout = tmp_path / "rollout"
    shutil.copytree(model_dir(False, "fp8_block"), rollout)
    with safe_open(str(rollout / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    (rollout / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, "model.safetensors")}))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(rollout / "consolidated.safetensors"))
    plan = make_plan(describe_weights(trainer_model(tied=False)), RolloutModelInfo.from_checkpoint(rollout, from_files=True),
                     config(1 << 20))
    assert "layers.0.attention.wq.weight" not in plan.targets


def test_every_mismatch_with_the_rollouts_weights_is_reported_together_before_any_byte():
    metas = {m.name: m for m in describe_weights(trainer_model(tied=False))}
    renamed = metas.pop("model.layers.0.mlp.up_proj.weight")
    metas["model.layers.0.mlp.upper_proj.weight"] = TensorMeta("model.layers.0.mlp.upper_proj.weight", renamed.shape,
                                                               renamed.dtype, renamed.module_classes)
    del metas["model.norm.weight"]  # missing
    metas["model.extra.weight"] = TensorMeta("model.extra.weight", (4, 4), "bfloat16", ("Parameter",))  # extra
    down = metas["model.layers.1.mlp.down_proj.weight"]
    metas[down.name] = TensorMeta(down.name, (256, 384), down.dtype, down.module_classes)  # changed shape
    with pytest.raises(PlanMismatchError) as error:
        make_plan(list(metas.values()), checked(False, from_files=True), config(1 << 20))
    message = str(error.value)
    assert "nothing was sent" in message
    assert "model.layers.0.mlp.upper_proj.weight: the rollout's model has no such weight" in message
    assert "model.layers.0.mlp.up_proj.weight: the rollout's model has it, the trainer sends nothing" in message
    assert "model.norm.weight: the rollout's model has it, the trainer sends nothing" in message
    assert "model.extra.weight: the rollout's model has no such weight" in message
    assert "model.layers.1.mlp.down_proj.weight: shape (256, 384) from the trainer, (256, 512) in the rollout's model" in message


def test_an_untied_head_is_refused_by_a_rollout_that_ties_its_head_to_its_embeddings():
    """Regression: the plan sent the trainer's own lm_head to a rollout whose head is its embedding, and the sync
    passed; the rollout could not serve the trainer's model. The reverse (a tied trainer, an untied rollout) is
    fine: the rollout's head gets the embedding's values, which is what the trainer's head is."""
    with pytest.raises(PlanMismatchError, match=r"lm_head\.weight: a tensor of the trainer's own .* the rollout's model "
                                                r"ties its output head to its input embeddings"):
        make_plan(describe_weights(trainer_model(tied=False)), checked(True, from_files=True), config(1 << 20))
    plan = make_plan(describe_weights(trainer_model(tied=True)), checked(False, from_files=True), config(1 << 20))
    assert dict(plan.copies)["lm_head.weight"] == "model.embed_tokens.weight"


@pytest.mark.parametrize("config, tied", [
    ({"model_type": "gemma2"}, True),
    ({"model_type": "llama"}, False),
    ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text"}}, True),
    ({"model_type": "mistral3", "text_config": {"model_type": "mistral"}}, False),
], ids=["gemma2", "llama", "gemma3-text-config", "mistral3-text-config"])
def test_a_config_without_tie_word_embeddings_ties_as_its_model_types_default(config, tied):
    """Regression: a missing key read as untied, but transformers leaves out keys equal to their default when it
    writes a config.json, and vLLM's model of Gemma or GPT-2 then ties its head to its embeddings."""
    assert RolloutModelInfo.from_hf_config(config).tie_word_embeddings is tied


def test_a_config_without_tie_word_embeddings_of_a_model_type_transformers_does_not_know_is_refused():
    with pytest.raises(ConfigError, match=r"no tie_word_embeddings.*model_type='nosuch'"):
        RolloutModelInfo.from_hf_config({"model_type": "nosuch"})


def test_the_check_can_be_turned_off_for_names_vllm_maps_itself():
    metas = [m for m in describe_weights(trainer_model(tied=False)) if m.name != "model.norm.weight"]
    with pytest.raises(PlanMismatchError, match="check_against_rollout=False"):
        make_plan(metas, checked(False, from_files=True), config(1 << 20))
    unchecked = SyncConfig(bucket_bytes=1 << 20, check_against_rollout=False)
    assert "model.norm.weight" not in {t.target for t in make_plan(metas, checked(False, from_files=True), unchecked).tensors}


def test_bf16_where_the_rollout_expects_fp8_is_refused():
    """A rollout checkpoint quantized where the config's scheme would not (or the reverse) cannot be fed."""
    info = checked(False, from_files=True)
    as_bf16 = RolloutModelInfo(None, False, info.weights)  # a scheme that quantizes nothing
    with pytest.raises(PlanMismatchError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: the rollout expects it FP8_BLOCK"):
        make_plan(describe_weights(trainer_model(False)), as_bf16, config(1 << 20))


@pytest.mark.parametrize("quantize_on", ["trainer", "rollout"])
def test_buckets_written_in_place_equal_the_quantizers_tensors_packed(quantize_on):
    """produce_buckets quantizes straight into each bucket's buffer: the same bytes, table and integrity tags as
    quantizing first and packing a copy."""
    model = trainer_model(tied=False)
    plan = make_plan(describe_weights(model), rollout_model(False, True), config(300_000, quantize_on)).for_sync(new_sync_key())
    block_of = (lambda t: t.block) if quantize_on == "trainer" else (lambda t: None)
    for bucket in produce_buckets(plan, lookup(model)):
        tensors = [pair for t in plan.buckets[bucket.index] for pair in loadable_form(t.target, lookup(model)(t.source), block_of(t))]
        packed = pack_bucket(bucket.index, tensors, key=plan.integrity_key)
        assert bucket.tensors == packed.tensors
        for entry in bucket.tensors:  # the bytes between entries are padding
            span = slice(entry.offset, entry.offset + entry.nbytes)
            assert np.array_equal(bucket.buffer[span], packed.buffer[span]), entry.name


@pytest.mark.parametrize("quantize_on", ["trainer", "rollout"])
def test_empty_tensors_travel_even_in_a_bucket_of_their_own(quantize_on):
    """A 0-row weight (its scale 0 rows too) and a 0-element buffer are tensors a model may hold: with a bucket bound
    smaller than every tensor each travels in a 0-byte bucket, which torch once refused to view ("stride(-1) must be
    1"), naming nothing."""
    qc = json.loads((model_dir(False, "fp8_block") / "config.json").read_text())["quantization_config"]
    tensors = {"model.layers.0.proj.weight": torch.randn(0, 256, dtype=torch.bfloat16),
               "model.layers.0.norm.weight": torch.randn(5, dtype=torch.float32),
               "model.layers.0.norm.empty": torch.zeros(0, 3, dtype=torch.float32)}
    classes = {"proj": ("Linear", "Module"), "norm": ("LayerNorm", "Module")}
    metas = [TensorMeta(n, tuple(t.shape), str(t.dtype).removeprefix("torch."), classes[n.split(".")[-2]]) for n, t in tensors.items()]
    plan = make_plan(metas, RolloutModelInfo(qc, False), config(1, quantize_on)).for_sync(new_sync_key())
    assert len(plan.buckets) == 3
    received = dict(t for b in produce_buckets(plan, tensors.__getitem__) for t in loadable_tensors(plan, b))
    assert received["model.layers.0.proj.weight"].shape == (0, 256)
    assert received["model.layers.0.proj.weight_scale"].shape == (0, 2)
    assert received["model.layers.0.norm.empty"].shape == (0, 3)
    assert torch.equal(received["model.layers.0.norm.weight"], tensors["model.layers.0.norm.weight"])


def test_an_fp8_tensor_the_rollout_takes_as_it_is_travels_and_a_nan_in_it_is_refused_by_name():
    """Found: the check of every tensor for NaN/Inf before the first bucket called torch.isfinite, which has no
    float8 kernel: `NotImplementedError: "isfinite" not implemented for 'Float8_e4m3fn'`, naming no tensor."""
    codes = torch.randn(4, 8).to(torch.float8_e4m3fn)
    meta = TensorMeta("model.layers.0.norm.codes", (4, 8), "float8_e4m3fn", ("LayerNorm", "Module"))
    plan = make_plan([meta], RolloutModelInfo(None, False), config(1 << 20)).for_sync(new_sync_key())
    received = dict(t for b in produce_buckets(plan, {meta.name: codes}.__getitem__) for t in loadable_tensors(plan, b))
    assert torch.equal(received[meta.name].view(torch.uint8), codes.view(torch.uint8))
    codes.view(torch.uint8)[2, 3] = 0xFF  # -NaN
    with pytest.raises(InvalidTensorError, match=r"model\.layers\.0\.norm\.codes: holds NaN or Inf"):
        next(produce_buckets(plan, {meta.name: codes}.__getitem__))


@pytest.mark.parametrize("dtype", ["float", "half"])
def test_a_dtype_alias_on_a_quantized_weight_is_refused_when_planned_not_at_every_sync(dtype):
    """Found: torch's aliases passed the plan, and every sync was then refused as "the model changed since the plan
    was made" (the trainer's tensors are checked by torch's own names, float32 and float16)."""
    metas = [m if not m.name.endswith("q_proj.weight") else dataclasses.replace(m, dtype=dtype)
             for m in describe_weights(trainer_model(tied=False))]
    with pytest.raises(InvalidTensorError, match=rf"model\.layers\.0\.self_attn\.q_proj\.weight: dtype {dtype} cannot be "
                                                 "FP8_BLOCK-quantized; expected one of bfloat16, float16, float32"):
        make_plan(metas, rollout_model(False, True), config(1 << 20))
