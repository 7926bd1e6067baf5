"""A Hugging Face checkpoint written into a megatron-core rank's parameters, through the same slots a sync reads.

Why it lives beside the layout: a job that starts its Megatron model from a
Hugging Face checkpoint, and refit's own Megatron ranks, must put every row
where the sync will look for it; one mapping (`mapping.slots_of`) serves both
directions, so a model loaded here and streamed back is the checkpoint again.
Padding rows of the vocabulary are zeroed; a tied output layer on the last
pipeline stage gets the embedding's rows. A checkpoint tensor of the rank's
decoder layers that no parameter takes is refused, not dropped: a model
built without the checkpoint's biases, norms or shared experts would train
without them, and its syncs would fail only later, on the rollout's side.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from contextlib import ExitStack
from pathlib import Path

import torch

from refit.errors import PlanMismatchError
from refit.sharding.megatron.layout import MegatronLayout

__all__ = ["change_checkpoint_tensors", "load_hf_checkpoint", "untaken"]

_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")  # the names `mapping.slots_of` gives decoder layers
_EXPERT_NUMBER = re.compile(r"\.experts\.\d+\.")


@torch.no_grad()
def load_hf_checkpoint(layout: MegatronLayout, model_dir: str | Path) -> None:
    """Fill every parameter of `layout`'s model from the safetensors files in `model_dir`; refuses a missing tensor
    or a shape that differs, naming it, before anything is written.

    Each file is opened once, and each slot reads only its rank's rows or columns (`get_slice`), so a rank of a
    tensor-parallel group reads its share of the checkpoint, not all of it.
    """
    from safetensors import safe_open

    from refit.sharding.megatron.layout import megatron_slots

    with ExitStack() as files:
        opened = [files.enter_context(safe_open(file, "pt")) for file in sorted(Path(model_dir).glob("*.safetensors"))]
        where = {name: f for f in opened for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
        slots = megatron_slots(layout.model, layout.dims, layout.place)
        problems = [f"{slot.target}: not in {model_dir}" for _, _, slot in slots if slot.target not in where]
        problems += [f"{slot.target}: shape {shape} in {model_dir}, {slot.shape} in the megatron model"
                     for _, _, slot in slots if slot.target in where
                     and (shape := tuple(where[slot.target].get_slice(slot.target).get_shape())) != slot.shape]
        problems += [f"{name}: in {model_dir}, but no parameter of the megatron model takes it (was the model built "
                     "without it?)" for name in untaken(where, {slot.target for _, _, slot in slots})]
        if problems:
            raise PlanMismatchError("cannot load the checkpoint into the megatron model:\n  " + "\n  ".join(problems))
        for name, param in layout.model.named_parameters():
            if "word_embeddings" in name or "output_layer" in name:
                param.zero_()  # the padding rows past the checkpoint's vocabulary
        for _, param, slot in slots:
            full = where[slot.target].get_slice(slot.target)
            part = full[slot.start:slot.stop] if slot.dim == 0 else full[:, slot.start:slot.stop]
            slot.write(param, part.to(param.dtype))


@torch.no_grad()
def change_checkpoint_tensors(layout: MegatronLayout, names: Iterable[str], change: Callable[[torch.Tensor], torch.Tensor]) -> int:
    """`change` (elementwise: it sees one part at a time) applied in place to this rank's parts of the checkpoint
    tensors `names`, tied copies included; how many parts changed. How a test or a CPU job without Megatron's
    forward pass updates weights the same way a trainer holding the checkpoint's layout would."""
    from refit.sharding.megatron.layout import megatron_slots

    wanted, changed = set(names), 0
    for _, param, slot in megatron_slots(layout.model, layout.dims, layout.place):
        if slot.target in wanted:
            for view in slot.views(param):
                view.copy_(change(view))
            changed += 1
    return changed


def untaken(checkpoint: Iterable[str], taken: Collection[str]) -> list[str]:
    """The checkpoint tensors of the decoder layers a rank holds that none of its slots (`taken`: their targets) reads.

    Only layers the rank holds are judged (other pipeline stages hold the rest), and an expert another
    expert-parallel rank holds is taken when this rank takes the same tensor of one of its own experts.
    Rotary frequencies, which some checkpoints store, are computed, not trained.
    """
    layers = {m.group(1) for name in taken if (m := _DECODER_LAYER.match(name))}
    expert_tensors = {_EXPERT_NUMBER.sub(".experts.*.", name) for name in taken if _EXPERT_NUMBER.search(name)}
    return sorted(name for name in checkpoint
                  if (m := _DECODER_LAYER.match(name)) and m.group(1) in layers and name not in taken
                  and _EXPERT_NUMBER.sub(".experts.*.", name) not in expert_tensors and not name.endswith(".inv_freq"))
