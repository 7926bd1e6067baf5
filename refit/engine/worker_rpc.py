"""The RPC contract between a replica and its vLLM workers: both ends, in one module.

vLLM mixes `worker_extension_cls` into every worker class, in-process or in
separate worker processes (tensor parallel > 1, an engine core of its own),
so `RefitWorkerExtension`'s methods run next to each worker's model.
`WorkerCalls` is the replica's end: one method per RPC, reaching the workers
through whatever `call(method, *args)` the engine offers (`collective_rpc`
of `vllm.LLM` or `AsyncLLM`). Each RPC is named in exactly these two places.

Calls by method name are serialized with vLLM's own msgpack encoder (a
pickled callable would need VLLM_ALLOW_INSECURE_SERIALIZATION=1), so every
argument and return value is plain data (lists, dicts, floats), never a
refit class; the plan too travels as plain data (`TransferPlan.to_plain`).

A server (`vllm serve`) reaches its workers only through its dev route
`/collective_rpc`, which passes string arguments and turns results into
strings. There every call goes through one method, `refit_call`, whose
argument is a JSON string `{"method": ..., "args": [...]}` and whose answer
is a JSON string `{"ok": true, "result": ...}` or, for a worker's error,
`{"ok": false, "type": "<class name>", "message": ...}` (`encode_call` /
`decode_reply`). Only the methods in `SERVER_METHODS` can be called, and
nothing is ever unpickled: what arrives over HTTP is data, not code (the
server's key, `refit serve`'s gate, says who may send it). The replica
raises a worker's error as refit's error class of that name
(refit/errors.py), else as `EngineError` naming the type.

Engines whose workers run in other processes (an AsyncLLM, a `vllm.LLM`
with its engine core in its own process or tensor parallel workers) call
every method through `refit_typed_call`, which answers the same result or
error as data: vLLM's RPC raises a worker's failure again as a plain
`Exception` that keeps only its message, and the replica needs the type to
tell a bucket refused before loading (it serves on) from any other failure.

Importing this module does not import vLLM: the worker end reaches refit's
weight-transfer backend (which does) only when a worker calls it.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch

from refit import errors
from refit.adapters.weights import AdapterWeights
from refit.engine.config import TRANSFER_BACKEND, WORKER_EXTENSION
from refit.errors import ConfigError, EngineError, RefitError
from refit.plan.config import Transport
from refit.plan.transfer_plan import DRAFT_PREFIX, TransferPlan
from refit.provenance import AttentionAmaxRecorder, KvScalePolicy, ScaleRecord, ScaleSource, apply_kv_scale_policy
from refit.transport.buckets import BucketContents
from refit.transport.collective import Rendezvous
from refit.transport.kinds import transport_kind

if TYPE_CHECKING:
    from refit.engine.transfer_backend import RefitTransferBackend

__all__ = [
    "SERVER_METHODS", "WORKER_METHODS", "RefitWorkerExtension", "WorkerCalls", "decode_reply", "encode_call", "max_over_ranks",
    "TYPED_CALL", "refuse_engine_without_refit", "results_of",
]

log = logging.getLogger(__name__)

AmaxRows = list[tuple[str, str, float]]  # (attention module, scale name, amax)


class WorkerCalls:
    """The replica's end: each worker RPC as a method. `call(method, *args)` returns one result per worker."""

    def __init__(self, call: Callable[..., list]) -> None:
        self._call = call

    def start_update(self, plan: TransferPlan, transport: Transport, *, keep_base: bool = False) -> None:
        """Put every layer in loadable form; over `collective` or `ipc`, tell the workers the plan of what arrives
        and whether they keep what arrives as their delta base."""
        by_contents = transport_kind(transport).traits.by_contents
        self._call("refit_start_update", plan.to_plain() if by_contents else None, str(transport), keep_base)

    def base_digests(self) -> list[str | None]:
        """Each worker's delta base digest (set when an update that kept one was finished)."""
        return self._call("refit_base_digest")

    def drop_base(self) -> None:
        self._call("refit_drop_base")

    def load(self, tensors: Sequence[tuple[str, torch.Tensor]], version: int, *, verify: bool) -> None:
        """One bucket of tensors in the form vLLM's loaders take (`ray`: they cross the RPC)."""
        self._call("update_weights", {"version": version, "tensors": list(tensors), "verify": verify})

    def receive(self, contents: Sequence[BucketContents], next_bucket_bytes: Sequence[int | None], version: int, *,
                verify: bool) -> None:
        """One bucket whose bytes the workers receive over the transport (a part per sending rank); only its
        table of contents crosses the RPC, with each rank's next part's size so its receive is posted early."""
        self._call("update_weights", {"version": version, "contents": [part.to_plain() for part in contents],
                                      "next_bucket_bytes": list(next_bucket_bytes), "verify": verify})

    def streamed(self) -> list[str]:
        """Checkpoint names of every tensor the open update loaded."""
        return self._call("refit_streamed")[0]

    def finish_update(self) -> None:
        """Refuse an incomplete update (the reload left open for `abandon_update`), else finalize it."""
        self._call("refit_finish_update")

    def abandon_update(self) -> None:
        """Close a failed update: layers that received nothing get their old tensors back."""
        self._call("refit_abandon_update")

    def apply_kv_policy(self, policy: KvScalePolicy, version: int, measured: AmaxRows | None) -> list[str]:
        """The post-refit stage's write; returns the attention scales written ("module.scale")."""
        return self._call("refit_apply_kv_policy", str(policy), version, measured)[0]

    def start_amax(self) -> None:
        self._call("refit_start_amax")

    def stop_amax(self) -> AmaxRows:
        """Attention amax since `start_amax`, the max over tensor-parallel ranks (each sees its own heads)."""
        return max_over_ranks(self._call("refit_stop_amax"))

    def join_group(self, rendezvous: Rendezvous, member_offset: int) -> None:
        """Every worker joins the collective group as member `member_offset` + its rank; blocks until the group is whole."""
        self._call("refit_join_group", rendezvous.to_plain(), member_offset)

    def leave_group(self, group_id: str | None = None) -> None:
        """Every worker leaves collective group `group_id` if it is in that one (None: whichever it is in)."""
        self._call("refit_leave_group", group_id)

    def add_adapter(self, lora_id: int, adapter: AdapterWeights) -> list[str]:
        """Install `adapter` from memory as vLLM's LoRA `lora_id`, pinned, in every worker; each worker's digest of
        the bytes it installed (refit/engine/lora.py)."""
        return self._call("refit_add_adapter", lora_id, adapter.to_plain())

    def remove_adapter(self, lora_id: int) -> None:
        self._call("refit_remove_adapter", lora_id)

    def scale_records(self) -> list[ScaleRecord]:
        rows = self._call("refit_scale_records")[0]
        return [ScaleRecord(**{**row, "source": ScaleSource(row["source"])}) for row in rows]


