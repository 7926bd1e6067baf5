"""What every part of a sync agrees on: the trainer, the driver and each replica import it; it imports none of them.

- `config`: `SyncConfig` and its enums (`Transport`, `Pause`, `Verify`, `QuantizeOn`, `Delta`, `Draft`), validated once.
- `tensors`: `TensorMeta`, a trainer tensor described without its data.
- `checkpoint_format`: a trainer's model under the rollout checkpoint's names and shapes (transformers' save conversion).
- `expected_weights`: what the rollout's model expects, from its checkpoint headers or its config.
- `transfer_plan`: what is sent in which form and bucket (made once, reused), checked against the rollout.
- `data_path`: the plan carried out at both ends: the trainer's (`produce_buckets`) and the replica's (`loadable_tensors`).

Below the driver and the engine, above the building blocks: nothing here
imports `refit.orchestration` (the driver) or `refit.engine` (vLLM), so a
trainer image needs neither to use it. It does import the blocks a plan is
made of and carried out with, none of which imports anything above them:
`refit.quantizer` (the FP8 form each weight travels in), `refit.provenance`
(the KV-scale policy a `SyncConfig` names, and the scale checks the data
path makes), `refit.transport` (the wire buckets and delta base the data
path writes and reads), besides `refit.errors` and `refit.tokens`.
tests/test_architecture.py checks both directions.
"""

from refit.plan.checkpoint_format import CheckpointView, checkpoint_tensors, describe_weights
from refit.plan.config import Delta, Draft, Pause, QuantizeOn, SyncConfig, Transport, Verify
from refit.plan.data_path import loadable_tensors, produce_buckets
from refit.plan.tensors import TensorMeta, module_classes
from refit.plan.transfer_plan import PlannedTensor, RolloutModelInfo, TransferPlan, make_plan

__all__ = [
    "CheckpointView",
    "Delta",
    "Draft",
    "Pause",
    "PlannedTensor",
    "QuantizeOn",
    "RolloutModelInfo",
    "SyncConfig",
    "TensorMeta",
    "TransferPlan",
    "Transport",
    "Verify",
    "checkpoint_tensors",
    "describe_weights",
    "loadable_tensors",
    "make_plan",
    "module_classes",
    "produce_buckets",
]
