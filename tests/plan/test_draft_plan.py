"""The plan of a replica that decodes with a draft model: what is refused names the tensors as the trainer names them.

Pure logic on the tiny Qwen3's files; the engine side is tests/sync/test_draft_sync.py.
"""

from __future__ import annotations

import pytest
from safetensors import safe_open

from fixtures import model_dir
from refit.errors import PlanMismatchError
from refit.plan.config import SyncConfig
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import DRAFT_PREFIX, RolloutModelInfo, make_plan

FP8 = model_dir(False, "fp8_block")


def _policy() -> list[TensorMeta]:
    with safe_open(model_dir(False, "bf16") / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    return [TensorMeta(name, shape, "bfloat16", ("Linear", "Module") if len(shape) == 2 and "embed" not in name
                       else ("Module",)) for name, shape in sorted(shapes.items())]


def test_a_draft_mismatch_names_the_draft_tensors_as_the_trainer_sends_them_not_as_the_targets():
    """Found by attack: a draft tensor the trainer lacked was refused as `model.layers.1.mlp.up_proj.weight: the
    rollout's model has it, the trainer sends nothing`, a tensor the trainer does send (the target's)."""
    info = RolloutModelInfo.from_checkpoint(FP8, from_files=True)
    info = info.with_draft(info)
    down, up = "model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.up_proj.weight"
    drafts = [m.renamed(lambda name: DRAFT_PREFIX + name) for m in _policy() if m.name != up]
    drafts = [TensorMeta(m.name, (m.shape[0], 2 * m.shape[1]), m.dtype, m.module_classes)
              if m.name == DRAFT_PREFIX + down else m for m in drafts]
    with pytest.raises(PlanMismatchError) as refused:
        make_plan(_policy() + drafts, info, SyncConfig())
    message = str(refused.value)
    assert f"\n  draft.{down}: shape (256, 1024) from the trainer, (256, 512) in the draft's model" in message
    assert f"\n  draft.{up}: the draft's model has it, the trainer sends nothing" in message