class RefitWorkerExtension:
    """The workers' end, mixed into vLLM's worker class; `self` is the worker."""

    def _refit(self) -> RefitTransferBackend:
        from refit.engine.transfer_backend import backend_of  # imports vLLM, which a worker has

        backend = backend_of(self)
        if backend.draft is None:
            # Attached on any call, not only as an update opens: the draft's scales are listed before the first sync.
            runner = self.model_runner
            draft = runner.get_draft_model() if hasattr(runner, "get_draft_model") else None
            spec = getattr(self, "speculative_config", None)
            backend.attach_draft(draft, getattr(spec, "draft_model_config", None))
        return backend

    def refit_call(self, payload: str) -> str:
        """One of `SERVER_METHODS` on this worker, called through a server's `/collective_rpc` (see the module docstring).

        `payload` is JSON, never unpickled. Never raises: the error's type
        name and message go back as JSON, so the replica raises refit's
        error of that type rather than the server's "Worker failed with
        error ..." string.
        """
        try:
            method, args = _parse_call(payload)
        except ConfigError as error:
            return json.dumps(_failure(error))
        answer = _answer(self, method, args)
        try:
            return json.dumps(answer)
        except (TypeError, ValueError):
            return json.dumps(_failure(EngineError(f"{method} returned {type(answer['result']).__name__}, which is not JSON")))

    def refit_typed_call(self, method: str, *args: Any) -> dict[str, Any]:
        """`method(*args)`, one of `WORKER_METHODS`, on this worker: its result or its error, as data (`results_of`).

        Why: vLLM's RPC raises a failure in a worker of another process (an
        engine core of its own, tensor-parallel workers) as a plain
        `Exception` that keeps only the message, and the replica needs the
        type. A bucket refused before any byte of it was loaded (a
        `VerificationError`, an `InvalidTensorError`) leaves the model as it
        was, so the replica serves on; any other failure may not have.
        """
        if method not in WORKER_METHODS:
            return _failure(ConfigError(f"refit_typed_call refuses method {method!r}: not one of refit's worker RPCs"))
        return _answer(self, method, args)

    def refit_engine_facts(self) -> dict[str, Any]:
        """The `EngineFacts` of this worker's engine as plain data (`EngineFacts.from_plain`), for a replica that
        cannot read its `VllmConfig` (a server).

        Fails, naming the fix, when the engine was started without refit's weight-transfer backend.
        """
        from refit.engine.facts import EngineFacts

        self._refit()
        return EngineFacts.of(self.vllm_config).to_plain()

    def refit_boot_id(self) -> str:
        """Who this worker process is (host, pid, start time): a server that restarted answers with another one."""
        import socket

        return f"{socket.gethostname()}:{os.getpid()}:{_PROCESS_STARTED:.6f}"

    def refit_abandon_update(self) -> None:
        """Close a failed update, whether or not vLLM's worker still counts it as active.

        The worker's session flag is cleared even when closing the reload fails: left set, vLLM would refuse every
        later update's start ("already active"), and the replica could never be repaired by a sync.
        """
        try:
            self._refit().abandon()
        finally:
            self._weight_update_active = False  # the worker's session flag (vLLM 0.32 Worker)

    def refit_finish_update(self) -> None:
        """vLLM's `finish_weight_update`, keeping the LoRA adapters refit installed (`adapters_kept` says why)."""
        from refit.engine.lora import adapters_kept  # imports vLLM, which a worker has

        with adapters_kept(self):
            self.finish_weight_update()

    def refit_join_group(self, rendezvous: list, member_offset: int) -> None:
        """Join the sync's collective group as member `member_offset` + this worker's rank in its engine."""
        self._refit().join_group(Rendezvous.from_plain(rendezvous), member_offset + self.rank)

    def refit_leave_group(self, group_id: str | None = None) -> None:
        self._refit().leave_group(group_id)

    def refit_start_update(self, plan: dict[str, Any] | None, transport: str, keep_base: bool = False) -> None:
        """Open an update (vLLM's `start_weight_update`, which calls the backend's) with the engine's draft model
        attached (`_refit`), so that `draft.` tensors load into it; over `collective` or `ipc`, with the `plan` of
        what arrives."""
        self._refit()
        self.start_weight_update()
        if plan is not None:
            self.refit_expect_plan(plan, transport, keep_base)

    def refit_expect_plan(self, plan: dict[str, Any], transport: str, keep_base: bool = False) -> None:
        """The open update's plan, as `TransferPlan.to_plain` data (refused, naming why, if it is not one)."""
        self._refit().expect_plan(TransferPlan.from_plain(plan), transport, keep_base=keep_base)

    def refit_base_digest(self) -> str | None:
        return self._refit().base.digest()

    def refit_drop_base(self) -> None:
        self._refit().base.clear()

    def refit_streamed(self) -> list[str]:
        return self._refit().streamed()

    def refit_scale_records(self) -> list[dict[str, Any]]:
        backend = self._refit()
        records = [asdict(r) for r in backend.provenance.records()]
        if backend.draft is not None:
            records += [asdict(r) | {"module": DRAFT_PREFIX + r.module} for r in backend.draft.provenance.records()]
        return records

    def refit_add_adapter(self, lora_id: int, adapter: dict[str, Any]) -> str:
        from refit.engine.lora import install_adapter  # imports vLLM, which a worker has

        return install_adapter(self, lora_id, adapter)

    def refit_remove_adapter(self, lora_id: int) -> bool:
        from refit.engine.lora import remove_adapter

        return remove_adapter(self, lora_id)

    def refit_start_amax(self) -> None:
        backend = self._refit()
        if backend.amax_recorder is not None:  # a pass that never stopped: its hooks go before new ones come
            backend.amax_recorder.remove_hooks()
        backend.amax_recorder = AttentionAmaxRecorder(backend.model)
        backend.amax_recorder.start()

    def refit_stop_amax(self) -> AmaxRows:
        backend = self._refit()
        recorder, backend.amax_recorder = backend.amax_recorder, None
        if recorder is None:
            raise EngineError("refit_stop_amax without refit_start_amax: no KV-scale calibration pass is running")
        amax = recorder.stop()
        return [(module, scale, value) for (module, scale), value in amax.items()]

    def refit_apply_kv_policy(self, policy: str, version: int, measured: AmaxRows | None) -> list[str]:
        """The post-refit stage on the target, and on the draft model if there is one (which measures nothing of its
        own: under "recompute" its placeholders are reset as under "auto"); the draft's scales are named `draft.`."""
        backend = self._refit()
        amax = {(module, scale): value for module, scale, value in measured} if measured else None
        written = apply_kv_scale_policy(backend.model, backend.provenance, KvScalePolicy(policy), version, amax)
        if backend.draft is not None:
            draft_policy = KvScalePolicy.AUTO if KvScalePolicy(policy) is KvScalePolicy.RECOMPUTE else KvScalePolicy(policy)
            written += [DRAFT_PREFIX + name for name in
                        apply_kv_scale_policy(backend.draft.model, backend.draft.provenance, draft_policy, version, None)]
        return written


