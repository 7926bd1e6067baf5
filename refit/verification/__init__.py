"""Verified refits: that what a replica serves is what the trainer sent.

A refit that goes wrong does not crash RL training; it silently trains on a
policy that is not the one being trained. So every sync is checked, by
default, at three points (`SyncConfig.verify`):

- in transit: every tensor carries a keyed integrity tag its sender made
  while packing, with a secret of that sync's that never travels with the
  bytes, and the replica checks it before loading (`refit.transport.integrity`);
- complete: at finish the replica checks that it received every tensor of
  the plan in checkpoint form, each FP8 weight with its scale (`manifest`);
- in the engine: after the reload is finalized, every FP8 weight scale the
  engine holds is read back and compared with what was sent, on engines
  whose kernels keep the checkpoint's layout (the CPU ones) (`readback`,
  in `refit.engine`).

Optionally (`verify="probe"`) each replica also scores a fixed batch of
token-id prompts after the post-refit stage, before it serves, and the
result is compared with the trainer's own logprobs (`probe`).
"""

from refit.verification.manifest import missing_tensors, refuse_partial
from refit.verification.probe import ProbeRequest, ProbeResult, ProbeThresholds, compare, probe_prompts, thresholds_for

__all__ = [
    "ProbeRequest",
    "ProbeResult",
    "ProbeThresholds",
    "compare",
    "missing_tensors",
    "refuse_partial",
    "probe_prompts",
    "thresholds_for",
]
