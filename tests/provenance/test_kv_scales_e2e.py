"""The seed bug (placeholder KV scales after a dummy load, never repaired by a refit), reproduced and then prevented, on real engines.

An FP8_BLOCK rollout started with load_format="dummy" adopts the dummy value
(-0.000942 here) as every attention q/k/v/prob scale, and a refit never
touches them: with an FP8 KV cache it cannot generate. refit records where
each scale came from and resets only the placeholder ones.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, model_dir
from refit.provenance import KvScalePolicy, ScaleSource
from tests.support.actors import attention_amax, parameter, prompt_logprobs, run_in, set_parameter

pytestmark = pytest.mark.engine  # starts or imports vLLM

PROMPTS = make_prompts(16, PROMPT_LEN, seed=31)
CALIBRATION = make_prompts(8, 24, seed=32)
# Established on these fixtures: FP8_BLOCK weights plus an FP8 KV cache (scales
# 1.0) move prompt log-probabilities by up to 0.14 nats from the bf16 trainer
# (max over 16 prompts x 7 positions; the largest at the uncertain positions
# before the step is known); greedy tokens do not change. Dummy KV scales do
# not generate at all, and wrong weights miss by whole nats.
FP8_LOGPROB_TOLERANCE = 0.25


def by_key(records):
    return {(r.module, r.scale): r for r in records}


def test_dummy_scales_make_plain_vllm_fail_after_a_refit():
    """The bug is real: vLLM's own reload, no refit stage, FP8 KV cache."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(model_dir(True, "fp8_block")), load_format="dummy", kv_cache_dtype="fp8_e4m3",
              skip_tokenizer_init=True, enforce_eager=True, max_model_len=128)
    try:
        weights = list(load_file(str(model_dir(True, "fp8_block") / "model.safetensors")).items())
        weights.append(("lm_head.weight", dict(weights)["model.embed_tokens.weight"]))
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        scales = llm.apply_model(lambda m: [layer._k_scale_float for n, layer in m.named_modules() if n.endswith(".attn")])[0]
        assert all(s == pytest.approx(-0.000942, abs=1e-6) for s in scales), scales
        with pytest.raises(Exception, match="k_scale must be positive"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2, temperature=0))
    finally:
        llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def seed_setup(module_actors):
    trainer = module_actors.trainer(model_dir(True, "bf16"))
    rollout = module_actors.rollout(model_dir(True, "fp8_block"), load_format="dummy", kv_cache_dtype="fp8_e4m3")
    return trainer, rollout


def test_keep_policy_refuses_to_serve_dummy_scales(seed_setup):
    trainer, rollout = seed_setup
    with pytest.raises(refit.EngineError, match=r"8 attention scale\(s\) are not positive.*self_attn\.attn\.q_scale=-0\.000942 \(dummy\)"):
        refit.sync(trainer, rollout, refit.SyncConfig(kv_scales=KvScalePolicy.KEEP))
    with pytest.raises(ray.exceptions.RayTaskError, match="refuses to serve: the post-refit KV-scale stage failed"):
        ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS))


def test_auto_policy_heals_the_seed_scenario(seed_setup):
    trainer, rollout = seed_setup
    report = refit.sync(trainer, rollout)
    assert sorted(report.replicas[0].kv_scales_written) == sorted(
        f"model.layers.{i}.self_attn.attn.{s}" for i in range(2) for s in ("q_scale", "k_scale", "v_scale", "prob_scale")
    )

    records = ray.get(rollout.scale_records.remote())
    attention = [r for r in records if r.kind == "attention"]
    weights = [r for r in records if r.kind == "weight"]
    assert len(attention) == 8 and len(weights) == 8  # qkv, o, gate_up, down per layer
    assert all(r.source is ScaleSource.DEFAULT and r.value == 1.0 and r.version == report.version for r in attention)
    assert all(r.source is ScaleSource.REFIT and r.version == report.version for r in weights)
    table = ray.get(rollout.scale_table.remote())
    row = rf"^model\.layers\.1\.self_attn\.attn +k_scale +default +{report.version} +1$"
    assert re.search(row, table, re.MULTILINE), table

    out = ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))
    assert accuracy(PROMPTS, out.token_ids) == 1.0
    assert out.token_ids == ray.get(trainer.generate.remote(PROMPTS, NEW_TOKENS))
    reference = run_in(trainer, prompt_logprobs, PROMPTS)
    worst = max(abs(a - b) for got, ref in zip(out.prompt_logprobs, reference) for a, b in zip(got[1:], ref))
    assert worst < FP8_LOGPROB_TOLERANCE


