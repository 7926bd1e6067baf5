"""LoRA adapters synced alone: the adapter as a sync carries it, its checks, and a replica's swap bookkeeping.

`weights`: `AdapterWeights` (name, PEFT config, tensors) and the checks
against the rollout's base; `serving`: which version a replica serves,
retires and stages; `peft_source`: a trainer's peft model as an adapter, or
merged into its base (merge mode). The engine's half is
refit/engine/lora.py, the driver's `refit.Syncer.sync_adapter`.
docs/lora.md says what each replica kind supports.
"""

from refit.adapters.serving import AdapterSlots, ServedAdapter
from refit.adapters.weights import AdapterMeta, AdapterWeights, check_adapter, check_values, lora_module

__all__ = ["AdapterMeta", "AdapterSlots", "AdapterWeights", "ServedAdapter", "check_adapter", "check_values", "lora_module"]
