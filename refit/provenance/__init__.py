"""Scale provenance and the post-refit KV-scale stage.

- `records`: the provenance record (frozen schema) and its table/JSON forms.
- `tracker`: where each scale of a running model came from, from facts.
- `kv_stage`: reset placeholders, recompute, or keep; never serve invalid scales.
"""

from refit.provenance.kv_stage import AttentionAmaxRecorder, KvScalePolicy, apply_kv_scale_policy, refuse_invalid_scales
from refit.provenance.records import ScaleRecord, ScaleSource, format_table, to_json
from refit.provenance.tracker import ATTENTION_SCALES, ScaleProvenanceTracker, checkpoint_tensor_names

__all__ = [
    "ATTENTION_SCALES",
    "AttentionAmaxRecorder",
    "KvScalePolicy",
    "ScaleProvenanceTracker",
    "ScaleRecord",
    "ScaleSource",
    "apply_kv_scale_policy",
    "checkpoint_tensor_names",
    "format_table",
    "refuse_invalid_scales",
    "to_json",
]
