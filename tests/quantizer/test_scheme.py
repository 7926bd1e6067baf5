"""Which tensors are quantized comes from the rollout's quantization_config."""

import copy
import json
import re

import pytest

from fixtures import model_dir
from refit.errors import PlanMismatchError, UnsupportedSchemeError
from refit.quantizer import Fp8BlockQuantizer, Fp8BlockScheme

LINEAR = ("Linear", "Module")


@pytest.fixture
def config():
    return json.loads((model_dir(True, "fp8_block") / "config.json").read_text())["quantization_config"]


def test_reads_llmcompressor_config(config):
    scheme = Fp8BlockScheme.from_quantization_config(config)
    assert scheme == Fp8BlockScheme(block=(128, 128), targets=("Linear",), ignore=("lm_head",))


def test_targets_ignore_and_regex(config):
    config = copy.deepcopy(config)
    config["ignore"] = ["lm_head", "re:.*mlp\\.down_proj$"]
    classes = {
        "model.layers.0.self_attn.q_proj": LINEAR,
        "model.layers.0.mlp.down_proj": LINEAR,
        "model.layers.0.input_layernorm": ("Qwen3RMSNorm", "Module"),
        "model.embed_tokens": ("Embedding", "Module"),
        "lm_head": LINEAR,
    }
    q = Fp8BlockQuantizer(Fp8BlockScheme.from_quantization_config(config), classes)
    assert q.is_quantized("model.layers.0.self_attn.q_proj.weight")
    assert not q.is_quantized("model.layers.0.self_attn.q_proj.bias")  # only weights
    assert not q.is_quantized("model.layers.0.mlp.down_proj.weight")  # re: ignore
    assert not q.is_quantized("model.layers.0.input_layernorm.weight")  # not a Linear
    assert not q.is_quantized("model.embed_tokens.weight")
    assert not q.is_quantized("lm_head.weight")  # ignored by name


def test_unknown_module_is_an_error_not_a_guess(config):
    q = Fp8BlockQuantizer(Fp8BlockScheme.from_quantization_config(config), {})
    with pytest.raises(PlanMismatchError, match="model.layers.0.mlp.up_proj.*not in the trainer's module list"):
        q.is_quantized("model.layers.0.mlp.up_proj.weight")


def test_other_schemes_are_refused_with_every_problem_listed(config):
    config = copy.deepcopy(config)
    weights = config["config_groups"]["group_0"]["weights"]
    weights["strategy"] = "channel"
    weights["num_bits"] = 4
    weights["block_structure"] = None
    with pytest.raises(UnsupportedSchemeError) as error:
        Fp8BlockScheme.from_quantization_config(config)
    message = str(error.value)
    assert "weights.strategy='channel'" in message
    assert "weights.num_bits=4" in message
    assert "block_structure=None" in message


def test_mixed_block_structures_are_refused(config):
    config = copy.deepcopy(config)
    other = copy.deepcopy(config["config_groups"]["group_0"])
    other["weights"]["block_structure"] = [64, 64]
    other["targets"] = ["re:.*mlp.*"]
    config["config_groups"]["group_1"] = other
    with pytest.raises(UnsupportedSchemeError, match="different block structures"):
        Fp8BlockScheme.from_quantization_config(config)


@pytest.mark.parametrize("structure", ["128x128", [128, 128], (128, 128)])
def test_block_structure_is_read_in_every_form_compressed_tensors_accepts(config, structure):
    """Regression: the older "ROWSxCOLS" string, which compressed-tensors' QuantizationArgs (and so vLLM) reads as
    [rows, cols], was refused."""
    from compressed_tensors.quantization import QuantizationArgs

    config = copy.deepcopy(config)
    weights = config["config_groups"]["group_0"]["weights"]
    weights["block_structure"] = structure
    assert QuantizationArgs.model_validate(weights).block_structure == [128, 128]
    assert Fp8BlockScheme.from_quantization_config(config).block == (128, 128)


@pytest.mark.parametrize("structure", [["a", "b"], "axb", [128.0, 128], "128", [128, 128, 1]])
def test_a_block_structure_that_is_not_two_ints_is_refused_with_every_problem_listed(config, structure):
    """Regression: ["a", "b"] raised a bare ValueError from int(), and the other problems went unreported."""
    config = copy.deepcopy(config)
    config["config_groups"]["group_0"]["weights"]["block_structure"] = structure
    config["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(UnsupportedSchemeError) as error:
        Fp8BlockScheme.from_quantization_config(config)
    assert f"block_structure={structure!r}, expected [rows, cols]" in str(error.value)
    assert "weights.num_bits=4" in str(error.value)


def test_block_structure_must_be_positive():
    with pytest.raises(UnsupportedSchemeError, match="block structure"):
        Fp8BlockScheme(block=(128, 0))


NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.10.mlp.down_proj", "lm_head", "model.embed_tokens",
         "model.layers.0.mlp.experts.3.up_proj", "mlp.down_proj"]
PATTERNS = ["lm_head", "Linear", "re:.*mlp\\.down_proj$", "re:mlp", "re:model\\.layers\\.1", "re:.*experts\\.\\d+\\.",
            "model.embed_tokens", "down_proj", "re:lm_head|model\\.embed_tokens", "re:"]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_pattern_matches_names_as_compressed_tensors_match_name_does(pattern):
    from compressed_tensors.utils.match import match_name

    for name in NAMES:
        scheme = Fp8BlockScheme(targets=(pattern,), ignore=())
        assert scheme.quantizes(name, ()) == match_name(name, pattern), (name, pattern)


@pytest.mark.parametrize(("field", "entry", "message"), [
    ("targets", "re:model.(layers", "targets entry 're:model.(layers' is not a valid regex"),
    ("ignore", 7, "ignore entry 7: expected a str"),
])
def test_a_bad_target_or_ignore_entry_is_refused_naming_it(config, field, entry, message):
    config = copy.deepcopy(config)
    if field == "ignore":
        config["ignore"] = ["lm_head", entry]
    else:
        config["config_groups"]["group_0"]["targets"] = [entry]
    with pytest.raises(UnsupportedSchemeError, match=re.escape(message)):
        Fp8BlockScheme.from_quantization_config(config)


def test_planning_does_not_import_compressed_tensors():
    """A driver's first plan used to import it (~3 s of CPU, transformers with it) for three lines of matching."""
    import subprocess
    import sys

    code = ("import sys; from refit.quantizer import Fp8BlockScheme; "
            "s = Fp8BlockScheme(ignore=('re:.*lm_head',)); assert s.quantizes('model.layers.0.mlp.up_proj', ('Linear',)); "
            "assert 'compressed_tensors' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
