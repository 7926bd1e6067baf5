"""Ray actor classes for refit: a trainer (weight source) and a rollout (vLLM engine).

Both are ordinary Ray actors an RL framework can create itself; `refit.Syncer`
relies only on the methods of `refit.protocols.WeightSource` and
`refit.protocols.RolloutReplica`.
"""

from actors.rollout import RolloutActor
from actors.trainer import TrainerActor

__all__ = ["RolloutActor", "TrainerActor"]
