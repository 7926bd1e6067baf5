"""A replica that drafts with its checkpoint's MTP layers (vLLM's `method="mtp"`): one sync updates target and
drafter in one version.

The fixture is a tiny MiMo (fixtures/mtp_model.py): a Qwen2 target trained on
the counting task and one MTP layer trained to predict the token after next.
The trainer holds the same checkpoint, its MTP layers named as the checkpoint
names them (tests/support/mtp.py). One engine at a time: the reference engine,
loaded from the checkpoint, is gone before the replica starts.
"""

from __future__ import annotations

import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts
from fixtures.mtp_model import mtp_model_dir
from tests.support.actors import run_in
from tests.support.mtp import drafter_state, redraw_mtp_layers, target_state, with_mtp_layers

MIMO = mtp_model_dir()
MTP = {"speculative_method": "mtp", "num_speculative_tokens": 1}
PROMPTS = make_prompts(8, PROMPT_LEN, seed=53)


def test_mtp_layers_sync_with_their_target_and_a_frozen_drafter_keeps_its_bytes(actors_factory):
    fresh = actors_factory.rollout(MIMO, node=2, **MTP)  # loaded from the checkpoint
    reference = run_in(fresh, drafter_state), run_in(fresh, target_state)

    trainer = actors_factory.trainer(MIMO)
    assert run_in(trainer, with_mtp_layers, str(MIMO))
    replica = actors_factory.rollout(MIMO, node=1, load_format="dummy", **MTP)
    report = refit.Syncer(trainer, [replica]).sync()
    synced = report.replicas[0]
    # The probe's prompts are random tokens, not progressions: the MTP layer guesses most, not all (docs/draft.md).
    assert synced.served_version == 1 and synced.draft_acceptance >= 0.6, report.summary()
    assert (run_in(replica, drafter_state), run_in(replica, target_state)) == reference  # exactly the checkpoint's
    assert accuracy(PROMPTS, ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS)).token_ids) == 1.0

    # New MTP layers in the trainer, the replica's drafter frozen: its bytes stay, and it keeps accepting.
    run_in(trainer, redraw_mtp_layers, 7)
    frozen = refit.Syncer(trainer, [replica], refit.SyncConfig(draft="frozen")).sync()
    assert run_in(replica, drafter_state) == reference[0]
    assert frozen.replicas[0].draft_acceptance >= 0.6, frozen.summary()

    # Synced, the random layers reach the drafter in the same version as the target, and its acceptance collapses.
    redrawn = refit.Syncer(trainer, [replica], refit.SyncConfig(on_probe_breach="flag")).sync()
    assert run_in(replica, drafter_state) != reference[0]
    assert run_in(replica, target_state) == reference[1]
    assert redrawn.probe_breached and redrawn.replicas[0].draft_acceptance < 0.2, redrawn.summary()
