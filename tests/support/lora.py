"""Helpers run inside trainer and rollout actors by the LoRA tests (functions a Ray actor runs must be importable)."""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch

LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]}
"""The tests' adapter: attention and the MLP's down projection of the tiny Qwen3, rank 8."""


def save_adapter(trainer, directory: str) -> None:
    """Run in a LoRA `TrainerActor`: its adapter as peft writes it (adapter_config.json + adapter_model.safetensors)."""
    trainer.model.save_pretrained(directory)


def save_merged(trainer, directory: str) -> None:
    """Run in a LoRA `TrainerActor`: the base with the adapter merged in, as peft merges it, as a checkpoint."""
    copy.deepcopy(trainer.model).merge_and_unload().save_pretrained(directory)


def generate_with_adapter_dir(rollout, prompts: Sequence[Sequence[int]], max_tokens: int, directory: str):
    """Run in a `RolloutActor` started with `lora_rank`: greedy tokens and logprobs with the adapter vLLM loads from
    `directory` itself (its own loader, the reference for an adapter installed from memory)."""
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0, detokenize=False)
    outputs = rollout.engine.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False,
                                          lora_request=LoRARequest("from-directory", 10_000, directory))
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    logprobs = [[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outputs]
    return tokens, logprobs


def poison_adapter(trainer, value: float = float("nan")) -> str:
    """Run in a LoRA `TrainerActor`: one lora_B weight set to `value`; returns its PEFT checkpoint name."""
    for name, param in trainer.model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                param.fill_(value)
            return name.replace(".default", "")
    raise AssertionError("no lora_B parameter")


def loaded_lora_ids(rollout) -> list[int]:
    """Run in a `RolloutActor`: the LoRA ids its engine holds."""
    return sorted(rollout.engine.llm.collective_rpc(
        lambda worker: list(worker.model_runner.lora_manager._adapter_manager.list_adapters()))[0])
