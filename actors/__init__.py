"""Ray actor classes for refit: a trainer (weight source) and a rollout (vLLM engine).

Both are ordinary Ray actors an RL framework can create itself; `refit.Syncer`
only relies on the documented methods (see `actors.trainer`).
"""

from actors.rollout import RolloutActor
from actors.trainer import TrainerActor

__all__ = ["RolloutActor", "TrainerActor"]