def assert_recomputed(rollout, amax: dict[str, float], version: int) -> dict:
    """Every q/k/v scale is calibrated in `version` as amax / 448 of the trainer's own measurement."""
    records = by_key(ray.get(rollout.scale_records.remote()))
    for layer in range(2):
        for scale in ("q_scale", "k_scale", "v_scale"):
            record = records[(f"model.layers.{layer}.self_attn.attn", scale)]
            assert record.source is ScaleSource.CALIBRATED and record.version == version
            # Measured within 1.6%: the engine sees FP8 weights, the trainer bf16.
            assert record.value == pytest.approx(amax[f"{layer}.{scale}"] / 448.0, rel=0.05), (layer, scale)
    return records


def test_recompute_matches_amax_measured_on_the_trainers_model(seed_setup):
    trainer, rollout = seed_setup
    config = refit.SyncConfig(kv_scales=KvScalePolicy.RECOMPUTE, calibration_prompts=tuple(map(tuple, CALIBRATION)))
    report = refit.sync(trainer, rollout, config)

    expected = run_in(trainer, attention_amax, CALIBRATION)
    records = assert_recomputed(rollout, expected, report.version)
    for layer in range(2):
        assert records[(f"model.layers.{layer}.self_attn.attn", "prob_scale")].source is ScaleSource.DEFAULT
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0

    # A later auto sync keeps the calibrated scales: they are not placeholders.
    refit.sync(trainer, rollout)
    after = by_key(ray.get(rollout.scale_records.remote()))
    assert after[("model.layers.0.self_attn.attn", "k_scale")].source is ScaleSource.CALIBRATED

    # After the trainer changes, a recompute measures the new weights, not the old ones.
    for proj in ("q_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        run_in(trainer, set_parameter, name, 1.5 * run_in(trainer, parameter, name))
    changed = run_in(trainer, attention_amax, CALIBRATION)
    assert changed["0.v_scale"] == pytest.approx(1.5 * expected["0.v_scale"], rel=0.02)  # the check can tell old from new
    assert_recomputed(rollout, changed, refit.sync(trainer, rollout, config).version)


def test_tensor_parallel_two_each_transport_reaches_both_workers_and_a_recompute_takes_the_max_over_ranks(actors_factory):
    """TP=2, each worker a process of its own: both transports deliver to both, and the scales are the max over ranks.

    Each rank sees half the heads, so the scale is the amax over both, as on one rank. bf16 weights with an FP8
    KV cache: the fixture's k/v projections (2 heads x 64) split over two ranks are 64 rows, less than one
    128-row FP8 block, which vLLM refuses to shard. One engine for all of it: two worker processes poll for
    work while their engine serves, most of a core between them.
    """
    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    rollout = actors_factory.rollout(
        model_dir(True, "bf16"), load_format="dummy", kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2,
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},  # one core per worker; vLLM cannot auto-bind 2 on 1 NUMA node
    )
    # From the dummy weights over the collective transport: both workers join the group and receive every bucket.
    config = refit.SyncConfig(transport="collective", bucket_bytes=128 << 10, kv_scales="recompute", calibration_prompts=CALIBRATION)
    report = refit.sync(trainer, rollout, config)
    assert report.buckets > 2 and report.replicas[0].served_version == report.version
    assert_recomputed(rollout, run_in(trainer, attention_amax, CALIBRATION), report.version)
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0

    # Then over Ray's object store, after the trainer changed: each rank's recompute sees the new weights.
    for proj in ("q_proj", "v_proj"):
        name = f"model.layers.0.self_attn.{proj}.weight"
        run_in(trainer, set_parameter, name, 1.5 * run_in(trainer, parameter, name))
    report = refit.sync(trainer, rollout, refit.SyncConfig(kv_scales="recompute", calibration_prompts=CALIBRATION))
    assert_recomputed(rollout, run_in(trainer, attention_amax, CALIBRATION), report.version)


@ray.remote
class CalibratingTrainer:
    """A trainer that calibrates KV scales itself (NeMo-RL style) and streams them with the weights."""

    def __init__(self, checkpoint: str, kv_scales: dict[str, float]) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16)
        self.tensors = dict(self.model.named_parameters(remove_duplicate=False))
        self.tensors.update({name: torch.tensor([v], dtype=torch.bfloat16) for name, v in kv_scales.items()})

    def weight_metadata(self):
        scales = [refit.TensorMeta(n, (1,), "bfloat16", ("Qwen3Attention", "Module"))
                  for n in self.tensors if n.endswith(("k_scale", "v_scale"))]
        return refit.describe_weights(self.model) + scales

    def stream_buckets(self, plan):
        yield from refit.produce_buckets(plan, self.tensors.__getitem__)


