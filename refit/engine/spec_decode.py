"""How many tokens an engine's draft model proposed and its target accepted, from vLLM's own counters.

Why here: after a sync the replica measures its draft's acceptance
(`ReplicaCore._draft_acceptance`), and vLLM counts it already, in the
Prometheus counters its stat loggers keep in the engine's process
(`vllm:spec_decode_num_draft_tokens`, `vllm:spec_decode_num_accepted_tokens`;
on when `disable_log_stats=False`, which `EngineConfig(draft_model=...)`
and `EngineConfig(speculative_method="mtp")` set). A `vllm.LLM` and an `AsyncLLM` both record them there; a replica runs
one engine per process, so the process's counters are its engine's.
"""

from __future__ import annotations

from refit.engine.facts import EngineFacts

__all__ = ["spec_decode_counts"]

_DRAFTED = "vllm:spec_decode_num_draft_tokens"
_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"


def spec_decode_counts(facts: EngineFacts) -> tuple[int, int] | None:
    """(draft tokens proposed, accepted) since the engine started; None without a draft or without the counters."""
    if facts.model_info.draft is None:
        return None
    from vllm.v1.metrics.reader import get_metrics_snapshot

    totals: dict[str, int] = {}
    for metric in get_metrics_snapshot():
        if metric.name in (_DRAFTED, _ACCEPTED) and isinstance(getattr(metric, "value", None), (int, float)):
            totals[metric.name] = totals.get(metric.name, 0) + int(metric.value)
    if _DRAFTED not in totals or _ACCEPTED not in totals:
        return None
    return totals[_DRAFTED], totals[_ACCEPTED]
