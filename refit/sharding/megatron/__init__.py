"""megatron-core trainers as weight sources: each rank sends what it holds, in the rollout's checkpoint names.

- `mapping`: where each checkpoint tensor lies in a rank's parameters (pure logic, the one place knowing
  Megatron's layouts).
- `layout`: a `RankLayout` over a live `GPTModel` rank, for `refit.sharding.RankSource`.
- `checkpoint`: a Hugging Face checkpoint written into a rank's parameters through the same mapping.

`megatron_source(model, vocab_size=...)` is the one call a Megatron job's rank makes. megatron-core is an
optional extra (`pip install refit[megatron]`), imported only when a layout is made.
"""

from __future__ import annotations

import torch

from refit.sharding.megatron.checkpoint import change_checkpoint_tensors, load_hf_checkpoint
from refit.sharding.megatron.layout import MegatronLayout
from refit.sharding.megatron.mapping import CheckpointNames, MegatronDims, Piece, RankPlace, Slot, slots_of
from refit.sharding.rank_source import RankSource

__all__ = ["CheckpointNames", "MegatronDims", "MegatronLayout", "Piece", "RankPlace", "Slot", "change_checkpoint_tensors",
           "load_hf_checkpoint", "megatron_source", "slots_of"]


def megatron_source(model: torch.nn.Module, *, vocab_size: int, group: torch.distributed.ProcessGroup | None = None,
                    wire_dtype: torch.dtype = torch.bfloat16, names: CheckpointNames | None = None) -> RankSource:
    """This rank's `RankSource` over a megatron-core `GPTModel` (or its DDP / Float16Module wrapper).

    Call it on every rank of the job after `parallel_state.initialize_model_parallel`; `group` spans every rank
    (the default group). `vocab_size` is the rollout checkpoint's vocabulary (Megatron pads its own); `names`, what
    its checkpoint calls the MoE parts (`CheckpointNames.for_model_type(config["model_type"])`; the defaults fit
    every dense model and Qwen's MoE models).
    """
    return RankSource(MegatronLayout(model, vocab_size=vocab_size, wire_dtype=wire_dtype, names=names), group)
