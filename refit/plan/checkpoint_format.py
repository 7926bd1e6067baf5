"""A trainer's model seen in its checkpoint format: the names, shapes and tensors a rollout loads.

Why this exists: a trainer holds its model as transformers builds it in
memory, and since transformers 5 that is not always the checkpoint's layout.
Mixture-of-experts blocks keep their experts fused in 3-D parameters
(`mlp.experts.gate_up_proj` [E, 2*I, H], `mlp.experts.down_proj` [E, H, I]),
while checkpoints, llmcompressor and vLLM's loaders know them per expert as
2-D weights (`mlp.experts.{e}.gate_proj.weight`, each its own FP8_BLOCK
tensor with its own scale). transformers converts on save:
`save_pretrained` applies `revert_weight_conversion`, the inverse of the
conversion mapping registered for the model type. refit applies that same
function, so every model transformers can save is sent in the layout its
checkpoint has, and nothing transformers knows is written again here.

The conversion runs once, on the meta device (no data), on a probe whose
`contiguous()` is a no-op: the pieces then come out as views of the
parameter (each expert's slice of `gate_up_proj` is an offset and strides
into it), and refit reads them as such views of the live parameter. So
building a bucket never copies a layer's experts (transformers' own
conversion makes each piece contiguous, a copy of the whole fused tensor);
only the pieces a bucket holds are quantized or packed. A conversion that
computes new values instead of slicing, or needs several parameters
together, is refused by name.

Why buffers too: a checkpoint is `state_dict()`, which holds a module's
persistent buffers beside its parameters, and vLLM loads them: the
router's `e_score_correction_bias` of DeepSeek-V3-style MoE models (GLM-4.5,
dots1), Apertus' xIELU constants. Sent with the parameters, they reach an
engine as a checkpoint load would bring them; left out, a dummy-loaded
engine routed its experts by dummy biases for ever, and a layer whose
buffers were never loaded came out of vLLM's layerwise reload holding
uninitialized memory. What `save_pretrained` leaves out
(`_keys_to_ignore_on_save`, non-persistent buffers) is left out here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from refit.errors import PlanMismatchError
from refit.plan.tensors import TensorMeta

__all__ = ["CheckpointView", "HeldTensors", "checkpoint_tensors", "describe_weights", "state_tensors"]

# The modules transformers' save conversion cuts out of a parameter (one
# expert's gate, up or down projection) are Linear layers in the checkpoint
# format: llmcompressor quantizes them as Linear, and vLLM matches a "Linear"
# target against its fused experts too (`_add_fused_moe_to_target_scheme_map`).
# A parameter the conversion only renames (a multimodal model's language
# model, moved under `model.` on save; fused experts kept whole) stays what
# its module is.
_CONVERTED_MODULE_CLASSES = ("Linear",)


class _Piece(NamedTuple):
    """Where a checkpoint tensor lies inside its (contiguous) parameter."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


