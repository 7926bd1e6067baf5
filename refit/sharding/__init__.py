"""Sharded trainers as weight sources: each rank sends the rows it holds, FP8_BLOCK-quantized where they are block-aligned.

- `routes`: which rank sends which rows of each planned tensor (pure logic).
- `rank_source`: one rank's stream of bucket parts, over torch.distributed.
- `stream_turns`: which sync's stream the ranks run, one at a time, agreed through their group's store.
- `process_group`: the trainer group's torch.distributed group (gloo on CPU, NCCL on GPU).
"""

from refit.sharding.rank_source import RankSource
from refit.sharding.routes import Route, TensorRoute, route_tensors

__all__ = ["RankSource", "Route", "TensorRoute", "route_tensors"]