_PROCESS_STARTED = time.time()  # when this module was first imported in this process


SERVER_METHODS = frozenset({
    # vLLM's own worker methods, which call refit's weight-transfer backend (WorkerCalls)
    "update_weights",
    # refit's (RefitWorkerExtension), each one WorkerCalls or the server adapter calls
    "refit_engine_facts", "refit_boot_id", "refit_start_update", "refit_finish_update", "refit_base_digest", "refit_drop_base",
    "refit_streamed", "refit_abandon_update", "refit_apply_kv_policy", "refit_start_amax", "refit_stop_amax",
    "refit_join_group", "refit_leave_group", "refit_scale_records",
})
"""The worker methods `refit_call` runs for a server's `/collective_rpc`; any other name is refused."""

TYPED_CALL = "refit_typed_call"
"""The worker method through which an engine adapter whose workers are in other processes calls the others."""

WORKER_METHODS = SERVER_METHODS | {"refit_add_adapter", "refit_remove_adapter"}
"""Every worker method a replica calls (`WorkerCalls`, the server adapter); `refit_typed_call` runs only these."""


def encode_call(method: str, *args: Any) -> str:
    """The payload of `RefitWorkerExtension.refit_call` for `method(*args)`: a JSON string, as `/collective_rpc` takes."""
    return json.dumps({"method": method, "args": list(args)})


