"""Functions tests run inside an actor with `actor.__ray_call__.remote(fn, ...)`.

Ray calls `fn(actor_instance, *args)` in the actor's process, so tests can
inspect or poke a trainer or a rollout without methods that exist only for
them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import ray
import torch


def run_in(actor, fn, *args, timeout: float = 120):
    return ray.get(actor.__ray_call__.remote(fn, *args), timeout=timeout)


def set_parameter(trainer, name: str, value: torch.Tensor) -> None:
    """Overwrite one trainer parameter (to inject bad values)."""
    with torch.no_grad():
        dict(trainer.model.named_parameters())[name].copy_(value)


def parameter(trainer, name: str) -> torch.Tensor:
    """A copy of one trainer parameter."""
    return trainer.model.get_parameter(name).detach().clone()


@torch.no_grad()
def prompt_logprobs(trainer, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """log p(token_i | tokens_<i) for i >= 1, as vLLM's prompt_logprobs reports them."""
    trainer.model.eval()
    out = []
    for prompt in prompts:
        ids = torch.tensor([list(prompt)])
        logits = trainer.model(input_ids=ids).logits.float().log_softmax(-1)[0]
        out.append(logits[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
    return out


def attention_amax(trainer, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
    from tests.support.reference import attention_amax as measure

    return measure(trainer.model, prompts)


def save(trainer, directory: str) -> None:
    """Write the trainer's current weights as an HF checkpoint."""
    trainer.model.save_pretrained(directory)


def hold_update_lock(rollout, seconds: float) -> None:
    """Occupy a rollout's update lock for `seconds` (from a timer thread), so its update calls hang."""
    import threading

    rollout._update_lock.acquire()
    threading.Timer(seconds, rollout._update_lock.release).start()


def node_id(_actor) -> str:
    return ray.get_runtime_context().get_node_id()


def rss_bytes(_actor) -> int:
    """Resident memory private to the actor's process.

    Shared pages are left out: buckets fetched from Ray's object store are
    mapped from its shared arena, and each new bucket touches new pages of it
    until the whole arena is resident, which would read as a leak.
    """
    with open(f"/proc/{os.getpid()}/statm") as f:
        _, resident, shared, *_ = (int(x) for x in f.read().split())
    return (resident - shared) * os.sysconf("SC_PAGE_SIZE")


def double_weight_scale(rollout, module: str) -> None:
    """Corrupt one FP8 block scale inside a rollout's engine (doubles its first block)."""

    def corrupt(worker) -> None:
        scale = dict(worker.model_runner.model.named_modules())[module].weight_scale
        scale.data[0, 0] *= 2

    rollout.engine.llm.collective_rpc(corrupt)
