"""A megatron-core `GPTModel` rank as a `RankLayout`: its parameters read through the mapping's slots.

Which rank sends what: ranks of one tensor-parallel group hold parts of the
same checkpoint tensors; pipeline stages hold different layers; data-parallel
replicas hold the same parts, and only the first replica (data-parallel rank
0; for experts, expert-data-parallel rank 0) reports them, so every part has
one sender. Parts a rank cannot send as rows (a row-parallel layer's columns,
rows that split an FP8 block) are all-gathered over the tensor-parallel (or
expert-tensor-parallel) group that holds them, never over the whole job.

megatron-core is imported here only, and only when a layout is made.
"""

from __future__ import annotations

import torch

from refit.errors import ConfigError, InvalidTensorError
from refit.plan.checkpoint_format import HeldTensors, state_tensors
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import TransferPlan
from refit.quantizer.fp8_block import is_finite
from refit.sharding.layout import ABSENT, attempt_part, raise_if_a_part_failed
from refit.sharding.megatron.mapping import CheckpointNames, MegatronDims, RankPlace, Slot, slots_of
from refit.sharding.routes import RowRange

__all__ = ["MegatronLayout", "megatron_dims", "megatron_slots", "unwrap"]

# What the checkpoint's model calls each kind of module (the FP8 scheme's targets match these class names).
_MODULE_CLASSES = {"linear": ("Linear", "Module"), "norm": ("RMSNorm", "Module"), "embedding": ("Embedding", "Module"),
                   "buffer": ("Module",)}


