"""A trainer actor: a torch / transformers causal LM that takes optimizer steps
and serves its weights to `refit.Syncer` as a weight source.

It implements `refit.protocols.WeightSource` (`weight_metadata`,
`stream_buckets`); any actor with those two methods can be synced, see that
protocol. The rest is what an RL loop calls: a supervised step, a
policy-gradient step, and greedy generation as a reference.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import ray
import torch

from actors._measure import timed
from refit.plan.checkpoint_format import CheckpointView
from refit.plan.data_path import produce_buckets
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import TransferPlan
from refit.transport.buckets import BucketContents, WireBucket
from refit.transport.collective import Rendezvous
from refit.transport.sender import TransportSender
from refit.verification.probe import prompt_logprobs

__all__ = ["TrainerActor"]


@ray.remote
class TrainerActor:
    def __init__(self, model_dir: str, *, lr: float = 1e-3, seed: int = 0, reinitialize: bool = False) -> None:
        """Load a causal LM (bf16) from `model_dir`; `reinitialize` re-draws its weights from `seed`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(seed)
        if reinitialize:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model = self.model.to(torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self._stream_seconds = 0.0
        self._transport = TransportSender()

    # -- weight source protocol ------------------------------------------------
    def weight_metadata(self) -> list[TensorMeta]:
        return CheckpointView(self.model).metadata()

    def stream_buckets(self, plan: TransferPlan, transport: Rendezvous | str = "ray") -> Iterator[WireBucket | BucketContents]:
        self._stream_seconds = 0.0
        # In checkpoint form: fused MoE experts as the per-expert tensors the rollout loads.
        buckets = produce_buckets(plan, CheckpointView(self.model).tensor)
        yield from self._transport.send(timed(buckets, self._add_stream_seconds), transport)

    def join_transport(self, rendezvous: Rendezvous, rank: int) -> None:
        """Join a sync's collective group as its sender (optional in the protocol: `transport="collective"` needs it)."""
        self._transport.join(rendezvous, rank)

    def leave_transport(self) -> None:
        self._transport.leave()

    def transport_group(self) -> str | None:
        return self._transport.group_id()

    def _add_stream_seconds(self, seconds: float) -> None:
        self._stream_seconds += seconds

    @torch.no_grad()
    def reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per prompt, the logprob of each token after the first (the logprob probe's reference)."""
        return prompt_logprobs(self.model, prompts)

    def last_stream_seconds(self) -> float:
        """Time spent checking, quantizing and packing in the last stream (optional in the protocol)."""
        return self._stream_seconds

    # -- training ----------------------------------------------------------------
    def train_step(self, sequences: Sequence[Sequence[int]]) -> float:
        """One next-token-prediction step on `sequences`; returns the loss."""
        ids = torch.tensor(sequences)
        self.model.train()
        return self._step(self.model(input_ids=ids, labels=ids).loss)

    def policy_gradient_step(
        self, sequences: Sequence[Sequence[int]], prompt_len: int, advantages: Sequence[float]
    ) -> float:
        """One policy-gradient step (GRPO-style): raise the log-likelihood of each completion by its advantage.

        `sequences` are prompt + completion token ids (all of one length),
        `advantages` one per sequence (e.g. reward minus its group's mean,
        over the group's std). Returns the loss.
        """
        ids = torch.tensor(sequences)
        weights = torch.tensor(advantages, dtype=torch.float32)
        self.model.train()
        logits = self.model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
        logprobs = logits.log_softmax(-1).gather(2, ids[:, prompt_len:, None])[..., 0]
        return self._step(-(weights[:, None] * logprobs).mean())

    def set_learning_rate(self, lr: float) -> None:
        """Change the optimizer's learning rate (e.g. from a supervised warm-up to RL)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _step(self, loss: torch.Tensor) -> float:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy continuations of the current policy, the reference a rollout should reproduce."""
        self.model.eval()
        out = []
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            generated = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False,
            )
            out.append(generated[0, ids.shape[1] :].tolist())
        return out
