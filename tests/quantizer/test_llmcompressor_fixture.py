"""The quantizer reproduces a real llmcompressor FP8_BLOCK checkpoint, bit for bit.

The fixtures were made by llmcompressor 0.14.0.1 (its own venv, see
fixtures/quantize_with_llmcompressor.py) from the committed bf16 models; here
the same bf16 weights, read from the trainer's in-memory model in checkpoint
format (the MoE's fused experts cut per expert), go through refit's stream
quantizer with the scheme read from the fixture's own config.json.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fixtures import FIXTURE_MODELS, model_dir
from refit.plan import CheckpointView, module_classes
from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme

# 7 Linears in each of 2 layers; the MoE: q/k/v/o plus 4 experts x 3 projections per layer.
QUANTIZED = {"qwen3": 14, "llama": 14, "qwen3_moe": 2 * (4 + 4 * 3)}


@pytest.mark.parametrize("arch, tied", FIXTURE_MODELS, ids=[f"{a}-{'tied' if t else 'untied'}" for a, t in FIXTURE_MODELS])
def test_whole_model_matches_llmcompressor_checkpoint(arch, tied):
    reference = load_file(str(model_dir(tied, "fp8_block", arch=arch) / "model.safetensors"))
    config = json.loads((model_dir(tied, "fp8_block", arch=arch) / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir(tied, "bf16", arch=arch), dtype=torch.bfloat16)
    view = CheckpointView(model)
    metas = view.metadata()
    quantizer = Fp8BlockQuantizer(Fp8BlockScheme.from_quantization_config(config["quantization_config"]), module_classes(metas))

    # The tied head is not a separate tensor in the checkpoint.
    ours = dict(quantizer((m.name, view.tensor(m.name)) for m in metas if m.alias_of is None))

    assert sorted(ours) == sorted(reference)
    quantized = [n for n, t in reference.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) == QUANTIZED[arch]
    for name, expected in reference.items():
        got = ours[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected), name
