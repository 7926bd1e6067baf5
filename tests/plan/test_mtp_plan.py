"""The plan of a replica that drafts with its checkpoint's MTP layers: which tensors go to the drafter, named how.

Pure logic on the MiMo fixture's files (fixtures/mtp_model.py); the engine side is tests/sync/test_mtp_sync.py.
"""

from __future__ import annotations

import json

import pytest

from fixtures.mtp_model import mtp_model_dir
from refit.engine.facts import _info_from_plain, _info_to_plain
from refit.errors import ConfigError, PlanMismatchError
from refit.plan.config import SyncConfig
from refit.plan.tensors import TensorMeta
from refit.plan.transfer_plan import DRAFT_PREFIX, RolloutModelInfo, make_plan

MIMO = mtp_model_dir()


def _checkpoint_sources() -> list[TensorMeta]:
    """The checkpoint's tensors as a trainer holding it reports them: MTP layers under the checkpoint's names."""
    from safetensors import safe_open

    with safe_open(MIMO / "model.safetensors", "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    return [TensorMeta(name, shape, "bfloat16", ("Linear", "Module") if len(shape) == 2 else ("Module",))
            for name, shape in sorted(shapes.items())]


@pytest.mark.parametrize("from_files", [True, False], ids=["headers", "config-only"])
def test_the_mtp_layers_are_the_drafts_expected_weights_not_the_targets(from_files):
    info = RolloutModelInfo.from_checkpoint(MIMO, from_files=from_files, mtp=True)
    assert info.draft.mtp_prefixes == ("model.mtp_layers.0.",)
    assert {w.name for w in info.draft.weights} == {m.name for m in _checkpoint_sources()
                                                    if m.name.startswith("model.mtp_layers.0.")}
    assert not any("mtp_layers" in w.name for w in info.weights)
    assert not info.draft.tie_word_embeddings  # the drafter shares the target's lm_head, it loads none
    # Without method="mtp" the checkpoint's MTP layers stay the target's expected weights, as before.
    assert RolloutModelInfo.from_checkpoint(MIMO, from_files=from_files).weights == tuple(
        sorted(info.weights + info.draft.weights, key=lambda w: w.name))


def test_mtp_layers_are_planned_after_the_target_as_draft_tensors_read_from_their_checkpoint_names():
    info = RolloutModelInfo.from_checkpoint(MIMO, from_files=True, mtp=True)
    plan = make_plan(_checkpoint_sources(), info, SyncConfig())
    targets = [t.target for t in plan.tensors]
    drafts = [t for t in plan.tensors if t.target.startswith(DRAFT_PREFIX)]
    assert len(drafts) == 16 and targets[-16:] == [t.target for t in drafts]  # the target's tensors first
    assert all(t.source == t.target.removeprefix(DRAFT_PREFIX) and t.source.startswith("model.mtp_layers.0.")
               for t in drafts)
    assert not any(t.startswith("model.mtp_layers.") for t in targets)  # none to the target, whose loader skips them

    frozen = make_plan(_checkpoint_sources(), info, SyncConfig(draft="frozen"))
    assert [t.target for t in frozen.tensors] == targets[:-16]


def test_a_trainer_without_an_mtp_tensor_is_refused_naming_it_in_the_draft():
    info = RolloutModelInfo.from_checkpoint(MIMO, from_files=True, mtp=True)
    sources = [m for m in _checkpoint_sources() if m.name != "model.mtp_layers.0.input_proj.weight"]
    with pytest.raises(PlanMismatchError, match=r"draft's model[\s\S]*model.mtp_layers.0.input_proj.weight: the draft's model has it"):
        make_plan(sources, info, SyncConfig())


def test_the_facts_carry_the_mtp_prefixes_and_an_unknown_mtp_architecture_is_refused(tmp_path):
    info = RolloutModelInfo.from_checkpoint(MIMO, from_files=True, mtp=True)
    assert _info_from_plain(json.loads(json.dumps(_info_to_plain(info)))) == info

    config = json.loads((MIMO / "config.json").read_text()) | {"architectures": ["DeepseekV3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="DeepseekV3ForCausalLM checkpoint: refit does not know how it names its MTP layers"):
        RolloutModelInfo.from_checkpoint(tmp_path, from_files=True, mtp=True)
