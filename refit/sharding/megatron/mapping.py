"""Where each Hugging Face checkpoint tensor lies in a megatron-core `GPTModel` rank's parameters. Pure logic.

Why this is written here and not taken from a bridge: Megatron-Bridge needs
Transformer Engine and CUDA, and mbridge (0.15.1 installs here) converts
TP-merged tensors, so a rank would gather every tensor before it could send
one; refit sends what each rank holds and quantizes it there. The names are
the ones mbridge and Megatron-Bridge use (`_weight_name_mapping_mcore_to_hf`).

A `Slot` says, for one local parameter and one checkpoint tensor, which
part of the checkpoint tensor the rank holds (`start:stop` along `dim`: rows
for column-parallel and vocab-parallel layers, columns for row-parallel
ones) and where those elements sit in the local parameter (`pieces`: views,
concatenated along `dim`). Because pieces are views, the same slots read a
rank's weights for a sync and write a checkpoint into a fresh model.

Megatron's layouts covered, per TP rank `r` of `tp` (ETP for experts):
- vocab-parallel embedding / output layer: rows `r*Vp/tp ...` of the padded
  vocabulary `Vp`; rows past the checkpoint's vocabulary are padding and
  never leave the rank;
- `linear_qkv`: per query group, its heads' q rows, then k, then v; rank `r`
  holds groups `r*G/tp ...`, so its q, k and v rows are contiguous in the
  checkpoint tensors but interleaved locally (one piece per group);
- `linear_fc1` (gated): the rank's gate rows, then its up rows;
- `linear_proj`, `linear_fc2`: row-parallel, the rank holds a column range;
- norms, q/k norms, the router and its expert bias (a saved buffer): whole
  on every rank;
- experts: `local_experts.{j}` (SequentialMLP) and `linear_fc1.weight{j}`
  (TEGroupedMLP) as per-expert linears; the legacy GroupedMLP's
  `weight1`/`weight2` hold every local expert's transposed weights in one
  buffer. Expert `j` of EP rank `e` is global expert `e * E/ep + j`.

The checkpoint names are the same for every family in the dense layers;
a MoE layer's are the family's (`CheckpointNames`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from refit.errors import ConfigError

__all__ = ["CheckpointNames", "MegatronDims", "Piece", "RankPlace", "Slot", "slots_of"]


@dataclass(frozen=True, slots=True)
class CheckpointNames:
    """What the rollout's checkpoint calls the MoE parts whose names differ between model families.

    Megatron names a MoE layer's parts by role (router, experts, shared
    experts); checkpoints name them by family. The defaults are Qwen2-MoE's
    and Qwen3-MoE's: `mlp.gate` routes over `mlp.experts.{e}.gate_proj`,
    `up_proj` and `down_proj`, beside `mlp.shared_expert` and its
    `mlp.shared_expert_gate`. Dense families have no MoE parts, so any names
    fit them. `for_model_type` gives another family's.
    """

    moe_block: str = "mlp"  # Mixtral's is "block_sparse_moe"
    expert_projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down; Mixtral's w1, w3, w2
    shared_expert: str = "mlp.shared_expert"  # DeepSeek's is "mlp.shared_experts"

    @classmethod
    def for_model_type(cls, model_type: str) -> CheckpointNames:
        """The names of a Hugging Face `model_type` (its config.json's); the defaults for a family not listed."""
        return _FAMILY_NAMES.get(model_type, cls())


_FAMILY_NAMES = {"mixtral": CheckpointNames("block_sparse_moe", ("w1", "w3", "w2"))}


@dataclass(frozen=True, slots=True)
class MegatronDims:
    """The model's global sizes (from its `TransformerConfig`) and the checkpoint's vocabulary."""

    hidden: int
    heads: int
    query_groups: int
    head_dim: int
    ffn: int
    vocab: int  # the checkpoint's rows; Megatron's embedding may be padded past it
    padded_vocab: int
    tied: bool
    num_experts: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    names: CheckpointNames = CheckpointNames()


@dataclass(frozen=True, slots=True)
class RankPlace:
    """Where a rank sits: its tensor-parallel rank for dense layers, and for experts its EP and expert-TP ranks."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1


@dataclass(frozen=True, slots=True)
class Piece:
    """A view of a local parameter: optionally reshaped, indexed, then transposed."""

    index: tuple[slice, ...]
    reshape: tuple[int, ...] | None = None
    at: int | None = None  # index into the reshaped first dimension (one GroupedMLP expert)
    transpose: bool = False

    def view(self, param: torch.Tensor) -> torch.Tensor:
        value = param.view(self.reshape) if self.reshape is not None else param
        if self.at is not None:
            value = value[self.at]
        value = value[self.index]
        return value.t() if self.transpose else value


@dataclass(frozen=True, slots=True)
class Slot:
    """One checkpoint tensor's part held by one local parameter."""

    target: str
    shape: tuple[int, ...]  # the checkpoint tensor's global shape
    dim: int  # 0: the rank holds rows start:stop; 1: columns
    start: int
    stop: int
    pieces: tuple[Piece, ...]
    group: str | None  # "tp" or "etp": the ranks that hold the other parts; None: whole here
    kind: str  # "linear", "norm", "embedding" or "buffer": the module class the checkpoint's model gives it
    sends: bool = True  # False: a copy the rank keeps in sync but another parameter sends (a tied output layer)

    def views(self, param: torch.Tensor) -> list[torch.Tensor]:
        return [piece.view(param) for piece in self.pieces]

    def read(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor, from `param`."""
        views = self.views(param)
        return views[0] if len(views) == 1 else torch.cat(views, self.dim)

    def write(self, param: torch.Tensor, part: torch.Tensor) -> None:
        """Put this rank's part (`part`, already cut to `start:stop`) into `param`."""
        offset = 0
        for view in self.views(param):
            size = view.shape[self.dim]
            view.copy_(part.narrow(self.dim, offset, size))
            offset += size


_DENSE_GATE_UP = ("gate_proj", "up_proj")  # every family's dense and shared-expert MLPs
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_LOCAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")
_NORMS = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # Transformer Engine's fused norm
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
}


def slots_of(name: str, local_shape: tuple[int, ...], dims: MegatronDims, place: RankPlace,
             global_layer: Callable[[int], int]) -> list[Slot]:
    """The checkpoint tensors parameter (or saved buffer) `name`, as `GPTModel.state_dict` names it, holds parts of.

    `global_layer(i)`: the global 0-based number of local decoder layer `i`
    (pipeline stages number their layers from 0). Raises `ConfigError`
    naming the parameter for one refit does not know, and for a local shape
    that disagrees with `dims` and `place`.
    """
    slots = _slots(name, dims, place, global_layer)
    if slots is None:
        raise ConfigError(f"megatron parameter {name} {local_shape}: refit does not know where it goes in the checkpoint")
    if not slots:
        return slots  # an embedding shard of padding rows only
    expected = _local_shape(slots[0], dims, place, name)
    if expected is not None and tuple(local_shape) != expected:
        raise ConfigError(f"megatron parameter {name}: local shape {tuple(local_shape)}, expected {expected} for "
                          f"{dims} at {place}")
    return slots


def _slots(name: str, dims: MegatronDims, place: RankPlace, global_layer: Callable[[int], int]) -> list[Slot] | None:
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        target = "model.embed_tokens.weight" if name.startswith("embedding") or dims.tied else "lm_head.weight"
        return _vocab_rows(target, dims, place, sends=not (name == "output_layer.weight" and dims.tied))
    if name == "decoder.final_layernorm.weight":
        return [_whole("model.norm.weight", (dims.hidden,), "norm")]
    match = _LAYER.match(name)
    if match is None:
        return None
    prefix, rest = f"model.layers.{global_layer(int(match.group(1)))}.", match.group(2)
    if rest in _NORMS:
        size = dims.head_dim if "_layernorm" in rest and "self_attention" in rest else dims.hidden
        return [_whole(prefix + _NORMS[rest], (size,), "norm")]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        return _qkv(prefix + "self_attn.", rest.rpartition(".")[2], dims, place)
    if rest == "self_attention.linear_proj.weight":
        return [_columns(prefix + "self_attn.o_proj.weight", dims.hidden, dims.heads * dims.head_dim, place.tp_rank,
                         place.tp_size, "tp")]
    if rest == "mlp.linear_fc1.weight":
        return _gate_up(prefix + "mlp.", _DENSE_GATE_UP, dims.ffn, dims.hidden, place.tp_rank, place.tp_size, "tp")
    if rest == "mlp.linear_fc2.weight":
        return [_columns(prefix + "mlp.down_proj.weight", dims.hidden, dims.ffn, place.tp_rank, place.tp_size, "tp")]
    if rest == "mlp.router.weight":
        return [_whole(f"{prefix}{dims.names.moe_block}.gate.weight", (dims.num_experts, dims.hidden), "linear")]
    if rest == "mlp.router.expert_bias":  # a saved buffer; DeepSeek-V3's and GLM-4.5's checkpoints name it so
        return [_whole(f"{prefix}{dims.names.moe_block}.gate.e_score_correction_bias", (dims.num_experts,), "buffer")]
    if rest.startswith("mlp.shared_experts."):
        return _shared_expert(prefix + dims.names.shared_expert + ".", rest.removeprefix("mlp.shared_experts."), dims, place)
    return _expert(prefix, rest, dims, place)


def _whole(target: str, shape: tuple[int, ...], kind: str) -> Slot:
    return Slot(target, shape, 0, 0, shape[0], (Piece((slice(None),)),), None, kind)


def _vocab_rows(target: str, dims: MegatronDims, place: RankPlace, sends: bool) -> list[Slot]:
    per_rank = _divide(dims.padded_vocab, place.tp_size, "the padded vocabulary")
    start = place.tp_rank * per_rank
    stop = min(start + per_rank, dims.vocab)
    if stop <= start:
        return []  # this rank holds padding rows only
    piece = Piece((slice(0, stop - start),))
    return [Slot(target, (dims.vocab, dims.hidden), 0, start, stop, (piece,), "tp", "embedding" if "embed" in target
                 else "linear", sends)]


def _qkv(prefix: str, kind: str, dims: MegatronDims, place: RankPlace) -> list[Slot]:
    """q, k and v rows of the rank's query groups; `kind` is "weight" or "bias"."""
    groups = _divide(dims.query_groups, place.tp_size, "the query groups (num_query_groups)")
    per_group = _divide(dims.heads, dims.query_groups, "the attention heads per query group") * dims.head_dim
    stride = per_group + 2 * dims.head_dim  # rows of one group: its q heads, its k head, its v head
    first = place.tp_rank * groups
    slots = []
    for name, offset, rows, total in (("q_proj", 0, per_group, dims.heads * dims.head_dim),
                                      ("k_proj", per_group, dims.head_dim, dims.query_groups * dims.head_dim),
                                      ("v_proj", per_group + dims.head_dim, dims.head_dim, dims.query_groups * dims.head_dim)):
        pieces = tuple(Piece((slice(g * stride + offset, g * stride + offset + rows),)) for g in range(groups))
        shape = (total, dims.hidden) if kind == "weight" else (total,)
        slots.append(Slot(f"{prefix}{name}.{kind}", shape, 0, first * rows, (first + groups) * rows, pieces,
                          "tp" if place.tp_size > 1 else None, "linear"))
    return slots


def _gate_up(prefix: str, names: tuple[str, ...], ffn: int, hidden: int, rank: int, size: int, group: str) -> list[Slot]:
    """A gated fc1: the rank's gate rows, then its up rows (checkpoint tensors `names[0]` and `names[1]`)."""
    rows = _divide(ffn, size, f"{prefix}: the MLP's hidden size")
    return [Slot(f"{prefix}{name}.weight", (ffn, hidden), 0, rank * rows, (rank + 1) * rows,
                 (Piece((slice(i * rows, (i + 1) * rows),)),), group if size > 1 else None, "linear")
            for i, name in enumerate(names[:2])]


def _columns(target: str, rows: int, columns: int, rank: int, size: int, group: str) -> Slot:
    """A row-parallel linear: the rank holds columns of the checkpoint tensor."""
    per_rank = _divide(columns, size, f"{target}: its input size")
    return Slot(target, (rows, columns), 1, rank * per_rank, (rank + 1) * per_rank, (Piece((slice(None),)),),
                group if size > 1 else None, "linear")


def _shared_expert(prefix: str, rest: str, dims: MegatronDims, place: RankPlace) -> list[Slot] | None:
    if rest == "linear_fc1.weight":
        return _gate_up(prefix, _DENSE_GATE_UP, dims.shared_ffn, dims.hidden, place.tp_rank, place.tp_size, "tp")
    if rest == "linear_fc2.weight":
        return [_columns(prefix + "down_proj.weight", dims.hidden, dims.shared_ffn, place.tp_rank, place.tp_size, "tp")]
    if rest == "gate_weight":
        return [_whole(prefix.removesuffix(".") + "_gate.weight", (1, dims.hidden), "linear")]
    return None


def _expert(prefix: str, rest: str, dims: MegatronDims, place: RankPlace) -> list[Slot] | None:
    local = _divide(dims.num_experts, place.ep_size, "the experts (num_moe_experts)")
    first = place.ep_rank * local
    if match := _LOCAL_EXPERT.match(rest) or _TE_EXPERT.match(rest):
        which, fc = (match.group(1), match.group(2)) if rest.startswith("mlp.experts.local") else (match.group(2), match.group(1))
        expert = f"{prefix}{dims.names.moe_block}.experts.{first + int(which)}."
        if fc == "linear_fc1":
            return _gate_up(expert, dims.names.expert_projections, dims.moe_ffn, dims.hidden, place.etp_rank, place.etp_size,
                            "etp")
        down = f"{expert}{dims.names.expert_projections[2]}.weight"
        return [_columns(down, dims.hidden, dims.moe_ffn, place.etp_rank, place.etp_size, "etp")]
    if rest in ("mlp.experts.weight1", "mlp.experts.weight2"):
        return _grouped(prefix, rest, dims, place, local, first)
    return None


def _grouped(prefix: str, rest: str, dims: MegatronDims, place: RankPlace, local: int, first: int) -> list[Slot]:
    """The legacy GroupedMLP: `weight1` is (experts, hidden, 2*ffn) and `weight2` (experts, ffn, hidden) in one buffer."""
    if place.etp_size != 1:
        raise ConfigError("megatron's legacy GroupedMLP with expert tensor parallelism > 1 is not supported; "
                          "use SequentialMLP or TEGroupedMLP (moe_grouped_gemm with Transformer Engine)")
    ffn, hidden = dims.moe_ffn, dims.hidden
    gate, up, down = dims.names.expert_projections
    slots = []
    for j in range(local):
        expert = f"{prefix}{dims.names.moe_block}.experts.{first + j}."
        if rest.endswith("weight1"):
            for i, name in enumerate((gate, up)):
                piece = Piece((slice(None), slice(i * ffn, (i + 1) * ffn)), reshape=(local, hidden, 2 * ffn), at=j,
                              transpose=True)
                slots.append(Slot(f"{expert}{name}.weight", (ffn, hidden), 0, 0, ffn, (piece,), None, "linear"))
        else:
            piece = Piece((slice(None),), reshape=(local, ffn, hidden), at=j, transpose=True)
            slots.append(Slot(f"{expert}{down}.weight", (hidden, ffn), 0, 0, hidden, (piece,), None, "linear"))
    return slots


def _local_shape(slot: Slot, dims: MegatronDims, place: RankPlace, name: str) -> tuple[int, ...] | None:
    """The shape `name` must have on this rank, where one slot tells it (None: checked by its pieces alone)."""
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias")):  # not Transformer Engine's `linear_qkv.layer_norm_weight`
        groups = dims.query_groups // place.tp_size
        rows = groups * (dims.heads // dims.query_groups + 2) * dims.head_dim
        return (rows, dims.hidden) if name.endswith("weight") else (rows,)
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (dims.padded_vocab // place.tp_size, dims.hidden)
    if slot.pieces[0].reshape is not None:
        return None
    if ".linear_fc1.weight" in name:  # gate rows, then up rows (`linear_fc1.weight{j}` for a TEGroupedMLP expert)
        return (2 * (slot.stop - slot.start), slot.shape[1])
    if slot.dim == 1:
        return (slot.shape[0], slot.stop - slot.start)
    return slot.shape


def _divide(total: int, parts: int, what: str) -> int:
    if parts <= 0 or total % parts:
        raise ConfigError(f"{what}: {total} does not split evenly over {parts} ranks")
    return total // parts