def decode_reply(reply: Any) -> tuple[bool, Any]:
    """`refit_call`'s answer: (True, the result) or (False, the worker's error as refit's exception).

    Raises ValueError for anything that is not `refit_call`'s JSON (it is parsed, never executed).
    """
    if not isinstance(reply, str):
        raise ValueError(f"a worker's answer is {type(reply).__name__}, not refit_call's JSON string")
    try:
        answer = json.loads(reply)
    except ValueError as error:
        raise ValueError(f"a worker's answer is not JSON ({error}): {reply[:80]!r}") from None
    return _unwrap(answer, reply)


def results_of(answers: list[Any]) -> list[Any]:
    """Each worker's result from `refit_typed_call`'s answers; raises the first worker's error as refit's exception."""
    results = []
    for answer in answers:
        ok, value = _unwrap(answer, answer)
        if not ok:
            raise value
        results.append(value)
    return results


def _answer(worker: Any, method: str, args: Sequence[Any]) -> dict[str, Any]:
    try:
        return {"ok": True, "result": getattr(worker, method)(*args)}
    except Exception as error:  # noqa: BLE001 - every failure is the caller's to raise
        # The caller sees the type and message only: where it came from is logged here, beside the worker.
        log.log(logging.DEBUG if isinstance(error, RefitError) else logging.ERROR, "worker %s failed", method, exc_info=True)
        return _failure(error)


def _failure(error: Exception) -> dict[str, Any]:
    return {"ok": False, "type": type(error).__name__, "message": str(error)}


