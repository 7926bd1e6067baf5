"""A megatron-core trainer: one Ray actor per rank of a TP x PP x EP (x DP) layout, and the group handle.

Each rank builds its stage of a `GPTModel` (megatron-core's local layer spec:
no Transformer Engine, so it runs on a CPU over gloo) from a Hugging Face
checkpoint's config, loads the checkpoint's weights into its shards
(`refit.sharding.megatron.load_hf_checkpoint`) and is a weight source through
`refit.sharding.megatron.megatron_source`: `refit.Syncer(group, rollouts)`
syncs it like any trainer. A Megatron job of your own makes the same call in
its own rank actors (docs/sharded.md).

megatron-core 0.16's forward pass needs CUDA (its rotary embedding asks for
the current CUDA device), so on a CPU these ranks hold and update weights but
do not train; `apply` changes every rank's parts of named checkpoint tensors
by an elementwise function, the same change a `TrainerActor` can make.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import ray
import torch

from actors._ranks import RankProcess, on_every_rank, start_ranks
from refit.errors import ConfigError
from refit.import_heap import collector_paused, freeze_import_heap
from refit.sharding.process_group import init_trainer_group
from refit.source_methods import delegate_to_weights

__all__ = ["MegatronGroup", "MegatronParallel", "MegatronRank"]


@dataclass(frozen=True)
class MegatronParallel:
    """How the ranks split the model; data parallelism is what is left of the world size."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1  # expert tensor parallelism
    first_stage_layers: int | None = None  # uneven pipeline stages: the first stage's decoder layers
    vocab_multiple: int = 128  # Megatron pads its vocabulary to a multiple of this times tp

    def data_parallel(self, world_size: int) -> int:
        dense = self.tp * self.pp
        if world_size % dense or world_size % (self.ep * self.etp * self.pp):
            raise ConfigError(f"world_size={world_size} does not split into tp={self.tp} x pp={self.pp} "
                              f"(and ep={self.ep} x etp={self.etp} x pp={self.pp} for experts)")
        return world_size // dense


