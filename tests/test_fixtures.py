"""The committed tiny-model fixtures are what later tests assume they are.

Engine, quantizer and KV-scale tests read "wrong tokens" as "wrong weights";
that only holds if the bf16 models really solve the counting task and the FP8
checkpoints really are llmcompressor FP8_BLOCK quantizations of them. These
checks run in the main venv in a few seconds, with no vLLM engine.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fixtures import (
    FIXTURE_MODELS,
    NEW_TOKENS,
    PROMPT_LEN,
    STEPS,
    VOCAB_SIZE,
    accuracy,
    expected_continuation,
    greedy_continuations,
    make_prompts,
    make_sequences,
    model_dir,
    tiny_config,
    tiny_qwen3_config,
)
from fixtures import models as fixture_models

BLOCK = 128
TIED = pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
FP8_VARIANTS = pytest.mark.parametrize("variant", ["fp8_block", "fp8_block_kv"])


def load_tensors(tied: bool, variant: str) -> dict[str, torch.Tensor]:
    return load_file(model_dir(tied, variant) / "model.safetensors")


def linear_shapes(tied: bool) -> dict[str, tuple[int, int]]:
    """Every nn.Linear of the fixture architecture, name -> (out, in), lm_head excluded.

    Taken from the model class on the meta device, not from the checkpoint, so
    a Linear the quantizer skipped cannot go unnoticed.
    """
    from transformers import Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(tiny_qwen3_config(tied))
    return {
        name: (module.out_features, module.in_features)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and name != "lm_head"
    }


def per_element(scale: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Block scales broadcast to every weight element (fp32); an independent
    FP8_BLOCK decoding, not refit's, since these fixtures are what refit is tested against."""
    full = scale.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    return full[: shape[0], : shape[1]]


# --- the task itself ---------------------------------------------------------


def test_sequences_are_seeded_progressions() -> None:
    seqs = make_sequences(64, 12, seed=3)
    assert seqs.dtype == torch.int64 and seqs.shape == (64, 12)
    assert torch.equal(seqs, make_sequences(64, 12, seed=3))
    assert not torch.equal(seqs, make_sequences(64, 12, seed=4))
    assert int(seqs.min()) >= 0 and int(seqs.max()) < VOCAB_SIZE
    diffs = (seqs[:, 1:] - seqs[:, :-1]) % VOCAB_SIZE
    assert torch.equal(diffs, diffs[:, :1].expand_as(diffs)), "one step per sequence"
    assert set(diffs[:, 0].tolist()) == set(STEPS)


def test_expected_continuation_and_accuracy() -> None:
    assert expected_continuation([VOCAB_SIZE - 4, VOCAB_SIZE - 1], 3) == [2, 5, 8]
    prompts = make_prompts(4, PROMPT_LEN, seed=0)
    right = [expected_continuation(p, NEW_TOKENS) for p in prompts]
    assert accuracy(prompts, right) == 1.0
    wrong = [right[0], right[1][:-1] + [(right[1][-1] + 1) % VOCAB_SIZE], [], right[3]]
    assert accuracy(prompts, wrong) == 0.5
    with pytest.raises(ValueError):
        make_prompts(2, 1, seed=0)


def test_import_is_light() -> None:
    """The llmcompressor venv imports the fixtures package, and has no (compatible) vLLM."""
    code = (
        "import sys, fixtures\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'transformers'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1]
    )
    assert result.stdout.strip() == "[]"


def test_model_dir_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="fp8_block_kv"):
        model_dir(True, "fp8")
    monkeypatch.setattr(fixture_models, "FIXTURES_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="make fixtures"):
        model_dir(True, "bf16")
    assert model_dir(True, "bf16", must_exist=False) == tmp_path / "qwen3-tiny-tied" / "bf16"


# --- bf16 models -------------------------------------------------------------


@pytest.mark.parametrize("arch, tied", FIXTURE_MODELS, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in FIXTURE_MODELS])
def test_bf16_model_solves_task(arch: str, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir(tied, "bf16", arch=arch), dtype="auto").eval()
    assert model.dtype == torch.bfloat16 and model.config.model_type == arch
    expected_config = tiny_config(arch, tied)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings"):
        assert getattr(model.config, key) == getattr(expected_config, key), key
    # Seed unlike make_models.py's evaluation seed; two prompt lengths.
    for prompt_len in (PROMPT_LEN, 2 * PROMPT_LEN):
        prompts = make_prompts(128, prompt_len, seed=31)
        assert accuracy(prompts, greedy_continuations(model, prompts, NEW_TOKENS)) >= 0.95