class _ViewProbe(torch.Tensor):
    """A meta tensor whose `contiguous()` returns itself, so conversion pieces stay views of it."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 (torch's protocol)
        if func is torch.Tensor.contiguous:
            return args[0]
        return super().__torch_function__(func, types, args, kwargs or {})


class CheckpointView:
    """A model's checkpoint tensors (parameters and persistent buffers) under their checkpoint names and shapes, as
    metadata and as tensors.

    `metadata()` is what a weight source reports (`WeightSource.weight_metadata`);
    `tensor(name)` is the lookup `produce_buckets` reads values through. Works on
    any `torch.nn.Module`; models transformers has no save conversion for are
    seen as they are.
    """

    def __init__(self, model: torch.nn.Module, *, wire_dtype: torch.dtype | None = None) -> None:
        """`wire_dtype`: the dtype floating-point parameters are reported in and sent as, when it is not
        theirs (fp32 master weights that stream bf16, as FSDP2's mixed precision computes in bf16)."""
        self._model = model
        self._wire_dtype = wire_dtype
        self._held = HeldTensors(model)
        self._tensors = self._held.tensors  # parameters and persistent buffers, as `state_dict` names them
        self._sources: dict[str, str] = {}  # checkpoint name -> the parameter or buffer it is, or is a piece of
        self._pieces: dict[str, _Piece] = {}  # checkpoint name -> where in its parameter a piece lies
        self._metas: list[TensorMeta] = []
        self._describe()

    def metadata(self) -> list[TensorMeta]:
        return list(self._metas)

    def outdated(self) -> bool:
        """Whether the model now holds other tensors than this view reads (`HeldTensors.outdated`): a view kept across
        steps reads only the objects it captured, and describes them as they were, so it must then be made again."""
        return self._held.outdated()

    def reads_current(self, name: str) -> bool:
        """Whether checkpoint tensor `name` is read from the object the model holds now (`outdated` for one tensor,
        without walking the whole model)."""
        return self._held.current(self._sources[name])

    def tensor(self, name: str) -> torch.Tensor:
        """The current value of checkpoint tensor `name` (a view where it is a piece); `KeyError` if unknown."""
        param = self._tensors[self._sources[name]]
        piece = self._pieces.get(name)
        if piece is None:
            value = param
        elif not param.is_contiguous():  # the offsets and strides were learnt on a contiguous probe
            raise PlanMismatchError(f"{self._sources[name]}: not contiguous, so refit cannot read {name} as a view of it")
        else:
            value = param.detach().as_strided(piece.shape, piece.stride, piece.offset)
        return value if value.dtype == self.wire_dtype(param) else value.detach().to(self.wire_dtype(param))

    def wire_dtype(self, param: torch.Tensor) -> torch.dtype:
        """The dtype `param`'s checkpoint tensors are sent in. A buffer keeps its own: `wire_dtype` is for master
        weights, and mixed precision leaves buffers as the model holds them (a router bias kept in fp32, say)."""
        masters = self._wire_dtype is not None and param.is_floating_point() and isinstance(param, torch.nn.Parameter)
        return self._wire_dtype if masters else param.dtype

    def location(self, name: str) -> tuple[torch.Tensor, _Piece | None]:
        """The parameter (or buffer) checkpoint tensor `name` is read from, and where in it the piece lies (None: all of it).

        For readers of sharded parameters, which cannot take a view of the whole (`refit.sharding`).
        """
        return self._tensors[self._sources[name]], self._pieces.get(name)

    def _describe(self) -> None:
        """Metadata in checkpoint form: parameters the conversion leaves alone as they are, the others in pieces.

        The whole model is converted once on the meta device (no data); only
        parameters it renames or reshapes are converted again one by one, to
        learn which pieces each one gives.
        """
        modules = dict(self._model.named_modules(remove_duplicate=False))  # every path a parameter is listed under
        meta = {n: torch.empty(p.shape, dtype=p.dtype, device="meta") for n, p in self._tensors.items()}
        whole = {n: tuple(t.shape) for n, t in _revert(self._model, meta).items()}
        first_name: dict[int, str] = {}
        for name, param in self._tensors.items():
            alias_of = first_name.setdefault(id(param), name)
            dtype = str(self.wire_dtype(param)).removeprefix("torch.")
            classes = tuple(c.__name__ for c in type(modules[name.rpartition(".")[0]]).__mro__)
            if whole.get(name) == tuple(param.shape):
                self._add(TensorMeta(name, tuple(param.shape), dtype, classes, alias_of if alias_of != name else None), name)
                continue
            if alias_of != name:
                raise PlanMismatchError(f"{name}: a tied parameter that transformers converts on save; refit cannot send it")
            probe = meta[name].as_subclass(_ViewProbe)
            for piece, value in _revert(self._model, {name: probe}).items():
                if not torch._C._is_alias_of(value, probe):
                    raise PlanMismatchError(
                        f"{name}: transformers' save conversion computes {piece} from it instead of slicing it, "
                        "which refit does not do"
                    )
                self._pieces[piece] = _Piece(tuple(value.shape), tuple(value.stride()), value.storage_offset())
                renamed = value.shape == param.shape and value.storage_offset() == 0
                self._add(TensorMeta(piece, tuple(value.shape), dtype, classes if renamed else _CONVERTED_MODULE_CLASSES,
                                     piece_of=name), name)
        ours = {m.name: m.shape for m in self._metas}
        if ours != whole:
            differ = sorted(set(ours.items()) ^ set(whole.items()))
            raise PlanMismatchError(
                "transformers' save conversion of this model needs several parameters at once, which refit "
                f"does not do; names or shapes that differ: {differ[:6]}"
            )

    def _add(self, meta: TensorMeta, source: str) -> None:
        if meta.name in self._sources:
            raise PlanMismatchError(
                f"{meta.name}: made from both {self._sources[meta.name]} and {source} by transformers' save "
                "conversion; refit converts each parameter on its own and cannot send this model"
            )
        self._sources[meta.name] = source
        self._metas.append(meta)


class HeldTensors:
    """The tensors a model holds (`state_tensors`), as taken once: the objects, their dtypes and shapes.

    Why: a reader that keeps a model's tensor objects (to read them at every
    sync) must notice when the model holds others, or it sends old weights
    silently. The one test of that for every reader (`CheckpointView`,
    `refit.sharding.megatron.MegatronLayout`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = model
        self.tensors = state_tensors(model)
        self._described = {name: (t.dtype, tuple(t.shape)) for name, t in self.tensors.items()}

    def outdated(self) -> bool:
        """Whether the model now holds other tensors than these: one replaced (`load_state_dict(..., assign=True)`,
        `model.to(dtype)` under FSDP2), added or removed, or one whose `.data` took another dtype or shape
        (`model.half()` on a plain module keeps each parameter object)."""
        now = state_tensors(self._model)
        return now.keys() != self.tensors.keys() or any(not self._same(name, t) for name, t in now.items())

    def current(self, name: str) -> bool:
        """`outdated` for the one tensor `name`, without walking the whole model."""
        owner, _, attribute = name.rpartition(".")
        module = self._model.get_submodule(owner) if owner else self._model
        return self._same(name, getattr(module, attribute, None))

    def _same(self, name: str, now: torch.Tensor | None) -> bool:
        return now is self.tensors[name] and (now.dtype, tuple(now.shape)) == self._described[name]


def state_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What `save_pretrained` takes from `model.state_dict()`: every parameter (a tied one under each of its names)
    and every persistent buffer, less `_keys_to_ignore_on_save`; the live tensors, not detached copies."""
    tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    modules = dict(model.named_modules(remove_duplicate=False))
    for name, buffer in model.named_buffers(remove_duplicate=False):
        owner, _, attribute = name.rpartition(".")
        if attribute not in modules[owner]._non_persistent_buffers_set:
            tensors[name] = buffer
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    return {name: tensor for name, tensor in tensors.items() if name not in ignored}


def describe_weights(model: torch.nn.Module) -> list[TensorMeta]:
    """Metadata of every tensor of a torch model in its checkpoint format, tied ones as aliases."""
    return CheckpointView(model).metadata()


def checkpoint_tensors(model: torch.nn.Module) -> Callable[[str], torch.Tensor]:
    """The lookup of a model's checkpoint-format tensors by name, for `produce_buckets`."""
    return CheckpointView(model).tensor


def _revert(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' save-time conversion of `state`; the identity for models it has none for."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    if not isinstance(model, PreTrainedModel):
        return state
    return revert_weight_conversion(model, state)