@ray.remote
@delegate_to_weights
class MegatronRank(RankProcess):
    """One rank of a `MegatronGroup`."""

    def setup(self, address: str, port: int, model_dir: str, parallel: dict, *, timeout_s: float) -> None:
        """Join the group, set up Megatron's parallel groups, build this rank's stage and load the checkpoint into it."""
        _quiet_megatron_imports()
        with collector_paused():
            from megatron.core import parallel_state
        freeze_import_heap()
        from refit.provenance.tracker import checkpoint_tensor_names
        from refit.sharding.megatron import CheckpointNames, load_hf_checkpoint, megatron_source

        if torch.distributed.is_initialized():
            raise ConfigError(f"megatron rank {self.rank} is in a group already: its leave_group() comes before it joins another")
        layout = MegatronParallel(**parallel)
        init_trainer_group(self.rank, self.world_size, address, port, timeout_s)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
            expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp,
            distributed_timeout_minutes=math.ceil(timeout_s / 60),  # its groups' gathers, like the group's, time out
        )
        hf_config = json.loads((Path(model_dir) / "config.json").read_text())
        self.model = _gpt_model(hf_config, checkpoint_tensor_names(model_dir), layout)
        self.source = megatron_source(self.model, vocab_size=hf_config["vocab_size"],
                                      names=CheckpointNames.for_model_type(hf_config.get("model_type", "")))
        load_hf_checkpoint(self.source.layout, model_dir)

    def leave_group(self) -> None:
        from megatron.core import parallel_state

        try:
            parallel_state.destroy_model_parallel()
        finally:
            super().leave_group()

    def apply(self, names: Sequence[str], change: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """`change` (elementwise) applied to this rank's parts of the checkpoint tensors `names`; parts changed."""
        from refit.sharding.megatron import change_checkpoint_tensors

        return change_checkpoint_tensors(self.source.layout, names, change)


class MegatronGroup:
    """`world_size` `MegatronRank`s holding one megatron-core `GPTModel`; pass it to `refit.Syncer` as the trainer.

    Ranks are started here (`resources[r]` pinning rank r) or passed in
    (`MegatronRank.remote(r, world_size)` in order). Rank order is Megatron's
    (`initialize_model_parallel`'s default order: tensor-parallel ranks
    adjacent). Construction waits under `startup_timeout_s`; later calls
    have the deadline `timeout_s`.
    """

    def __init__(self, model_dir: str | Path, world_size: int, parallel: MegatronParallel = MegatronParallel(), *,
                 resources: Sequence[dict[str, float]] | None = None, ranks: Sequence[ray.actor.ActorHandle] | None = None,
                 timeout_s: float = 120.0, startup_timeout_s: float = 1800.0) -> None:
        parallel.data_parallel(world_size)  # refuses a world size the layout does not divide, before anything starts
        self.parallel = parallel
        self.timeout_s = timeout_s
        self.ranks = start_ranks(MegatronRank, world_size, resources, ranks, startup_timeout_s, timeout_s)
        address, port = ray.get(self.ranks[0].rendezvous.remote(), timeout=timeout_s)
        on_every_rank(self.ranks, "setup", address, port, str(model_dir), asdict(parallel), timeout_s=timeout_s,
                      deadline_s=startup_timeout_s)

    def apply(self, names: Sequence[str], change: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """Change the checkpoint tensors `names` on every rank holding part of them; parts changed over all ranks."""
        return sum(on_every_rank(self.ranks, "apply", list(names), change, deadline_s=self.timeout_s))

    def stream_stats(self) -> list[dict[str, int]]:
        return on_every_rank(self.ranks, "last_stream_stats", deadline_s=self.timeout_s)

    def kill(self) -> None:
        for rank in self.ranks:
            ray.kill(rank)


# megatron-core 0.16 warns on import and on config when optional CUDA libraries are missing; on a CPU rank
# they are missing by design (the local layer spec and torch's norms are what refit builds), and the
# deprecated CUDA-graph scope is megatron's own default, not a setting refit passes.
_BENIGN_MEGATRON_WARNINGS = (
    r"(Transformer Engine and )?Apex (is|are) not installed",
    r"full scope is deprecated",
)


def _quiet_megatron_imports() -> None:
    import warnings

    for message in _BENIGN_MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)


def _gpt_model(hf: dict, tensors: frozenset[str], parallel: MegatronParallel) -> torch.nn.Module:
    """This rank's pipeline stage of a `GPTModel` shaped like the checkpoint of config `hf` and tensor names `tensors`
    (bf16 parameters, as Megatron's mixed precision keeps them; its optimizer would hold the fp32 masters).

    Which optional parts a layer has (q/k/v biases, q/k norms, a gate on the shared expert) is read from the
    tensors, not the config: Qwen2's config, for one, does not say that its attention has biases.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    def has(suffix: str) -> bool:
        return any(name.endswith(suffix) for name in tensors)

    experts = hf.get("num_experts") or hf.get("num_local_experts") or None
    qk_norm = has(".self_attn.q_norm.weight")
    shared_ffn = hf.get("shared_expert_intermediate_size") if experts else None  # Qwen2-MoE's shared expert
    uneven = {}
    if parallel.first_stage_layers is not None:
        uneven = {"num_layers_in_first_pipeline_stage": parallel.first_stage_layers}
    config = TransformerConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"], num_attention_heads=hf["num_attention_heads"],
        num_query_groups=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        ffn_hidden_size=hf["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=has(".self_attn.q_proj.bias"), qk_layernorm=qk_norm,
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
        num_moe_experts=experts,
        moe_ffn_hidden_size=(hf.get("moe_intermediate_size") or hf["intermediate_size"]) if experts else None,
        moe_router_topk=hf.get("num_experts_per_tok", 2) if experts else 2,
        moe_shared_expert_intermediate_size=shared_ffn or None, moe_shared_expert_gate=has(".shared_expert_gate.weight"),
        use_cpu_initialization=True, perform_initialization=False, params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16, bf16=True, **uneven,
    )
    multiple = parallel.vocab_multiple * parallel.tp
    rope = hf.get("rope_parameters") or {}
    return GPTModel(
        config, get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=qk_norm),
        vocab_size=math.ceil(hf["vocab_size"] / multiple) * multiple,
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings", False)),
        position_embedding_type="rope", rotary_base=int(rope.get("rope_theta", hf.get("rope_theta", 10000))),
    )
