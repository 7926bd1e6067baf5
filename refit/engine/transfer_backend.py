"""refit's backend for vLLM's weight-transfer subsystem (worker side).

vLLM 0.32 owns the update lifecycle in each worker: `start_weight_update`,
any number of `update_weights` chunks, `finish_weight_update`, driven through
`collective_rpc`. Its built-in backends (nccl, ipc, sharded_rdt) move bytes
GPU to GPU; refit's bytes come by one of three transports (below): in the
update payload from Ray's object store, by a broadcast from the trainer, or
as a CUDA IPC handle of the trainer's memory; for the last two this backend
receives or opens the bytes itself. However they came, it loads them: it
wraps vLLM's layerwise reload exactly as the nccl backend does, and adds
what refit needs on top:

- provenance: which scales each sync streamed, from the parameter names
  `load_weights` reports as loaded (not from what the trainer claims);
- completeness: an update that left any weight of the model unloaded, or
  that the reload would finalize without its bytes (`LayerwiseReload.unfilled`),
  is refused before it is finalized (a trainer missing a layer would otherwise
  leave a mix of old and new weights that matches neither model);
- `abandon`: closing a failed update so every layer is whole again (vLLM's
  worker drops its session flag on an error but leaves the layers in their
  loadable, half-filled form).

The bytes arrive one of three ways (`SyncConfig.transport`): as tensors in
the update payload (`ray`: the rollout actor fetched them from the object
store), broadcast into this worker's buffers over a collective group with
the trainer (`collective`), or as a CUDA IPC handle of the trainer's GPU
memory (`ipc`). In the last two only a table of contents crosses the RPC, so
they work with the engine core in its own process; this worker then turns
the bucket into loadable tensors itself, with the plan it was given at the
start of the update.

Registered by name ("refit") from a `vllm.general_plugins` entry point, so
every vLLM process knows it; engines opt in with
`weight_transfer_config={"backend": "refit"}`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from refit.engine.compat import incompatible_vllm, require_vllm_release
from refit.engine.config import TRANSFER_BACKEND
from refit.engine.lora import unwrap_lora_layers
from refit.engine.readback import scale_mismatches
from refit.engine.vllm_logs import layers_left_unloaded
from refit.errors import EngineError, LifecycleError, VerificationError

try:
    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine,
        WeightTransferInitInfo,
        WeightTransferUpdateInfo,
    )
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.platforms import current_platform

    from refit.engine.layerwise import LayerwiseReload, Unfilled, outermost  # vLLM's reload, with tied aliases kept out
except ImportError as error:  # vLLM only logs a plugin that fails to import
    raise incompatible_vllm("weight-transfer backend", f"an import fails ({error})") from error
from refit.plan.data_path import loadable_tensors
from refit.plan.transfer_plan import DRAFT_PREFIX, TransferPlan
from refit.provenance import (
    AttentionAmaxRecorder,
    ScaleProvenanceTracker,
    checkpoint_tensor_names,
    refuse_invalid_scales,
)
from refit.provenance.kv_stage import live_attention_scales, restore_attention_scales
from refit.provenance.tracker import is_attention_layer
from refit.transport.buckets import BucketContents
from refit.transport.collective import BucketReceiver, CollectiveGroup, Rendezvous
from refit.transport.delta import ReplicaBase
from refit.transport.kinds import TransportKind, transport_kind

__all__ = ["DraftModel", "RefitTransferBackend", "RefitUpdateInfo", "backend_of", "register"]

log = logging.getLogger("refit.engine")


class DraftModel:
    """A speculative draft model updated inside the target's update: its own layerwise reload, weights and provenance.

    Why inside the target's update rather than as vLLM's separate draft session (`start_draft_weight_update`): one
    update is one version, finished or abandoned as a whole, so no draft ever serves beside another version of its
    target, and the replica's pause, verification and lease cover both. Its reload opens when its first tensor
    arrives, so a sync that sends no draft tensors (a frozen draft) never touches it.

    An MTP drafter (`method="mtp"`) shares modules with its target (vLLM hands it the target's `embed_tokens`
    and `lm_head`): those are the target's weights, loaded and verified with it, so the draft neither expects
    them nor reloads them (`LayerwiseReload`'s `owned_elsewhere`).
    """

    def __init__(self, model: torch.nn.Module, model_config: Any, load_format: str, target: torch.nn.Module) -> None:
        self.model = model
        targets = {id(module) for module in target.modules()}
        # Every path: vLLM places the target's head in an MTP drafter twice (`lm_head`, `shared_head.head`), and a
        # path left attached would put the target's processed head back in loadable form under the draft's reload.
        shared = outermost([name for name, module in model.named_modules(remove_duplicate=False)
                            if name and id(module) in targets])
        self.shared = tuple(f"{name}." for name in shared)
        self.reload = LayerwiseReload(model, model_config, owned_elsewhere=shared)
        self.provenance = ScaleProvenanceTracker(model)
        names = frozenset() if load_format == "dummy" else names_as_loaded(model, checkpoint_tensor_names(model_config.model))
        self.provenance.record_initial_load(load_format, names, getattr(model, "packed_modules_mapping", {}))
        self.loaded: set[str] = set()
        self.expected: frozenset[str] = frozenset()
        self.attention_before: dict[tuple[str, str], torch.Tensor] = {}  # its live attention scales as its reload opened

    def load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Load draft tensors named without the prefix; the first of an update opens the draft's reload."""
        if not self.reload.is_open:
            self.attention_before = live_attention_scales(self.model, self.provenance)
            self.reload.open()
            self.loaded = set()
            self.expected = frozenset(name for name in _expected_weights(self.model)
                                      if not name.startswith(self.shared)) - self.reload.kept_out
        self.loaded |= self.reload.load(tensors)

    def unfilled(self) -> tuple[list[str], Unfilled]:
        """Draft weights this update left unloaded, and what its partly loaded layers would lack (none if it loaded
        none: the draft keeps its version)."""
        if not self.reload.is_open:
            return [], Unfilled((), ())
        return sorted(self.expected - self.loaded), self.reload.unfilled(self.loaded)

    def finalize(self, streamed: set[str], version: int | None) -> None:
        if self.reload.is_open:
            self.reload.close()
            restore_attention_scales(self.model, self.attention_before, self.loaded)  # as the target's (`_finalize`)
            if version is not None:
                self.provenance.record_streamed(self.loaded, streamed, version)


@dataclass
class RefitInitInfo(WeightTransferInitInfo):
    """Nothing to negotiate: each update says its transport (`expect_plan`), or brings tensors over the actor's RPC."""


@dataclass
class RefitUpdateInfo(WeightTransferUpdateInfo):
    """One bucket of sync `version`: its tensors (`ray`), or its table of contents (`collective`, `ipc`, `shm`)."""

    version: int
    tensors: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    verify: bool = False  # check integrity tags, keep the streamed weight scales and read the engine's back at finish
    contents: list | None = None  # `BucketContents.to_plain()` per sending rank: the bytes come over the transport
    next_bucket_bytes: list | None = None  # per sending rank, the next part's size, so its receive is posted before this one loads


class RefitTransferBackend(WeightTransferEngine[RefitInitInfo, RefitUpdateInfo]):
    init_info_cls = RefitInitInfo
    update_info_cls = RefitUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        rewrap = unwrap_lora_layers(model)  # scales are named as the checkpoint names them, with LoRA on too
        try:
            self.provenance = ScaleProvenanceTracker(model)
            load_format = str(vllm_config.load_config.load_format)
            names = (frozenset() if load_format == "dummy"
                     else names_as_loaded(model, checkpoint_tensor_names(vllm_config.model_config.model)))
            self.provenance.record_initial_load(load_format, names, getattr(model, "packed_modules_mapping", {}))
        finally:
            rewrap()
        self._rewrap_lora: Callable[[], None] = _nothing
        self.amax_recorder: AttentionAmaxRecorder | None = None  # set during a KV-scale recompute
        self._update_version: int | None = None
        self._loaded: set[str] = set()  # vLLM parameter names load_weights reported
        self._streamed: set[str] = set()  # checkpoint names of the tensors it was given
        self._attention_before: dict[tuple[str, str], torch.Tensor] = {}  # the live attention scales as it opened
        self._expected: frozenset[str] = frozenset()
        self._reload: LayerwiseReload | None = None  # of the open update
        self._plan: TransferPlan | None = None  # of the open update, when bytes come over a transport
        self._kind: TransportKind | None = None  # which one (a transport whose bytes come by contents)
        self._receivers: list[BucketReceiver] = []  # one per sending rank (channel) of the collective group
        self._group_id: str | None = None  # the collective group the receivers belong to
        self.base = ReplicaBase()  # the delta base, when bytes come over the collective group (refit/transport/delta.py)
        self._keep_base = False
        self.draft: DraftModel | None = None  # the speculative draft model, once the worker attached it

    def init_transfer_engine(self, init_info: RefitInitInfo) -> None:
        pass

    def attach_draft(self, model: torch.nn.Module | None, model_config: Any) -> None:
        """The engine's speculative draft model (once; from the worker, which holds it)."""
        if model is not None and self.draft is None:
            self.draft = DraftModel(model, model_config, str(self.vllm_config.load_config.load_format), self.model)

    def start_weight_update(self) -> None:
        """Put every layer in loadable form; buffers incoming tensors per layer.

        With LoRA on, vLLM's LoRA layers leave the model's tree until the update is finished or abandoned
        (`unwrap_lora_layers` says why)."""
        self._rewrap_lora()
        # The last update's state goes first: an abandon after a failed open must not record that update again.
        self._plan = None
        self._update_version = None
        self._loaded = set()
        self._streamed = set()
        self._sent_scales: dict[str, torch.Tensor] = {}
        self._verify = False
        self._rewrap_lora = unwrap_lora_layers(self.model)
        self._attention_before = live_attention_scales(self.model, self.provenance)
        self._reload = LayerwiseReload(self.model, self.model_config)
        self._reload.open()
        self._expected = _expected_weights(self.model) - self._reload.kept_out

    # -- transports ---------------------------------------------------------------
    def join_group(self, rendezvous: Rendezvous, member: int) -> None:
        """Join a collective group as `member` (leaving any earlier one); blocks until every member joined."""
        self.leave_group()
        self._receivers = [BucketReceiver(group) for group in CollectiveGroup.join(rendezvous, member)]
        self._group_id = rendezvous.group_id

    def leave_group(self, group_id: str | None = None) -> None:
        """Leave collective group `group_id`, or whichever this worker is in (None); a group other than `group_id`
        is kept: the caller is not the one that joined this worker to it (a replica a server was taken over from)."""
        if group_id is not None and self._group_id not in (None, group_id):
            return
        receivers, self._receivers, self._group_id = self._receivers, [], None
        for receiver in receivers:
            receiver.group.close()

    def expect_plan(self, plan: TransferPlan, transport: str, *, keep_base: bool = False) -> None:
        """This update's bytes come over `transport` ("collective", "ipc" or "shm"), in buckets of `plan`.

        Called right after `start_weight_update`; the sync joins (or
        re-joins) its collective group after this. `keep_base`: keep what
        arrives as the delta base, which rebuilds the deltas that arrive.
        """
        kind = transport_kind(transport)
        kind.prepare_worker()  # before anything of the update changes: a worker that cannot receive refuses here
        for receiver in self._receivers:
            receiver.clear()
        self._plan = plan
        self._kind = kind
        self._keep_base = keep_base
        if keep_base:
            self.base.begin()
        else:
            self.base.clear()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():  # copies into device params are asynchronous
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: RefitUpdateInfo) -> None:
        """Load one bucket; each layer is processed as soon as it is complete."""
        if self._reload is None:
            raise LifecycleError("a bucket arrived before any update was started (start_weight_update)")
        if self._update_version not in (None, update_info.version):
            raise LifecycleError(
                f"bucket of version {update_info.version} arrived during the update to version "
                f"{self._update_version}; finish or abandon that update first"
            )
        self._update_version = update_info.version
        parts = None if update_info.contents is None else [BucketContents.from_plain(p) for p in update_info.contents]
        tensors, spans = (update_info.tensors, []) if parts is None else self._arrived(parts, update_info)
        refuse_invalid_scales(tensors)  # before anything of this bucket is loaded
        self._streamed |= {name for name, _ in tensors}  # before loading: a load that fails half-way changed the model
        target = [(name, tensor) for name, tensor in tensors if not name.startswith(DRAFT_PREFIX)]
        draft = [(name.removeprefix(DRAFT_PREFIX), tensor) for name, tensor in tensors if name.startswith(DRAFT_PREFIX)]
        if draft and self.draft is None:
            raise LifecycleError(f"draft tensors arrived ({draft[0][0]}, ...) but this engine has no draft model")
        try:
            if target:
                self._loaded |= self._reload.load(target)  # a tied alias's bytes arrive through its tie
            if draft:
                self.draft.load(draft)
            # Scales are 1/16384 of their weights: cheap to keep until finish. Copied before the rewrite check below,
            # so the check covers these copies too.
            sent_scales = {n: t.detach().clone() for n, t in tensors if n.endswith("weight_scale")} if update_info.verify else {}
        except BaseException as error:
            if parts is not None:  # the abandon that follows finalizes layers from what they hold: not the buffer
                try:
                    copy_out_held(spans)
                except Exception as copying:  # noqa: BLE001 - the load's failure is the one to raise
                    error.add_note(f"copying what the reload held out of the bucket's buffer failed too: {copying!r}")
            raise
        if parts is not None:
            copy_out_held(spans)
            self._kind.loaded(parts)  # bytes another writer changed while they loaded or were copied out (shm): refused
        self._verify = update_info.verify
        self._sent_scales |= sent_scales

    def _arrived(self, parts: list[BucketContents], update_info: RefitUpdateInfo) -> tuple[list[tuple[str, torch.Tensor]],
                                                                                            list[tuple[int, int]]]:
        """The bucket whose contents (one part per sending rank) the update names, received over the transport, as
        loadable tensors, and the address spans of the buffers they view (which the transport reuses)."""
        if self._plan is None:
            raise LifecycleError("a bucket's contents arrived, but this update was not told its plan (expect_plan)")
        kind = self._kind
        if any(part.ipc_handle is not None for part in parts) and not kind.traits.opens_ipc_handles:
            # A handle opens another process's GPU memory: only where this update expects one.
            raise LifecycleError(f"a bucket arrived with CUDA IPC handles during a {kind.name} update; refused")
        if any(part.shm is not None for part in parts) and not kind.traits.maps_shared_memory:
            raise LifecycleError(f"a bucket arrived naming shared memory during a {kind.name} update; refused")
        bucket = kind.receive(parts, self._receivers, list(update_info.next_bucket_bytes), self.device)
        tensors = loadable_tensors(self._plan, bucket, verify=update_info.verify, base=self.base if self._keep_base else None)
        return tensors, [_span(part.buffer) for part in bucket]

    def streamed(self) -> list[str]:
        """Checkpoint names of every tensor this update loaded so far."""
        return sorted(self._streamed)

    def finish_weight_update(self) -> None:
        """Refuse an incomplete update, else finalize layerwise reload (attention layers last) and record provenance.

        An incomplete update raises with the reload still open, so the caller's
        `abandon` closes it and the replica refuses to serve.
        """
        unfilled = self._reload.unfilled(self._loaded)
        draft_missing, draft_unfilled = self.draft.unfilled() if self.draft is not None else ([], Unfilled((), ()))
        bypassed = [*unfilled.bypassed, *(DRAFT_PREFIX + name for name in draft_unfilled.bypassed)]
        missing = sorted((self._expected - self._loaded) | set(unfilled.left_out))
        missing += [DRAFT_PREFIX + name for name in sorted({*draft_missing, *draft_unfilled.left_out})]
        problems = []
        if bypassed:
            loaders = [f"{type(model).__name__}.load_weights" for model, names in
                       ((self.model, unfilled.bypassed), (self.draft and self.draft.model, draft_unfilled.bypassed)) if names]
            problems.append(
                f"vLLM's {' and '.join(loaders)} wrote {len(bypassed)} tensor(s) itself rather than through their weight "
                f"loaders, e.g. {bypassed[:6]}: vLLM's layerwise reload never received those bytes, and would serve "
                "uninitialized memory or what they held before (a limitation of that loader in vLLM)"
            )
        if missing:
            problems.append(
                f"the update left {len(missing)} tensor(s) of the model unloaded, e.g. {missing[:6]}; the trainer's "
                "model lacks tensors the rollout's model has (a different architecture or size?)"
            )
        if problems:
            raise EngineError("; and ".join(problems) + ", so this replica will not serve the mix")
        self._finalize()
        self._plan = None
        if self._keep_base:
            self.base.finish()
        self.provenance.record_streamed(self._loaded, self._streamed, self._update_version)
        # Recorded: an abandon after this (a later step of the update failed) must not record it again, over what
        # the post-refit stage recorded since.
        self._update_version = None
        if self._verify and current_platform.is_cpu():  # elsewhere kernels may keep scales in a layout of their own
            wrong = scale_mismatches(self.model, self.provenance, self._sent_scales)
            if self.draft is not None:
                sent = {name.removeprefix(DRAFT_PREFIX): t for name, t in self._sent_scales.items()
                        if name.startswith(DRAFT_PREFIX)}
                wrong += [DRAFT_PREFIX + w for w in scale_mismatches(self.draft.model, self.draft.provenance, sent)]
            if wrong:
                raise VerificationError(
                    f"after the reload the engine holds weight scales that differ from what the sync sent, in "
                    f"{len(wrong)} place(s): {', '.join(wrong[:8])}; this replica will not serve them"
                )
        self._sent_scales = {}
        self._restore_lora_layers()

    def abandon(self) -> None:
        """Close an update that failed anywhere: layers that got nothing get their old tensors back."""
        self._plan = None
        self.base.abort()
        if self._reload is not None and self._reload.is_open:
            # vLLM warns once per layer that got nothing; in an abandoned update that is every layer not yet streamed.
            with layers_left_unloaded() as left:
                self._finalize()
            if left:
                log.info("the abandoned update left %d layer(s) with the tensors they held before it", len(left))
        if self._update_version is not None:
            # What was loaded is live: record it, so provenance stays true.
            self.provenance.record_streamed(self._loaded, self._streamed, self._update_version)
        self._restore_lora_layers()

    def _restore_lora_layers(self) -> None:
        rewrap, self._rewrap_lora = self._rewrap_lora, _nothing
        rewrap()

    def _finalize(self) -> None:
        self._reload.close()
        restored = restore_attention_scales(self.model, self._attention_before, self._loaded)
        if restored:
            log.info("put back %d attention scale(s) the reload reset without receiving them, e.g. %s", len(restored),
                     restored[:4])
        if self.draft is not None:
            self.draft.finalize({n.removeprefix(DRAFT_PREFIX) for n in self._streamed if n.startswith(DRAFT_PREFIX)},
                                self._update_version)

    def shutdown(self) -> None:
        self.leave_group()


