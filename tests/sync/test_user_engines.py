"""Engines the user constructs: a `vllm.LLM` and an `AsyncLLM`, each in a user-written Ray actor, synced by `refit.Syncer`.

Each is checked against `actors.RolloutActor` synced from the same trainer:
the same tokens and logprobs, the same scale provenance. All three start
the seed bug's way (FP8_BLOCK, `load_format="dummy"`, FP8 KV cache), so
each refuses before its first sync and serves only after refit has reset
its placeholder KV scales. The drifted failure path (a failed completeness
check) runs on every replica kind: the replica closes the update itself,
without waiting for the driver's abort.

All three serve LoRA adapters too (`lora_rank=8`): the trainer trains one
over its frozen base, a no-op until it trains (peft starts lora_B at zero),
so the weight syncs above carry the base, through vLLM's LoRA layers, and
an adapter sync then reaches every kind.

Three engines for the whole module (~15 s each): assertions are
parametrized over the replica kinds, never a new engine per test.
"""

from __future__ import annotations

import threading
import time

import pytest
import ray

import refit
from fixtures import NEW_TOKENS, make_prompts, model_dir
from refit import Phase
from tests.conftest import TEST_KV_CACHE_BYTES
from tests.support.actors import run_in
from tests.support.lora import LORA
from tests.support.user_engines import (
    LORA_RANK,
    UserAsyncLLMRollout,
    UserLLMRollout,
    kill_engine_core,
    replica_of_an_engine_without_refit,
)

KINDS = ["llm", "async_llm"]
PROMPTS = make_prompts(4, 8, seed=5)
COLLECTIVE = refit.SyncConfig(transport="collective")


def _user(actor_class, node: int, model: str, factory):
    return factory.keep(actor_class.options(num_cpus=0, resources={f"node{node}": 0.01}).remote(model, LORA_RANK))


@pytest.fixture(scope="module")
def replicas(module_actors):
    """Trainer, reference and both user-engine replicas, each synced once; the statuses they had before."""
    model = str(model_dir(True, "fp8_block"))
    trainer = module_actors.trainer(model_dir(True, "bf16"), node=0, lora=LORA, lr=1e-2)
    kinds = {
        "reference": module_actors.rollout(model, node=1, load_format="dummy", kv_cache_dtype="fp8_e4m3",
                                           lora_rank=LORA_RANK),
        "llm": _user(UserLLMRollout, 2, model, module_actors),
        "async_llm": _user(UserAsyncLLMRollout, 2, model, module_actors),
    }
    before = {kind: ray.get(replica.status.remote()) for kind, replica in kinds.items()}
    # transport="auto" (the default): every member on one host, so the AsyncLLM's workers, in the process of its core,
    # map the trainer's memory too.
    with refit.Syncer(trainer, list(kinds.values())) as syncer:
        report = syncer.sync()
    assert report.transport == "shm" and report.transport_reason.startswith("every member runs on one host")
    return trainer, kinds, before


def _generate(kind: str, replica, prompts) -> tuple[list[list[int]], list[list[float]]]:
    if kind == "reference":
        out = ray.get(replica.generate.remote(prompts, NEW_TOKENS))
        return out.token_ids, out.logprobs
    return ray.get(replica.generate.remote(prompts, NEW_TOKENS))


@pytest.mark.parametrize("kind", ["reference", *KINDS])
def test_before_the_first_sync_a_dummy_loaded_replica_refuses(replicas, kind):
    _, _, before = replicas
    assert before[kind].phase is Phase.REFUSING and "load_format='dummy'" in before[kind].reason


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_engine_serves_the_tokens_and_logprobs_the_reference_serves(replicas, kind):
    _serves_what_the_reference_serves(replicas[1], kind)


def _serves_what_the_reference_serves(kinds: dict, kind: str) -> None:
    # AsyncLLM requests run one at a time, so compare prompt by prompt (bf16 sums depend on the batch).
    batches = [PROMPTS] if kind == "llm" else [[p] for p in PROMPTS]
    for batch in batches:
        tokens, logprobs = _generate(kind, kinds[kind], batch)
        ref_tokens, ref_logprobs = _generate("reference", kinds["reference"], batch)
        assert tokens == ref_tokens
        assert max(abs(a - b) for row, ref in zip(logprobs, ref_logprobs) for a, b in zip(row, ref)) < 1e-5


@pytest.mark.parametrize("kind", KINDS)
def test_a_user_engine_records_the_provenance_the_reference_records(replicas, kind):
    _, kinds, _ = replicas
    records = ray.get(kinds[kind].scale_records.remote())
    reference = ray.get(kinds["reference"].scale_records.remote())
    assert records == reference
    kv = [r for r in records if r.kind == "attention" and r.scale in ("k_scale", "v_scale")]
    assert kv and all((r.source, r.version, r.value) == (refit.ScaleSource.DEFAULT, 1, 1.0) for r in kv)  # dummy scales, reset
    assert any(r.kind == "weight" and r.source is refit.ScaleSource.REFIT and r.version == 1 for r in records)


