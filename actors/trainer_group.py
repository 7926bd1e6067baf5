"""A sharded trainer: N Ray actors holding one FSDP2-sharded causal LM, and the group handle that drives them.

`refit.Syncer(group, rollouts)` syncs it like a single trainer: each rank
streams the rows it holds (`refit.sharding.RankSource`). The ranks form one
torch.distributed group (gloo on CPU, NCCL on GPU, chosen in
`refit.sharding.process_group`); FSDP2 (`fully_shard`) shards every decoder
layer and the root by rows, as torchtitan and verl do.

Everything that runs the model (a training step, generation, saving) is a
collective: the group handle calls it on every rank at once and returns rank
0's answer. To wrap your own FSDP2 or Megatron trainer instead, give each of
its ranks `weight_metadata` and `stream_buckets` (see
`refit.protocols.WeightSource`) backed by a `RankSource`, and pass an object
whose `ranks` lists them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import ray
import torch

from actors._ranks import RankProcess, on_every_rank, start_ranks
from refit.errors import ConfigError
from refit.import_heap import collector_paused, freeze_import_heap
from refit.sharding.process_group import init_trainer_group
from refit.sharding.rank_source import RankSource
from refit.source_methods import delegate_to_weights
from refit.verification.probe import prompt_logprobs

__all__ = ["TrainerGroup", "TrainerRank"]


@ray.remote
@delegate_to_weights
class TrainerRank(RankProcess):
    """One rank of a `TrainerGroup`; all its model methods are collectives over the group."""

    def setup(self, address: str, port: int, model_dir: str, *, lr: float, seed: int, reinitialize: bool,
              timeout_s: float) -> None:
        """Join the group, then load the model on every rank and shard it with FSDP2.

        Mixed precision as FSDP2 does it: the shards (and the optimizer) hold
        fp32 master weights; forward and backward run on bf16 copies, and
        gradients are reduced in fp32. An AdamW on bf16 weights would drop every
        update below half a bf16 ulp (most of them at RL learning rates), and the
        dropped part would never accumulate. Syncs stream the masters cast to
        bf16, what the forward computes with.
        """
        with collector_paused():
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
            from transformers import AutoConfig, AutoModelForCausalLM
        freeze_import_heap()

        if torch.distributed.is_initialized():
            raise ConfigError(f"trainer rank {self.rank} is in a group already: its leave_group() comes before it joins another")
        mesh = init_trainer_group(self.rank, self.world_size, address, port, timeout_s)
        torch.manual_seed(seed)  # the same initial weights on every rank, before sharding
        if reinitialize:
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        else:
            model = AutoModelForCausalLM.from_pretrained(model_dir)
        model = model.to(torch.float32)
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in _blocks(model):
            fully_shard(block, mesh=mesh, mp_policy=mixed)
        fully_shard(model, mesh=mesh, mp_policy=mixed)
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.source = RankSource(model, wire_dtype=torch.bfloat16)

    @torch.no_grad()
    def reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """The logprob probe's reference (a collective: every rank runs the forward pass)."""
        return prompt_logprobs(self.model, prompts)

    def base_reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """The same: it trains no LoRA adapter, so its base is the whole model."""
        return self.reference_logprobs(prompts)

    # -- training (collectives) ----------------------------------------------------------------------------------------
    def train_step(self, sequences: Sequence[Sequence[int]]) -> float:
        """One next-token step on this rank's share of the batch; FSDP2 averages the gradients."""
        ids = torch.tensor(sequences)
        self.model.train()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
        """Greedy continuations (every rank runs the same forward passes)."""
        self.model.eval()
        ids = torch.tensor([list(p) for p in prompts])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  min_new_tokens=max_new_tokens, do_sample=False)
        return out[:, ids.shape[1]:].tolist()

    def save(self, directory: str) -> None:
        """Write the full (unsharded) model as a bf16 checkpoint (the masters as a sync sends them); rank 0 writes."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            state = {name: value.to(torch.bfloat16) if value.is_floating_point() else value for name, value in state.items()}
            self.model.save_pretrained(directory, state_dict=state)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP2 shards one by one: the blocks transformers says must not be split (`_no_split_modules`, the
    decoder layers; `model.layers`, `gpt_neox.layers` or `transformer.h` depending on the family), as its own FSDP
    wrapping policy picks them."""
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    return [module for module in model.modules() if type(module).__name__ in blocks]


class TrainerGroup:
    """`world_size` `TrainerRank`s holding one FSDP2-sharded model; pass it to `refit.Syncer` as the trainer.

    The group starts its ranks, `resources[r]` (optional) pinning rank r
    (e.g. `{"node1": 0.01}`); or it takes `ranks` that were started elsewhere
    (`TrainerRank.remote(r, world_size)` for r in order, placed by your
    framework), each joining as the rank it was constructed as.
    Construction waits for the ranks' processes and their model loading under
    `startup_timeout_s`; every later call has the deadline `timeout_s`.
    """

    def __init__(self, model_dir: str | Path, world_size: int, *, lr: float = 1e-3, seed: int = 0,
                 reinitialize: bool = False, resources: Sequence[dict[str, float]] | None = None,
                 ranks: Sequence[ray.actor.ActorHandle] | None = None,
                 timeout_s: float = 120.0, startup_timeout_s: float = 1800.0) -> None:
        self.timeout_s = timeout_s
        self.ranks = start_ranks(TrainerRank, world_size, resources, ranks, startup_timeout_s, timeout_s)
        address, port = ray.get(self.ranks[0].rendezvous.remote(), timeout=timeout_s)
        self._all("setup", address, port, str(model_dir), lr=lr, seed=seed, reinitialize=reinitialize, timeout_s=timeout_s,
                  deadline_s=startup_timeout_s)

    def train_step(self, sequences: Sequence[Sequence[int]]) -> float:
        """One data-parallel step: rank r trains on `sequences[r::world_size]`; returns the mean loss."""
        if len(sequences) < len(self.ranks):
            raise ConfigError(f"{len(sequences)} sequences for {len(self.ranks)} ranks: every rank needs one")
        losses = ray.get([rank.train_step.remote(list(sequences[r::len(self.ranks)])) for r, rank in enumerate(self.ranks)],
                         timeout=self.timeout_s)
        return math.fsum(losses) / len(losses)

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8) -> list[list[int]]:
        return self._all("generate", prompts, max_new_tokens)

    def save(self, directory: str | Path) -> Path:
        self._all("save", str(directory))
        return Path(directory)

    def stream_stats(self) -> list[dict[str, int]]:
        return ray.get([rank.last_stream_stats.remote() for rank in self.ranks], timeout=self.timeout_s)

    def kill(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)

    def _all(self, method: str, *args, deadline_s: float | None = None, **kwargs):
        """Call a collective on every rank; rank 0's result."""
        return on_every_rank(self.ranks, method, *args, deadline_s=deadline_s or self.timeout_s, **kwargs)[0]
