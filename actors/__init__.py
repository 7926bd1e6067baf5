"""Ray actor classes for refit: trainers (weight sources) and rollouts (vLLM engines, batch or AsyncLLM, or a `vllm serve` server).

All are ordinary Ray actors an RL framework can create itself; `refit.Syncer`
relies only on the methods of `refit.protocols.WeightSource` (a trainer, or
each rank of a `TrainerGroup` or a `MegatronGroup`) and `refit.protocols.RolloutReplica`.
"""

from refit.import_heap import collector_paused

# These bring in torch and Ray, in every actor process and every driver: imported without the garbage
# collector's passes, which cost a quarter of the imports' CPU (refit/import_heap.py).
with collector_paused():
    from actors.async_rollout import AsyncRolloutActor
    from actors.megatron_group import MegatronGroup, MegatronParallel, MegatronRank
    from actors.rollout import RolloutActor
    from actors.server_rollout import ServerRollout
    from actors.trainer import TrainerActor
    from actors.trainer_group import TrainerGroup, TrainerRank

__all__ = [
    "AsyncRolloutActor", "MegatronGroup", "MegatronParallel", "MegatronRank", "RolloutActor", "ServerRollout", "TrainerActor",
    "TrainerGroup", "TrainerRank",
]
