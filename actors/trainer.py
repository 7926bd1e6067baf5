"""A trainer actor: a torch / transformers causal LM that takes optimizer steps
and serves its weights to `refit.Syncer` as a weight source.

It implements `refit.protocols.WeightSource` (`weight_metadata`,
`stream_buckets`); any actor with those two methods can be synced, see that
protocol. The rest is what an RL loop calls: a supervised step, a
policy-gradient step, and greedy generation as a reference.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ray
import torch

from refit.adapters.peft_source import MergedLora, peft_adapter
from refit.import_heap import collector_paused, freeze_import_heap
from refit.plan.checkpoint_format import CheckpointView
from refit.plan.data_path import produce_buckets
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import DRAFT_PREFIX, TransferPlan
from refit.source_methods import TrainerWeights, delegate_to_weights
from refit.transport.buckets import WireBucket
from refit.verification.probe import prompt_logprobs

__all__ = ["TrainerActor"]


@ray.remote
@delegate_to_weights
class TrainerActor:
    def __init__(self, model_dir: str, *, lr: float = 1e-3, seed: int = 0, reinitialize: bool = False,
                 draft_dir: str | None = None, lora: Mapping[str, Any] | None = None, adapter_name: str = "policy") -> None:
        """Load a causal LM (bf16) from `model_dir`; `reinitialize` re-draws its weights from `seed`.

        `draft_dir`: a speculative draft model trained beside the policy (each `train_step` trains it on the same
        sequences); its tensors are reported as `draft.` + their checkpoint names, which syncs send to the
        replicas' draft models (docs/draft.md).

        `lora`: train a LoRA adapter over the frozen base instead of the whole model (peft's `LoraConfig` keywords,
        e.g. `{"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}`). `Syncer.sync_adapter` then
        sends the adapter alone, as `adapter_name`; `Syncer.sync` sends the base with the adapter merged in, for
        rollouts that serve no LoRA (docs/lora.md)."""
        with collector_paused():
            from transformers import AutoConfig, AutoModelForCausalLM
        freeze_import_heap()
        torch.manual_seed(seed)
        if reinitialize:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        else:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir)
        self.model = self.model.to(torch.bfloat16)
        self.draft = None if draft_dir is None else AutoModelForCausalLM.from_pretrained(draft_dir).to(torch.bfloat16)
        self._merged = None
        if lora is not None:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**lora))  # the base is frozen, the adapter trains
            self._merged = MergedLora(self.model)
        self._init_training(lr)
        adapter = None if lora is None else (lambda: peft_adapter(self.model, adapter_name))
        self.weights = TrainerWeights(self._metadata, self._produce, adapter=adapter)

    # -- weight source protocol: `weight_metadata`, `stream_buckets` and the optional methods come from
    # `self.weights` (refit/source_methods.py); the model's forward pass is this class's own.
    def _policy_view(self) -> CheckpointView | MergedLora:
        return self._merged if self._merged is not None else CheckpointView(self.model)

    def _metadata(self) -> list[TensorMeta]:
        metas = self._policy_view().metadata()
        if self.draft is not None:
            metas += [m.renamed(lambda name: DRAFT_PREFIX + name) for m in CheckpointView(self.draft).metadata()]
        return metas

    def _produce(self, plan: TransferPlan) -> Iterator[WireBucket]:
        # In checkpoint form: fused MoE experts as the per-expert tensors the rollout loads.
        view = self._policy_view()
        # A rollout that serves LoRA applies the adapter itself: merged into its base too, it would apply it twice.
        policy = view.unmerged if isinstance(view, MergedLora) and plan.lora_served else view.tensor
        draft = None if self.draft is None else CheckpointView(self.draft).tensor

        def tensor(name: str) -> torch.Tensor:
            return draft(name.removeprefix(DRAFT_PREFIX)) if draft and name.startswith(DRAFT_PREFIX) else policy(name)

        return produce_buckets(plan, tensor)

    @torch.no_grad()
    def reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per prompt, the logprob of each token after the first (the logprob probe's reference)."""
        return prompt_logprobs(self.model, prompts)

    @torch.no_grad()
    def base_reference_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """The same, of the base alone (the adapter off): what a weight sync sends a rollout that serves LoRA."""
        if self._merged is None:
            return self.reference_logprobs(prompts)
        with self.model.disable_adapter():
            return prompt_logprobs(self.model, prompts)

    # -- training ----------------------------------------------------------------
    # Mixed precision as FSDP2 does it: the optimizer updates fp32 master
    # weights and the bf16 model (what forward, backward and `stream_buckets`
    # see) is a copy of them. An AdamW on bf16 weights would drop every update
    # smaller than half a bf16 ulp, and the dropped part would never accumulate.
    def _init_training(self, lr: float) -> None:
        models = [self.model] + ([self.draft] if self.draft is not None else [])
        self._params = [p for model in models for p in model.parameters() if p.requires_grad]
        self._master = [p.detach().float().clone().requires_grad_(True) for p in self._params]
        self.optimizer = torch.optim.AdamW(self._master, lr=lr)

    def train_step(self, sequences: Sequence[Sequence[int]]) -> float:
        """One next-token-prediction step on `sequences` (the policy's, and the draft's if there is one); returns
        the policy's loss."""
        ids = torch.tensor(sequences)
        self.model.train()
        loss = self.model(input_ids=ids, labels=ids).loss
        if self.draft is None:
            return self._step(loss)
        self.draft.train()
        self._step(loss + self.draft(input_ids=ids, labels=ids).loss)
        return float(loss.detach())

    @torch.no_grad()
    def completion_logprobs(self, sequences: Sequence[Sequence[int]], prompt_len: int) -> list[list[float]]:
        """Per sequence, the current policy's logprob of each completion token (after `prompt_len`)."""
        self.model.eval()
        return self._completion_logprobs(torch.tensor(sequences), prompt_len).tolist()

    def policy_gradient_step(
        self, sequences: Sequence[Sequence[int]], prompt_len: int, advantages: Sequence[float] | Sequence[Sequence[float]],
        old_logprobs: Sequence[Sequence[float]] | None = None,
        rollout_logprobs: Sequence[Sequence[float]] | None = None,
        *, clip: float = 0.2, is_cap: float = 2.0,
    ) -> float:
        """One policy-gradient step (GRPO-style): raise the log-likelihood of each completion by its advantage.

        `sequences` are prompt + completion token ids (all of one length),
        `advantages` one per sequence (e.g. reward minus its group's mean,
        over the group's std) or one per completion token. Returns the loss.

        `old_logprobs` (per completion token, from `completion_logprobs` before
        the first step on this batch) make it PPO's clipped objective, so
        several steps can be taken on one batch. `rollout_logprobs` (what the
        rollout that sampled the tokens returned) add truncated importance
        sampling: each token's loss is weighted by min(p_trainer / p_rollout,
        `is_cap`), which corrects for the FP8 rollout sampling from a slightly
        different distribution than the bf16 policy being trained.
        """
        ids = torch.tensor(sequences)
        adv = torch.tensor(advantages, dtype=torch.float32)
        adv = adv[:, None] if adv.dim() == 1 else adv  # per sequence, or per completion token
        self.model.train()
        logprobs = self._completion_logprobs(ids, prompt_len)
        if old_logprobs is None:
            objective = adv * logprobs
            old = logprobs.detach()
        else:
            old = torch.tensor(old_logprobs, dtype=torch.float32)
            ratio = (logprobs - old).exp()
            objective = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
        if rollout_logprobs is not None:
            objective = objective * (old - torch.tensor(rollout_logprobs, dtype=torch.float32)).exp().clamp(max=is_cap)
        return self._step(-objective.mean())

    def set_learning_rate(self, lr: float) -> None:
        """Change the optimizer's learning rate (e.g. from a supervised warm-up to RL)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _completion_logprobs(self, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
        logits = self.model(input_ids=ids).logits[:, prompt_len - 1 : -1].float()
        return logits.log_softmax(-1).gather(2, ids[:, prompt_len:, None])[..., 0]

    def _step(self, loss: torch.Tensor) -> float:
        loss.backward()
        for master, param in zip(self._master, self._params):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for master, param in zip(self._master, self._params):
                param.copy_(master)  # the bf16 copy the next forward and the next sync see
        return float(loss.detach())

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy continuations of the current policy, the reference a rollout should reproduce."""
        self.model.eval()
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        out: list[list[int]] = [[] for _ in prompts]
        for indices in by_length.values():  # prompts of one length make one batch, no padding
            ids = torch.tensor([list(prompts[i]) for i in indices])
            generated = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False,
            )
            for i, row in zip(indices, generated[:, ids.shape[1] :].tolist()):
                out[i] = row
        return out
