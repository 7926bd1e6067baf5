"""A trainer actor: a torch / transformers causal LM that takes optimizer steps
and serves its weights to `refit.Syncer` as a weight source.

The weight-source protocol a sync needs from any trainer actor is two methods:

- `weight_metadata() -> list[refit.TensorMeta]` (no data; `refit.describe_weights`
  builds it from a torch module);
- `stream_buckets(plan) -> generator of refit.WireBucket`, called with
  `num_returns="streaming"` (`refit.produce_buckets` implements it from a
  `name -> tensor` lookup), plus optionally `last_stream_seconds() -> float`.

Anything else here (training, reference generation) is for RL loops, demos
and tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import ray
import torch

from refit.orchestration.plan import TensorMeta, TransferPlan
from refit.orchestration.stream import describe_weights, produce_buckets
from refit.transport.buckets import WireBucket

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

    # -- weight source protocol ------------------------------------------------
    def weight_metadata(self) -> list[TensorMeta]:
        return describe_weights(self.model)

    def stream_buckets(self, plan: TransferPlan) -> Iterator[WireBucket]:
        self._stream_seconds = 0.0
        params = dict(self.model.named_parameters(remove_duplicate=False))
        buckets = produce_buckets(plan, params.__getitem__)
        while True:
            start = time.perf_counter()
            bucket = next(buckets, None)
            self._stream_seconds += time.perf_counter() - start
            if bucket is None:
                return
            yield bucket

    def last_stream_seconds(self) -> float:
        """Time spent checking, quantizing and packing in the last stream."""
        return self._stream_seconds

    # -- training and references -----------------------------------------------
    def train_step(self, sequences: Sequence[Sequence[int]]) -> float:
        """One next-token-prediction step on `sequences`; returns the loss."""
        ids = torch.tensor(sequences)
        self.model.train()
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def attention_amax(self, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
        """q/k/v amax per layer as the KV cache sees them (a reference for KV-scale recompute)."""
        from refit.testing.reference import attention_amax

        return attention_amax(self.model, prompts)

    def set_parameter(self, name: str, value: torch.Tensor) -> None:
        """Overwrite one parameter (tests use it to inject bad values)."""
        with torch.no_grad():
            dict(self.model.named_parameters())[name].copy_(value)

    @torch.no_grad()
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 8) -> list[list[int]]:
        """Greedy continuations, the reference a rollout must reproduce (prompts of any lengths)."""
        from refit.testing import greedy_continuations

        self.model.eval()
        return [greedy_continuations(self.model, [prompt], max_new_tokens)[0] for prompt in prompts]

    @torch.no_grad()
    def prompt_logprobs(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        """log p(token_i | tokens_<i) for i >= 1, as vLLM's prompt_logprobs reports them."""
        self.model.eval()
        out = []
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            logits = self.model(input_ids=ids).logits.float().log_softmax(-1)[0]
            out.append(logits[:-1].gather(1, ids[0, 1:, None])[:, 0].tolist())
        return out

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save(self, directory: str) -> None:
        """Write the current weights as an HF checkpoint (for fresh-engine comparisons)."""
        self.model.save_pretrained(directory)