def test_scales_streamed_by_a_calibrating_trainer_are_loaded_and_kept(seed_setup, actors_factory):
    _, rollout = seed_setup
    streamed = {f"model.layers.{i}.self_attn.{s}": 0.0125 * (i + 1) for i in range(2) for s in ("k_scale", "v_scale")}
    trainer = actors_factory.keep(CalibratingTrainer.options(num_cpus=0, resources={"node0": 0.01}).remote(
        str(model_dir(True, "bf16")), streamed))

    report = refit.sync(trainer, rollout)

    records = by_key(ray.get(rollout.scale_records.remote()))
    for name, value in streamed.items():
        layer, scale = name.split(".")[2], name.rsplit(".", 1)[1]
        record = records[(f"model.layers.{layer}.self_attn.attn", scale)]
        assert record.source is ScaleSource.REFIT and record.version == report.version
        assert record.value == torch.tensor(value, dtype=torch.bfloat16).item()
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0

    bad = {**streamed, "model.layers.1.self_attn.v_scale": -1.0}
    liar = actors_factory.keep(CalibratingTrainer.options(num_cpus=0, resources={"node0": 0.01}).remote(
        str(model_dir(True, "bf16")), bad))
    with pytest.raises(refit.InvalidTensorError, match=r"model\.layers\.1\.self_attn\.v_scale: streamed scale"):
        refit.sync(liar, rollout)
    # Refused on the trainer, before any bucket: the engine still serves the last good version.
    assert ray.get(rollout.status.remote()).served_version == report.version
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0


def test_scales_a_sync_did_not_send_keep_their_values_and_records(seed_setup, actors_factory):
    """Found by review, twice:
    - vLLM's reload makes all of a layer's attention scales anew once one arrives, so a trainer streaming layer 0's
      k scale alone reset that layer's calibrated q and v to placeholders (1.0), still recorded as calibrated, which
      the post-refit stage then trusted;
    - the reload's record of what a sync streamed was written again when a later step of the update failed (here:
      setting the engine's version), over what the recompute had recorded since, so the calibrated scales the
      engine held read as streamed, while it refused."""
    trainer, rollout = seed_setup
    recompute = refit.SyncConfig(kv_scales=KvScalePolicy.RECOMPUTE, calibration_prompts=tuple(map(tuple, CALIBRATION)))
    refit.sync(trainer, rollout, recompute)
    before = by_key(ray.get(rollout.scale_records.remote()))
    calibrating = actors_factory.keep(CalibratingTrainer.options(num_cpus=0, resources={"node0": 0.01}).remote(
        str(model_dir(True, "bf16")), {"model.layers.0.self_attn.k_scale": 0.02}))

    report = refit.sync(calibrating, rollout)

    after = by_key(ray.get(rollout.scale_records.remote()))
    layer = "model.layers.0.self_attn.attn"
    assert after[(layer, "k_scale")].source is ScaleSource.REFIT and after[(layer, "k_scale")].version == report.version
    assert after[(layer, "k_scale")].value == torch.tensor(0.02, dtype=torch.bfloat16).item()
    for scale in ("q_scale", "v_scale"):
        assert after[(layer, scale)] == before[(layer, scale)], scale  # calibrated, with its value
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0

    def fail_once(rollout_actor) -> None:
        engine = rollout_actor.replica.engine
        original = engine.mark_version

        def failing(version):
            engine.mark_version = original
            raise RuntimeError("setting the version failed (injected)")

        engine.mark_version = failing

    run_in(rollout, fail_once)
    with pytest.raises(Exception, match="setting the version failed"):
        refit.sync(calibrating, rollout, recompute)  # streams layer 0's k, then measures every q, k and v
    records = by_key(ray.get(rollout.scale_records.remote()))
    for layer_index in range(2):
        for scale in ("q_scale", "k_scale", "v_scale"):
            record = records[(f"model.layers.{layer_index}.self_attn.attn", scale)]
            assert record.source is ScaleSource.CALIBRATED, (layer_index, scale)
    refit.sync(trainer, rollout)  # serves again


def without_kv_cache_scheme(tmp_path: Path) -> Path:
    """The calibrated checkpoint, its config stripped of `kv_cache_scheme` (the case verl's review asked about)."""
    copy = tmp_path / "fp8_block_kv-no-scheme"
    shutil.copytree(model_dir(True, "fp8_block_kv"), copy)
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]["kv_cache_scheme"]
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize("scheme_in_config", [True, False], ids=["with-kv-cache-scheme", "without-kv-cache-scheme"])
def test_calibrated_checkpoint_scales_survive_an_auto_sync_bit_for_bit(actors_factory, tmp_path, scheme_in_config):
    """The upstream rule ("reset when the config has no kv_cache_scheme") would wipe these without the scheme."""
    checkpoint = load_file(str(model_dir(True, "fp8_block_kv") / "model.safetensors"))
    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    directory = model_dir(True, "fp8_block_kv") if scheme_in_config else without_kv_cache_scheme(tmp_path)
    rollout = actors_factory.rollout(directory, kv_cache_dtype="fp8_e4m3")

    refit.sync(trainer, rollout)

    records = by_key(ray.get(rollout.scale_records.remote()))
    for layer in range(2):
        module = f"model.layers.{layer}.self_attn.attn"
        for scale in ("k_scale", "v_scale"):
            stored = checkpoint[f"model.layers.{layer}.self_attn.{scale}"].float().item()
            assert records[(module, scale)].source is ScaleSource.CHECKPOINT
            assert records[(module, scale)].value == stored  # bit-identical float32
            assert stored > 0 and math.isfinite(stored)
        assert records[(module, "q_scale")].source is ScaleSource.DEFAULT  # never in the checkpoint
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0