@TIED
@pytest.mark.parametrize("variant", ["bf16", "fp8_block", "fp8_block_kv"])
def test_lm_head_stored_only_when_untied(tied: bool, variant: str) -> None:
    tensors = load_tensors(tied, variant)
    assert "model.embed_tokens.weight" in tensors
    assert ("lm_head.weight" in tensors) is not tied
    assert json.loads((model_dir(tied, variant) / "config.json").read_text())["tie_word_embeddings"] is tied


# --- FP8_BLOCK checkpoints ---------------------------------------------------


@TIED
@FP8_VARIANTS
def test_fp8_block_weights(tied: bool, variant: str) -> None:
    fp8, bf16 = load_tensors(tied, variant), load_tensors(tied, "bf16")
    linears = linear_shapes(tied)
    assert len(linears) == 7 * tiny_qwen3_config(tied).num_hidden_layers
    for name, (out, inp) in linears.items():
        weight, scale = fp8[f"{name}.weight"], fp8[f"{name}.weight_scale"]
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (out, inp), name
        assert scale.dtype == torch.bfloat16, name
        assert scale.shape == (math.ceil(out / BLOCK), math.ceil(inp / BLOCK)), name
        assert bool((scale > 0).all() and scale.isfinite().all()), name
        # The codes quantize this bf16 fixture: w / scale is rounded to bf16
        # (error <= 1 below 512) and then to e4m3 (half a step, <= 16 for
        # codes up to 448), so each weight is within 17 x its block scale.
        full_scale = per_element(scale, weight.shape)
        error = (weight.float() * full_scale - bf16[f"{name}.weight"].float()).abs()
        assert bool((error <= 17 * full_scale).all()), name
    quantized = {f"{name}.{suffix}" for name in linears for suffix in ("weight", "weight_scale")}
    kv_scales = {k for k in fp8 if k.endswith(("k_scale", "v_scale"))}
    assert set(fp8) - quantized - kv_scales == set(bf16) - {f"{name}.weight" for name in linears}
    for key in set(fp8) - quantized - kv_scales:  # norms, embedding, lm_head: untouched bf16
        assert torch.equal(fp8[key], bf16[key]), key


@TIED
@FP8_VARIANTS
def test_fp8_block_quantization_config(tied: bool, variant: str) -> None:
    config = json.loads((model_dir(tied, variant) / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "float-quantized"
    assert config["ignore"] == ["lm_head"]
    (group,) = config["config_groups"].values()
    assert group["targets"] == ["Linear"]
    weights, acts = group["weights"], group["input_activations"]
    assert (weights["num_bits"], weights["type"], weights["strategy"]) == (8, "float", "block")
    assert weights["block_structure"] == [BLOCK, BLOCK] and weights["dynamic"] is False
    assert (acts["dynamic"], acts["strategy"], acts["group_size"]) == (True, "group", BLOCK)
    kv = config.get("kv_cache_scheme")
    if variant == "fp8_block":
        assert kv is None
    else:
        assert (kv["num_bits"], kv["type"], kv["strategy"], kv["dynamic"]) == (8, "float", "tensor", False)


@TIED
def test_kv_scales(tied: bool) -> None:
    """Calibrated KV scales exist only in fp8_block_kv, one k/v pair per layer."""
    layers = range(tiny_qwen3_config(tied).num_hidden_layers)
    names = {f"model.layers.{i}.self_attn.{kind}" for i in layers for kind in ("k_scale", "v_scale")}
    with_kv = load_tensors(tied, "fp8_block_kv")
    assert {k for k in with_kv if k.endswith("_scale") and "self_attn." in k and "proj" not in k} == names
    for name in names:
        scale = with_kv[name].float()
        assert scale.numel() == 1 and bool(scale.isfinite().all() and (scale > 0).all()), name
    assert not names & set(load_tensors(tied, "fp8_block"))