def _unwrap(answer: Any, shown: Any) -> tuple[bool, Any]:
    if isinstance(answer, dict) and answer.get("ok") is True and "result" in answer:
        return True, answer["result"]
    if (isinstance(answer, dict) and answer.get("ok") is False and isinstance(answer.get("type"), str)
            and isinstance(answer.get("message"), str)):
        return False, worker_error(answer["type"], answer["message"])
    raise ValueError(f"a worker's answer is not refit's answer shape: {str(shown)[:80]!r}")


def worker_error(type_name: str, message: str) -> Exception:
    """A worker's error of class `type_name`: refit's class of that name, else an `EngineError` naming the type."""
    cls = getattr(errors, type_name, None)
    if isinstance(cls, type) and issubclass(cls, RefitError):
        try:
            return cls(message)
        except TypeError:  # a class whose constructor takes more than a message
            pass
    return EngineError(f"{type_name}: {message}")


def _parse_call(payload: Any) -> tuple[str, list]:
    """(method, args) of a `refit_call` payload; refuses a method outside `SERVER_METHODS`, and anything not JSON."""
    try:
        call = json.loads(payload) if isinstance(payload, str) else None
    except ValueError:
        call = None
    if not (isinstance(call, dict) and isinstance(call.get("method"), str) and isinstance(call.get("args", []), list)):
        raise ConfigError('refit_call takes a JSON string {"method": ..., "args": [...]}; nothing else is accepted')
    method, args = call["method"], call.get("args", [])
    if method not in SERVER_METHODS:
        raise ConfigError(f"refit_call refuses method {method!r}: only refit's worker methods can be called "
                          f"({', '.join(sorted(SERVER_METHODS))})")
    if method == "update_weights" and not (len(args) == 1 and isinstance(args[0], dict) and "tensors" not in args[0]
                                           and "contents" in args[0]):
        raise ConfigError("update_weights through a server's /collective_rpc takes a bucket's `contents` only "
                          "(its bytes arrive over the collective group); tensors never cross HTTP")
    if method == "update_weights" and any(not isinstance(part, list) or len(part) != 5 or part[3:] != [None, None]
                                          for part in args[0]["contents"] or [None]):
        # A part's fourth field is a CUDA IPC handle, which a worker opens as GPU memory, and its fifth a memory file of
        # the trainer's, which a worker maps: never from the network.
        raise ConfigError("update_weights through a server's /collective_rpc takes contents without IPC handles or "
                          "shared-memory files (a vllm serve replica refuses the ipc and shm transports)")
    return method, args


def max_over_ranks(per_rank: list[AmaxRows]) -> AmaxRows:
    """Attention amax measured by each tensor-parallel worker (each sees its own heads): the max over them."""
    amax: dict[tuple[str, str], float] = {}
    for rows in per_rank:
        for module, scale, value in rows:
            amax[(module, scale)] = max(amax.get((module, scale), 0.0), value)
    return [(module, scale, value) for (module, scale), value in amax.items()]


def refuse_engine_without_refit(vllm_config: Any) -> None:
    """Raise `ConfigError`, naming each setting, if a running engine lacks what `engine_kwargs()` adds: refit's worker
    extension (its class or a subclass) and its weight-transfer backend.

    Why at once: without them no worker answers a sync's calls, and the first sync would fail on an attribute
    missing in a worker, far from the engine's arguments that lack it.
    """
    problems = []
    extension = str(getattr(vllm_config.parallel_config, "worker_extension_cls", "") or "")
    if not _is_refit_extension(extension):
        problems.append(f"worker_extension_cls is {extension!r}, not {WORKER_EXTENSION!r} or a subclass")
    backend = getattr(getattr(vllm_config, "weight_transfer_config", None), "backend", None)
    if backend != TRANSFER_BACKEND:
        problems.append(f"weight_transfer_config's backend is {backend!r}, not {TRANSFER_BACKEND!r}")
    if problems:
        raise ConfigError("this engine was not started with refit.engine_kwargs() merged into its arguments: "
                          + "; ".join(problems))


def _is_refit_extension(qualname: str) -> bool:
    if qualname == WORKER_EXTENSION:
        return True
    module, _, name = qualname.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name, None) if module else None
    except ImportError:
        return False
    return isinstance(cls, type) and issubclass(cls, RefitWorkerExtension)