class MegatronLayout:
    """`RankLayout` of one megatron-core rank; `vocab_size` is the checkpoint's (Megatron pads its own), `names` what
    it calls the MoE parts."""

    def __init__(self, model: torch.nn.Module, *, vocab_size: int, wire_dtype: torch.dtype = torch.bfloat16,
                 names: CheckpointNames | None = None) -> None:
        from megatron.core import parallel_state

        self.model = unwrap(model)
        self._pending_gathers = _overlapped_param_gathers(model)
        self.wire_dtype = wire_dtype
        self.dims = megatron_dims(self.model, vocab_size, names)
        self.place = RankPlace(
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            ep_size=parallel_state.get_expert_model_parallel_world_size(),
            etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
            etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        )
        self._groups = {"tp": parallel_state.get_tensor_model_parallel_group(),
                        "etp": parallel_state.get_expert_tensor_parallel_group()}
        # Context-parallel ranks hold the same weights too: counted in, or every copy would send them.
        self._first_replica = {False: parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0,
                               True: parallel_state.get_expert_data_parallel_rank() == 0}
        self._unreadable: ConfigError | None = None  # why the model's current parameters could not be read
        self._sent_from: dict[str, str] = {}  # every checkpoint tensor this rank has sent parts of -> its megatron name
        self._read_current_parameters()

    def _read_current_parameters(self) -> None:
        """Map each sent tensor to the parameter the model holds now.

        Why: a parameter can be replaced outright (`load_state_dict(..., assign=True)`), and the model computes with
        the new one; a layout that kept the objects it first read would send the old weights, silently."""
        held = HeldTensors(self.model)
        sends: dict[str, tuple[torch.Tensor, Slot]] = {}
        sent_from: dict[str, str] = {}
        for name, param, slot in megatron_slots(self.model, self.dims, self.place):
            if slot.sends and self._first_replica[".mlp.experts." in f".{name}"]:
                sends[slot.target] = (param, slot)
                sent_from[slot.target] = name
        # Only once all are placed: a failure leaves them to be read again. The shapes too: a parameter's `.data`
        # may be swapped for another shape in place, which its slots were not made for.
        self._held = held
        self._sends = sends
        self._sent_from |= sent_from  # kept for tensors gone since: `_refuse_removed` names their parameter

    def finish_parameter_updates(self) -> None:
        """Finish the distributed optimizer's all-gather of the updated parameters, which `overlap_param_gather`
        leaves to the next forward pass: until then each data-parallel rank's parameters are new only where its
        optimizer shard lies, and the sync would send a mix of two steps. Megatron does the same before it
        evaluates or saves (`disable_forward_pre_hook(param_sync=True)`); a collective over data-parallel ranks.
        Then the parameters are read as the model holds them now (`_read_current_parameters`)."""
        for wrapper in self._pending_gathers:
            wrapper.start_param_sync(force_sync=True)
        self._unreadable = None
        if self._held.outdated():
            try:
                self._read_current_parameters()
            except ConfigError as error:  # raised in the preflight, where every rank refuses with it (`check_finite`)
                self._unreadable = error

    def metadata(self) -> list[TensorMeta]:
        return [TensorMeta(slot.target, slot.shape, self._dtype(param), _MODULE_CLASSES[slot.kind])
                for param, slot in self._sends.values()]

    def held(self, name: str) -> RowRange | None | object:
        if name not in self._sends:
            return ABSENT
        _, slot = self._sends[name]
        if slot.dim == 0:
            return (slot.start, slot.stop)
        return (0, slot.shape[0]) if slot.stop - slot.start == slot.shape[1] else None  # all columns: whole

    def rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        param, slot = self._sends[name]
        first = slot.start if slot.dim == 0 else 0
        return self._part(param, slot).narrow(0, start - first, stop - start)

    def joins_gather(self, name: str) -> bool:
        return name in self._sends

    def gathered(self, name: str) -> torch.Tensor:
        """`name` whole: every holder's part, padded to the longest for gloo's and NCCL's equal-sized all-gather.

        Each holder reads its part, then makes room for the gather, before the collective over the tensor's bytes,
        and after each says in a small all-gather whether it could (the first also carries its span, which the room
        is made for), so that every holder raises alike if one could not (`raise_if_a_part_failed`). The spans are
        exchanged at every gather, never kept: a source made again on one rank would know none, and its exchange would
        pair with its peers' next collective."""
        param, slot = self._sends[name]
        if slot.group is None:
            return self._part(param, slot).contiguous()  # held whole here (a tensor the routes gather from one rank)
        group = self._groups[slot.group]
        part, failure = attempt_part(lambda: self._part(param, slot).contiguous())
        exchanged = _agree(name, failure, [slot.start, slot.stop], group, param.device)
        spans = [(start, stop) for start, stop in exchanged]
        buffers, failure = attempt_part(lambda: self._gather_buffers(part, slot, spans))
        _agree(name, failure, [], group, param.device)
        padded, parts, whole = buffers
        padded.narrow(slot.dim, 0, part.shape[slot.dim]).copy_(part)
        torch.distributed.all_gather(parts, padded, group=group)
        for (start, stop), got in zip(spans, parts):
            whole.narrow(slot.dim, start, stop - start).copy_(got.narrow(slot.dim, 0, stop - start))
        return whole

    def _gather_buffers(self, part: torch.Tensor, slot: Slot,
                        spans: list[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
        """This rank's part padded to the longest span (zeros), one such buffer per holder, and the whole tensor."""
        longest = max(stop - start for start, stop in spans)
        shape = [longest if d == slot.dim else n for d, n in enumerate(part.shape)]
        padded = torch.zeros(shape, dtype=part.dtype, device=part.device)
        parts = [torch.empty_like(padded) for _ in spans]
        return padded, parts, torch.empty(slot.shape, dtype=part.dtype, device=part.device)

    def check_finite(self, plan: TransferPlan, rank: int) -> None:
        """Each parameter once, whole; one that holds NaN or Inf is searched for the planned tensors that hold it (a
        fused `linear_qkv` holds q, k and v), and refused only if one does: its vocabulary padding is never sent.

        First refuses a model whose parameters changed into ones the mapping cannot place since the layout was made:
        raised as the stream starts, on this rank alone, it would leave the others waiting in a collective."""
        if self._unreadable is not None:
            raise self._unreadable
        self._refuse_removed(plan, rank)
        held: dict[int, tuple[torch.Tensor, list[tuple[str, Slot]]]] = {}
        for planned in plan.tensors:
            if planned.source in self._sends:
                param, slot = self._sends[planned.source]
                held.setdefault(id(param), (param, []))[1].append((planned.source, slot))
        for param, slots in held.values():
            if is_finite(param.detach()):
                continue
            bad = [name for name, slot in slots if not all(is_finite(view) for view in slot.views(param.detach()))]
            if bad:
                raise InvalidTensorError(f"refusing to send any weight: {', '.join(bad)} "
                                         f"{'holds' if len(bad) == 1 else 'hold'} NaN or Inf on rank {rank} "
                                         f"(in its megatron parameter of shape {tuple(param.shape)})")

    def _refuse_removed(self, plan: TransferPlan, rank: int) -> None:
        """Refuse a plan that holds tensors this rank sent from a parameter since removed from the model.

        Why: the rank no longer holds them, yet routes agreed before (kept per plan) still make it send them, where
        reading them failed mid-stream with a bare `KeyError`; with fresh routes nobody holds them, and the rank
        made to send them failed mid-stream naming neither the parameter nor why."""
        gone: dict[str, list[str]] = {}
        for planned in plan.tensors:
            if planned.source not in self._sends and planned.source in self._sent_from:
                gone.setdefault(self._sent_from[planned.source], []).append(planned.source)
        if gone:
            raise ConfigError("refusing to send any weight: " + "; ".join(
                f"megatron parameter {name} is gone from the model on trainer rank {rank}, and the plan sends "
                f"{', '.join(targets)} from it" for name, targets in gone.items())
                + ": put it back, or make a new plan (a new Syncer) from the model as it is now")

    def shard_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.model.parameters(), *self.model.buffers()))

    def _part(self, param: torch.Tensor, slot: Slot) -> torch.Tensor:
        part = slot.read(param.detach())
        return part.to(self._wire(param))

    def _wire(self, param: torch.Tensor) -> torch.dtype:
        # A buffer keeps its dtype: `wire_dtype` is for parameters (a router's fp32 expert bias picks the experts).
        return self.wire_dtype if param.is_floating_point() and isinstance(param, torch.nn.Parameter) else param.dtype

    def _dtype(self, param: torch.Tensor) -> str:
        return str(self._wire(param)).removeprefix("torch.")


