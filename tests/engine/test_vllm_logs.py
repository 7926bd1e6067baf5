"""The vLLM warnings every healthy refit engine logs are kept from the driver; every other warning goes through.

Pure logging: records logged to vLLM's loggers by name, as vLLM logs them (no engine, no Ray cluster).
"""

from __future__ import annotations

import logging

import pytest

from refit.engine.vllm_logs import BENIGN_VLLM_WARNINGS, VLLM_ADVICE, layers_left_unloaded, quiet_benign_vllm_warnings
from tests.support.actors import KeptMessages

LAYERWISE = "vllm.model_executor.model_loader.reload.layerwise"
CPU_WORKER = "vllm.v1.worker.cpu_worker"

BENIGN = [  # (logger, message, args) exactly as vLLM 0.32 logs them
    (LAYERWISE, "%s: Failed to load weights", ("RotaryEmbedding",)),
    ("vllm.renderers.base", "Using None for EOS token id because tokenizer is not initialized", ()),
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend. Disabling Triton.", ()),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected on x86 CPUs.", ()),
    ("vllm.config.vllm", "Model Runner V2 requires Triton; using the V1 model runner instead.", ()),
    (CPU_WORKER, "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.", ()),
    (CPU_WORKER, "Node %s is not in available memory nodes %s.", (1, [0])),
    (CPU_WORKER, "CPU group key %s is not a valid memory node. Falling back to memory node %s.", (1, 0)),
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup. This is ...", ()),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings, ...", ()),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", ("none",)),
]

ADVICE = [  # kept, at INFO
    (CPU_WORKER, "%s is not found in LD_PRELOAD. For best performance, please follow the section ...", ("libtcmalloc",)),
    ("vllm.engine.arg_utils", "The global random seed is set to %d. Since VLLM_ENABLE_V1_MULTIPROCESSING ...", (0,)),
]

PASSED = [  # alike in words, but a real problem or advice a user may act on
    (LAYERWISE, "%s: Failed to load weights", ("QKVParallelLinear",)),
    (LAYERWISE, "%s: Failed to load weights", ("FusedMoE",)),
    ("vllm.renderers.base", "Using None for BOS token id because tokenizer is not initialized", ()),
    (CPU_WORKER, "sleep mode is not supported on CPU, ignore it.", ()),
    ("vllm.platforms.cpu", "Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", ("mamba2",)),
    ("vllm.model_executor.models.qwen3", "RotaryEmbedding: Failed to load weights", ()),  # another logger
    ("vllm.config.vllm", "Compilation was disabled by the platform, ...", ()),
]


@pytest.fixture
def kept():
    """What reaches a handler on vLLM's root logger (where vLLM's own handler sits) after refit quiets it."""
    quiet_benign_vllm_warnings()
    quiet_benign_vllm_warnings()  # a second actor start in the same process adds nothing
    root = logging.getLogger("vllm")
    handler, level = KeptMessages(), root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@pytest.mark.parametrize(("name", "message", "args"), BENIGN, ids=[m[:40] for _, m, _ in BENIGN])
def test_each_benign_warning_is_dropped(kept, name, message, args):
    logging.getLogger(name).warning(message, *args)
    assert kept.messages == []


@pytest.mark.parametrize(("name", "message", "args"), PASSED, ids=[f"{n}-{m[:30]}" for n, m, _ in PASSED])
def test_every_other_warning_goes_through(kept, name, message, args):
    logging.getLogger(name).warning(message, *args)
    assert kept.messages == [message % args if args else message]


@pytest.mark.parametrize(("name", "message", "args"), ADVICE, ids=[m[:30] for _, m, _ in ADVICE])
def test_advice_is_kept_at_info(kept, name, message, args):
    logging.getLogger(name).warning(message, *args)
    assert kept.messages == [message % args] and kept.levels == ["INFO"]


def test_each_logger_has_one_filter_and_every_match_is_tested():
    for name in BENIGN_VLLM_WARNINGS.keys() | VLLM_ADVICE.keys():
        quiet_benign_vllm_warnings()
        assert len(logging.getLogger(name).filters) == 1, name
    assert {name for name, _, _ in BENIGN} == set(BENIGN_VLLM_WARNINGS)
    assert len(BENIGN) == sum(map(len, BENIGN_VLLM_WARNINGS.values()))
    assert {name for name, _, _ in ADVICE} == set(VLLM_ADVICE) and len(ADVICE) == sum(map(len, VLLM_ADVICE.values()))


def test_an_abandoned_updates_unloaded_layers_are_counted_not_logged_and_only_inside_the_block(kept):
    layerwise = logging.getLogger(LAYERWISE)
    with layers_left_unloaded() as left:
        for layer in ("QKVParallelLinear", "RotaryEmbedding", "RMSNorm"):
            layerwise.warning("%s: Failed to load weights", layer)
        layerwise.warning("%s: Delayed processing", "FusedMoE")  # anything else goes through
    layerwise.warning("%s: Failed to load weights", "RowParallelLinear")  # after the block: logged again
    assert left == ["QKVParallelLinear", "RMSNorm"]  # the rotary cache is benign, not a layer left as it was
    assert kept.messages == ["FusedMoE: Delayed processing", "RowParallelLinear: Failed to load weights"]