def test_placeholder_scales_of_a_checkpoint_without_kv_scales_become_defaults(actors_factory):
    """load_format="auto" on an FP8 checkpoint without KV scales: vLLM's 1.0 placeholders, recorded as such."""
    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    rollout = actors_factory.rollout(model_dir(True, "fp8_block"), kv_cache_dtype="fp8_e4m3")
    before = by_key(ray.get(rollout.scale_records.remote()))
    attention = [k for k, r in before.items() if r.kind == "attention"]
    assert attention and all(before[k].source is ScaleSource.PLACEHOLDER for k in attention)
    report = refit.sync(trainer, rollout)
    after = by_key(ray.get(rollout.scale_records.remote()))
    for key in attention:
        assert after[key].source is ScaleSource.DEFAULT and after[key].version == report.version and after[key].value == 1.0
    assert accuracy(PROMPTS, ray.get(rollout.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0


def renamed_kv_scales(tmp_path: Path, pattern: str) -> Path:
    """The calibrated checkpoint with its `self_attn.{k,v}_scale` saved under another name vLLM also loads them by."""
    from safetensors.torch import save_file

    copy = tmp_path / f"fp8_block_kv-{pattern.replace('{s}', 's')}"
    shutil.copytree(model_dir(True, "fp8_block_kv"), copy)
    tensors = load_file(str(copy / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("self_attn.k_scale", "self_attn.v_scale"))]:
        prefix, _, scale = name.rpartition(".")
        tensors[f"{prefix}.{pattern.format(s=scale[0])}"] = tensors.pop(name)
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


@pytest.mark.parametrize("pattern", ["attn.{s}_scale", "{s}_proj.{s}_scale"], ids=["vllm-names", "modelopt-names"])
def test_calibrated_scales_under_any_name_vllm_loads_are_recorded_from_the_checkpoint_and_kept(
        actors_factory, tmp_path, pattern):
    """vLLM maps `self_attn.attn.k_scale` and `self_attn.k_proj.k_scale` onto the same live scale as
    `self_attn.k_scale`: a record of "placeholder" for them would let the auto stage reset calibrated scales."""
    directory = renamed_kv_scales(tmp_path, pattern)
    stored = load_file(str(model_dir(True, "fp8_block_kv") / "model.safetensors"))
    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    rollout = actors_factory.rollout(directory, kv_cache_dtype="fp8_e4m3")

    before = by_key(ray.get(rollout.scale_records.remote()))
    refit.sync(trainer, rollout)
    after = by_key(ray.get(rollout.scale_records.remote()))

    for layer in range(2):
        for scale in ("k_scale", "v_scale"):
            key = (f"model.layers.{layer}.self_attn.attn", scale)
            value = stored[f"model.layers.{layer}.self_attn.{scale}"].float().item()
            assert before[key].value == value  # vLLM loaded it
            assert before[key].source is ScaleSource.CHECKPOINT, (key, before[key])
            assert after[key].source is ScaleSource.CHECKPOINT and after[key].value == value, (key, after[key])


def test_a_recompute_on_dummy_scales_reports_every_scale_it_wrote(actors_factory):
    """A recompute first makes placeholders valid (the calibration pass runs through the FP8 KV cache), then writes the
    measured q/k/v: the report must name both writes, prob_scale's reset included."""
    trainer = actors_factory.trainer(model_dir(True, "bf16"))
    rollout = actors_factory.rollout(model_dir(True, "fp8_block"), load_format="dummy", kv_cache_dtype="fp8_e4m3")
    config = refit.SyncConfig(kv_scales=KvScalePolicy.RECOMPUTE, calibration_prompts=tuple(map(tuple, CALIBRATION)))

    report = refit.sync(trainer, rollout, config)

    records = ray.get(rollout.scale_records.remote(), timeout=60)
    set_now = {f"{r.module}.{r.scale}" for r in records if r.kind == "attention" and r.version == report.version}
    assert len(set_now) == 8  # q, k, v (calibrated) and prob (default) of both layers
    assert sorted(report.replicas[0].kv_scales_written) == sorted(set_now)