def _agree(name: str, failure: Exception | None, mine: list[int], group: torch.distributed.ProcessGroup,
           device: torch.device) -> list[list[int]]:
    """Every holder's `mine` (ints), in group order, once all said whether their step failed; raises
    `GatherFailedError` on every holder alike if one did (`raise_if_a_part_failed`)."""
    size = torch.distributed.get_world_size(group)
    rows = [torch.zeros(len(mine) + 1, dtype=torch.int64, device=device) for _ in range(size)]
    torch.distributed.all_gather(rows, torch.tensor([*mine, failure is None], dtype=torch.int64, device=device),
                                 group=group)
    rows_as_ints = [row.tolist() for row in rows]
    raise_if_a_part_failed(name, failure, [torch.distributed.get_global_rank(group, i)
                                           for i, row in enumerate(rows_as_ints) if not row[-1]])
    return [row[:-1] for row in rows_as_ints]


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` inside Megatron's wrappers (DistributedDataParallel, Float16Module: each keeps it as `.module`)."""
    if isinstance(model, (list, tuple, torch.nn.ModuleList)):  # what Megatron builds for a rank's virtual stages
        raise ConfigError(f"megatron_source takes one GPTModel (or a wrapper of one), not a list of {len(model)} model "
                          "chunks: refit does not support virtual pipeline parallelism (virtual_pipeline_model_parallel_size)")
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "decoder") or not hasattr(model, "config"):
        raise ConfigError(f"{type(model).__name__} is not a megatron-core GPTModel (or a wrapper of one): it has no decoder")
    return model


def _overlapped_param_gathers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The DistributedDataParallel wrappers around `model` whose distributed optimizer overlaps its parameter
    all-gather with the next forward pass (`finish_parameter_updates`)."""
    wrappers = []
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        config = getattr(model, "ddp_config", None)
        if config is not None and config.use_distributed_optimizer and config.overlap_param_gather:
            wrappers.append(model)
        model = model.module
    return wrappers


def megatron_dims(model: torch.nn.Module, vocab_size: int, names: CheckpointNames | None = None) -> MegatronDims:
    """The global sizes of an (unwrapped) `GPTModel`, from its `TransformerConfig`."""
    config = model.config
    if not config.gated_linear_unit:
        raise ConfigError("refit maps megatron MLPs with a gated linear unit (gate_proj/up_proj); this model has none")
    padded = int(getattr(model, "vocab_size", vocab_size))
    if vocab_size > padded:
        raise ConfigError(f"vocab_size={vocab_size} is larger than the megatron model's vocabulary ({padded})")
    return MegatronDims(
        hidden=config.hidden_size, heads=config.num_attention_heads,
        query_groups=config.num_query_groups or config.num_attention_heads, head_dim=config.kv_channels,
        ffn=config.ffn_hidden_size, vocab=vocab_size, padded_vocab=padded,
        tied=bool(getattr(model, "share_embeddings_and_output_weights", False)),
        num_experts=config.num_moe_experts or 0, moe_ffn=config.moe_ffn_hidden_size or 0,
        shared_ffn=config.moe_shared_expert_intermediate_size or 0, names=names or CheckpointNames(),
    )


def megatron_slots(model: torch.nn.Module, dims: MegatronDims, place: RankPlace) -> list[tuple[str, torch.Tensor, Slot]]:
    """(megatron name, parameter or saved buffer, slot) for every part of a checkpoint tensor this rank's model holds.

    Saved buffers too: a trained one steers the forward like a weight (the router's `expert_bias` with
    `moe_router_enable_expert_bias` picks the experts); left out, the rollouts would route without it and nothing
    would say so. One the mapping cannot place is refused by name like a parameter."""
    layers = {i: layer.layer_number - 1 for i, layer in enumerate(model.decoder.layers)}
    found = []
    for name, param in state_tensors(model).items():
        for slot in slots_of(name, tuple(param.shape), dims, place, layers.__getitem__):
            found.append((name, param, slot))
    return found

