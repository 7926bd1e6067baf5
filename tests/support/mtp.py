"""MTP layers in tests: a trainer whose weights include them, and a fingerprint of an engine's MTP drafter.

transformers loads a MiMo checkpoint as a Qwen2 model and drops its MTP
layers, so `with_mtp_layers` adds them to a `TrainerActor`'s model where the
checkpoint names them (`model.model.mtp_layers.<i>`): its weight source then
reports `model.mtp_layers.<i>.*` like any other tensor, which is the whole
contract (docs/draft.md). Functions run in an actor with `run_in`.
"""

from __future__ import annotations

import hashlib

import torch


def with_mtp_layers(trainer, model_dir: str) -> list[str]:
    """Run in a `TrainerActor` of a MiMo checkpoint: give its model the checkpoint's MTP layers; their names."""
    from safetensors.torch import load_file

    from fixtures.mtp_model import MTP_LAYERS, MtpLayer

    tensors = load_file(f"{model_dir}/model.safetensors")
    layers = torch.nn.ModuleList(MtpLayer(trainer.model.config) for _ in range(MTP_LAYERS))
    layers.load_state_dict({k.removeprefix("model.mtp_layers."): v for k, v in tensors.items()
                            if k.startswith("model.mtp_layers.")})
    trainer.model.model.mtp_layers = layers.to(torch.bfloat16)
    return sorted(f"model.mtp_layers.{name}" for name in layers.state_dict())


def redraw_mtp_layers(trainer, seed: int) -> None:
    """Run in a trainer `with_mtp_layers`: new random MTP layers (its policy stays)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in trainer.model.model.mtp_layers.parameters():
            p.copy_(torch.randn_like(p) * 0.05)


def drafter_state(rollout) -> dict[str, str]:
    """Run in a `RolloutActor`: a fingerprint of its engine's MTP drafter (`linear_fingerprints`)."""
    return rollout.engine.llm.collective_rpc(lambda worker: linear_fingerprints(worker.model_runner.get_draft_model()))[0]


def target_state(rollout) -> dict[str, str]:
    """Run in a `RolloutActor`: the same fingerprint of its engine's target model."""
    return rollout.engine.llm.collective_rpc(lambda worker: linear_fingerprints(worker.model_runner.model))[0]


@torch.no_grad()
def linear_fingerprints(model: torch.nn.Module) -> dict[str, str]:
    """A hash of every parameter with elements, and of every CPU linear's output on a fixed input.

    Why outputs too: on a CPU vLLM packs bf16 linear weights into a kernel's own layout and leaves the
    parameter empty (shape (0,)), so hashing parameters alone would miss them; a linear's output on the same
    input is the same bytes exactly when its packed weight is.
    """
    state = {name: _hash(p) for name, p in model.named_parameters() if p.numel()}
    for name, module in model.named_modules():
        linear = getattr(module, "cpu_linear", None)
        if linear is None:
            continue
        probe = torch.randn(4, module.input_size_per_partition, generator=torch.Generator().manual_seed(0))
        state[name + ".output"] = _hash(linear(probe.to(module.params_dtype), module.weight, getattr(module, "bias", None)))
    return state


def _hash(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