def _nothing() -> None:
    pass


def copy_out_held(spans: list[tuple[int, int]]) -> int:
    """Copy every tensor vLLM's layerwise reload still holds that views one of `spans` (address ranges of a received
    bucket's buffers, which the transport writes the next buckets into); returns how many were copied.

    Why after the load, and for any layer: the reload buffers what it is given until a layer has all its elements,
    and some never do before `finalize` (attention scales; a vocabulary the engine pads beyond the checkpoint's
    rows), so which tensors outlive their bucket is known only once `load_weights` returned.
    """
    copied = 0
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and any(start <= value.data_ptr() < end for start, end in spans):
                    bound.arguments[key] = value.clone()
                    copied += 1
    return copied


def _span(buffer: Any) -> tuple[int, int]:
    """The address range of a bucket's buffer (a host array or a tensor)."""
    start = buffer.data_ptr() if isinstance(buffer, torch.Tensor) else buffer.ctypes.data
    return start, start + buffer.nbytes


def _expected_weights(model: torch.nn.Module) -> frozenset[str]:
    """Every parameter, in loadable form (the reload open), is one `load_weights` can report, except the attention
    layers' own (KV-cache scales, zero points): the post-refit stage owns those, and a stream may or may not carry
    them. Buffers: `LayerwiseReload.unfilled`."""
    attention = {name for name, module in model.named_modules() if is_attention_layer(module)}
    return frozenset(name for name, _ in model.named_parameters() if name.rpartition(".")[0] not in attention)


