"""Worker-side methods the rollout engine calls through `collective_rpc`.

vLLM mixes `worker_extension_cls` into every worker class, in-process or in
separate worker processes (tensor parallel > 1), so these methods run next to
each worker's model. Calls by method name are serialized with vLLM's own
msgpack encoder; a pickled callable would need
VLLM_ALLOW_INSECURE_SERIALIZATION=1. For the same reason every return value
is plain data (lists, dicts, floats), never a refit class.
"""

from __future__ import annotations

import pickle
from dataclasses import asdict
from typing import Any

from refit.engine.transfer_backend import RefitTransferBackend, backend_of
from refit.provenance import AttentionAmaxRecorder, KvScalePolicy, apply_kv_scale_policy
from refit.transport.collective import Rendezvous

__all__ = ["RefitWorkerExtension"]


class RefitWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def _refit(self) -> RefitTransferBackend:
        return backend_of(self)

    def refit_abandon_update(self) -> None:
        """Close a failed update, whether or not vLLM's worker still counts it as active."""
        self._refit().abandon()
        self._weight_update_active = False  # the worker's session flag (vLLM 0.32 Worker)

    def refit_join_group(self, rendezvous: list, member_offset: int) -> None:
        """Join the sync's collective group as member `member_offset` + this worker's rank in its engine."""
        self._refit().join_group(Rendezvous.from_plain(rendezvous), member_offset + self.rank)

    def refit_leave_group(self) -> None:
        self._refit().leave_group()

    def refit_expect_plan(self, plan: bytes, transport: str) -> None:
        """The open update's plan, pickled by the rollout actor (the same trusted sender as every RPC here)."""
        self._refit().expect_plan(pickle.loads(plan), transport)

    def refit_streamed(self) -> list[str]:
        return self._refit().streamed()

    def refit_scale_records(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self._refit().provenance.records()]

    def refit_start_amax(self) -> None:
        backend = self._refit()
        backend.amax_recorder = AttentionAmaxRecorder(backend.model)
        backend.amax_recorder.start()

    def refit_stop_amax(self) -> list[tuple[str, str, float]]:
        amax = self._refit().amax_recorder.stop()
        return [(module, scale, value) for (module, scale), value in amax.items()]

    def refit_apply_kv_policy(
        self, policy: str, version: int, measured: list[tuple[str, str, float]] | None
    ) -> list[str]:
        backend = self._refit()
        amax = {(module, scale): value for module, scale, value in measured} if measured else None
        return apply_kv_scale_policy(backend.model, backend.provenance, KvScalePolicy(policy), version, amax)
