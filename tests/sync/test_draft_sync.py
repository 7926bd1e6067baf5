"""A replica that decodes speculatively with a draft model: one sync updates target and draft in one version.

The replica starts on placeholders for both (`load_format="dummy"`), its
draft an FP8_BLOCK checkpoint of the same tiny Qwen3 as its target; the
trainer holds the bf16 policy and, beside it, the same weights as its draft.
"""

from __future__ import annotations

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts, model_dir
from tests.support.actors import draft_like_policy, draft_state, engine_state, redraw, run_in

FP8 = model_dir(False, "fp8_block")
PROMPTS = make_prompts(8, PROMPT_LEN, seed=53)


def test_target_and_draft_sync_in_one_version_a_draft_left_behind_is_flagged_and_catches_up(actors_factory):
    trainer = actors_factory.trainer(model_dir(False, "bf16"), draft_dir=str(model_dir(False, "bf16")))
    replica = actors_factory.rollout(FP8, node=1, load_format="dummy", draft_model=str(FP8))
    fresh = actors_factory.rollout(FP8, node=2, draft_model=str(FP8))  # both loaded from their checkpoints

    report = refit.Syncer(trainer, [replica]).sync()
    synced = report.replicas[0]
    assert synced.served_version == 1 and synced.draft_acceptance >= 0.9, report.summary()
    assert run_in(replica, draft_state) == run_in(fresh, draft_state)  # the draft: exactly its checkpoint's
    assert run_in(replica, engine_state) == run_in(fresh, engine_state)
    expected = ray.get(fresh.generate.remote(PROMPTS, NEW_TOKENS)).token_ids
    assert ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS)).token_ids == expected
    records = ray.get(replica.scale_records.remote())
    assert {r.source for r in records if r.module.startswith("draft.") and r.kind == "weight"} == {refit.ScaleSource.REFIT}

    # A new policy, its draft kept frozen at the old one: the draft's bytes stay, its acceptance collapses, and the
    # sync flags it (on_probe_breach="flag"; "fail" would refuse the version).
    run_in(trainer, redraw, 7)
    before = run_in(replica, draft_state)
    # Refused under on_probe_breach="fail", twice: a refused sync's acceptance is no baseline for the next one.
    for _ in range(2):
        with pytest.raises(refit.VerificationError, match="draft model's acceptance fell"):
            refit.Syncer(trainer, [replica], refit.SyncConfig(draft="frozen", on_probe_breach="fail")).sync()
    frozen = refit.Syncer(trainer, [replica], refit.SyncConfig(draft="frozen", on_probe_breach="flag")).sync()
    assert run_in(replica, draft_state) == before
    assert frozen.replicas[0].draft_acceptance < synced.draft_acceptance / 2
    assert frozen.probe_breached and "draft model's acceptance fell" in frozen.replicas[0].verification

    # The trainer's draft catches up with its policy; synced over the collective transport (the workers receive the
    # draft's bytes themselves), the replica's draft accepts again.
    run_in(trainer, draft_like_policy)
    caught_up = refit.Syncer(trainer, [replica], refit.SyncConfig(transport="collective")).sync()
    assert caught_up.replicas[0].draft_acceptance >= 0.9, caught_up.summary()


def test_a_trainer_without_a_draft_leaves_the_replicas_draft_alone(actors_factory):
    trainer = actors_factory.trainer(model_dir(False, "bf16"))
    replica = actors_factory.rollout(FP8, node=1, draft_model=str(FP8))
    # Found by attack: the draft's scales were listed only once a sync had begun an update, so before the first
    # one the provenance table left the draft out.
    records = ray.get(replica.scale_records.remote(), timeout=120)
    assert {r.source for r in records if r.module.startswith("draft.") and r.kind == "weight"} == {
        refit.ScaleSource.CHECKPOINT}
    before = run_in(replica, draft_state)
    report = refit.sync(trainer, [replica])
    assert run_in(replica, draft_state) == before
    assert report.replicas[0].draft_acceptance >= 0.9  # the draft is its checkpoint, the target the same weights


def test_an_async_llm_replica_syncs_its_draft_and_measures_its_acceptance(actors_factory):
    """AsyncLLM runs its engine core in its own process: the collective transport reaches the workers, and the
    acceptance is read from the counters of the actor's process."""
    from actors import AsyncRolloutActor

    trainer = actors_factory.trainer(model_dir(False, "bf16"), draft_dir=str(model_dir(False, "bf16")))
    bf16 = str(model_dir(False, "bf16"))  # FP8 targets and drafts are the test above's; its reference kernel is slow
    config = refit.EngineConfig(model=bf16, load_format="dummy", draft_model=bf16, max_model_len=128,
                                kv_cache_bytes=64 << 20)
    replica = actors_factory.keep(AsyncRolloutActor.options(num_cpus=0, resources={"node1": 0.01}).remote(config))
    report = refit.sync(trainer, [replica], refit.SyncConfig(transport="collective"))
    assert report.replicas[0].draft_acceptance >= 0.9, report.summary()  # a placeholder draft would accept ~none