def names_as_loaded(model: torch.nn.Module, names: frozenset[str]) -> frozenset[str]:
    """`names` and, for each KV-cache scale among them, the name vLLM's loader loads it as.

    Why vLLM's own mapper: it alone decides which checkpoint names become which live scale, and a calibrated
    scale saved under a name refit did not know would otherwise read as a placeholder, which the post-refit
    stage resets.
    """
    quant_config = next((m.quant_config for m in (model, *model.children())
                         if getattr(m, "quant_config", None) is not None), None)
    if quant_config is None:  # no KV-cache quant method: vLLM loads no attention scale
        return names
    mapper = quant_config.get_cache_scale_mapper()
    return names | {mapped for name in names if (mapped := mapper.map_name(name)) is not None}


def register() -> None:
    """`vllm.general_plugins` entry point: make the "refit" backend known in this process."""
    require_vllm_release("weight-transfer backend")
    try:
        WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, RefitTransferBackend)
    except ValueError:  # vLLM runs general plugins more than once per process
        pass


def backend_of(worker: Any) -> RefitTransferBackend:
    """The refit backend of a vLLM worker, or a clear error if it was started without it."""
    backend = getattr(worker, "weight_transfer_engine", None)
    if not isinstance(backend, RefitTransferBackend):
        raise EngineError(
            "this vLLM engine was not started with weight_transfer_config={'backend': 'refit'}; "
            "start it through refit (actors.RolloutActor, or vllm.LLM(**EngineConfig(...).llm_kwargs(on_gpu=...)))"
        )
    return backend