@pytest.mark.parametrize("kind", ["reference", *KINDS])
def test_a_failed_completeness_check_closes_the_update_on_the_replica_itself(replicas, kind):
    """Regression: `RolloutActor` left this update open for the driver to abort; the async actor closed it itself."""
    trainer, kinds, _ = replicas
    replica = kinds[kind]
    config = COLLECTIVE if kind == "async_llm" else refit.SyncConfig(transport="ray")
    served, tokens_before = ray.get(replica.status.remote()).served_version, _generate(kind, replica, PROMPTS[:1])[0]
    plan = refit.Syncer(trainer, replica, config).plan()
    version = ray.get(replica.begin_update.remote(plan, "incomplete", config))
    with pytest.raises(refit.VerificationError, match="did not deliver"):
        ray.get(replica.finish_update.remote("incomplete", version))  # no bucket was sent
    status = ray.get(replica.status.remote())  # no abort_update yet: the replica closed the update itself
    assert (status.phase, status.served_version) == (Phase.SERVING, served)  # nothing was loaded: the old version serves on
    assert ray.get(replica.last_update.remote())["outcome"].startswith("failed: finishing the reload failed")
    assert ray.get(replica.abort_update.remote("incomplete", "the driver's abort, after the fact")) == status
    assert _generate(kind, replica, PROMPTS[:1])[0] == tokens_before


def test_requests_arriving_during_syncs_neither_stall_them_nor_fail(replicas):
    """Found following docs/own-engine.md literally: its actor ran every call in Ray's one default thread, so a request
    that arrived during a sync waited for the update on the thread the update's next step needed, and every sync under
    load missed its deadline. The documented actor now serves in a concurrency group of its own."""
    trainer, kinds, _ = replicas
    replica = kinds["llm"]
    stop, answered, failed = threading.Event(), [], []

    def requests() -> None:
        while not stop.is_set():
            try:
                answered.append(ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS), timeout=120))
            except Exception as error:  # noqa: BLE001 - asserted below
                failed.append(error)

    callers = [threading.Thread(target=requests, daemon=True) for _ in range(2)]
    for caller in callers:
        caller.start()
    try:
        with refit.Syncer(trainer, replica, refit.SyncConfig(timeout_s=60)) as syncer:
            for _ in range(3):
                before = len(answered)
                syncer.sync()
                assert not failed, failed
            assert len(answered) > before  # requests kept coming
    finally:
        stop.set()
        for caller in callers:
            caller.join(timeout=120)
    assert failed == []


def test_an_adapter_sync_reaches_every_replica_kind_and_each_serves_what_the_reference_serves(replicas):
    """One `sync_adapter` for all three: staged on each, then served by each, over vLLM's worker RPC whatever the
    engine (an AsyncLLM's core in its own process too); the base the weight syncs put under the LoRA layers stays."""
    trainer, kinds, _ = replicas
    before = _generate("reference", kinds["reference"], PROMPTS)
    ray.get(trainer.train_step.remote([list(p) + [(p[-1] - i) % 512 for i in range(1, 9)] for p in PROMPTS]), timeout=120)
    report = refit.Syncer(trainer, list(kinds.values())).sync_adapter()
    assert sorted(swap["serving"] for swap in report.replicas.values()) == [f"policy v{report.version}"] * 3
    assert _generate("reference", kinds["reference"], PROMPTS)[1] != before[1]  # the adapter is served
    for kind in KINDS:
        _serves_what_the_reference_serves(kinds, kind)


def test_an_engine_started_without_refits_arguments_is_refused_naming_them(ray_cluster):
    """Forgetting `refit.engine_kwargs()` is refused where the replica is made, naming what is missing, rather than
    at the first sync by a worker without refit's methods."""
    task = replica_of_an_engine_without_refit.options(num_cpus=0, resources={"node1": 0.01})
    message = ray.get(task.remote(str(model_dir(True, "bf16")), TEST_KV_CACHE_BYTES), timeout=600)  # mostly vLLM's start
    assert message.startswith("this engine was not started with refit.engine_kwargs() merged into its arguments: "
                              "worker_extension_cls is ''"), message
    assert "weight_transfer_config's backend is " in message and "not 'refit'" in message


def test_a_user_engine_whose_engine_core_died_refuses_naming_it_and_a_sync_drops_it(replicas):
    """Regression: with its engine core's own process dead (an AsyncLLM's, or a vllm.LLM's with
    VLLM_ENABLE_V1_MULTIPROCESSING=1) the replica said it served its version, and a sync failed whole on vLLM's bare
    EngineDeadError, naming no replica, instead of dropping it and syncing the others."""
    trainer, kinds, _ = replicas
    # The module's AsyncLLM replica, as the module's last test: an AsyncLLM's core alone (a vllm.LLM with
    # VLLM_ENABLE_V1_MULTIPROCESSING=1 takes the same path, `core_died`), and no new engine's three processes.
    doomed = [kinds["async_llm"]]
    with refit.Syncer(trainer, [kinds["llm"], *doomed]) as syncer:
        syncer.sync()
        for replica in doomed:
            assert run_in(replica, kill_engine_core) > 0
        deadline = time.monotonic() + 60  # vLLM's monitor thread notices a death
        while (statuses := [ray.get(r.status.remote(), timeout=60) for r in doomed]) and time.monotonic() < deadline:
            if all(s.phase is Phase.REFUSING for s in statuses):
                break
            time.sleep(0.2)
        for status in statuses:
            assert status.phase is Phase.REFUSING and "engine core process died" in status.reason, status
        with pytest.raises(refit.ReplicaRefusingError, match="engine core process died"):
            ray.get(doomed[0].generate.remote(PROMPTS[:1], NEW_TOKENS), timeout=60)
        report = syncer.sync()
    assert [(d.replica, d.stage, d.cause) for d in report.dropped] == [(1, "begin", "died")], report.summary()
    assert all("engine core process died" in d.error for d in report.dropped)
    assert ray.get(kinds["llm"].status.remote(), timeout=60).served_version == report.version
