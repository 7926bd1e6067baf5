"""The quantizer reproduces a real llmcompressor FP8_BLOCK checkpoint, bit for bit.

The fixture was made by llmcompressor 0.14.0.1 (its own venv, see
fixtures/quantize_with_llmcompressor.py) from the committed bf16 model; here
the same bf16 weights go through refit's stream quantizer with the scheme
read from the fixture's own config.json.
"""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from fixtures import model_dir
from refit.orchestration import describe_weights, module_classes
from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_whole_model_matches_llmcompressor_checkpoint(tied):
    reference = load_file(str(model_dir(tied, "fp8_block") / "model.safetensors"))
    config = json.loads((model_dir(tied, "fp8_block") / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir(tied, "bf16"), dtype=torch.bfloat16)
    classes = module_classes(describe_weights(model))
    quantizer = Fp8BlockQuantizer(Fp8BlockScheme.from_quantization_config(config["quantization_config"]), classes)

    ours = dict(quantizer(model.state_dict().items()))
    if tied:  # the tied head is not a separate tensor in the checkpoint
        ours.pop("lm_head.weight")

    assert sorted(ours) == sorted(reference)
    quantized = [n for n, t in reference.items() if t.dtype == torch.float8_e4m3fn]
    assert len(quantized) == 14  # 7 Linears in each of 2 layers
    for name, expected in reference.items():
        got = ours[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           expected.view(torch.uint8) if expected.dtype == torch.float8_e4m3fn else expected), name
