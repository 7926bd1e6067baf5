"""A sharded trainer: a 2-rank FSDP2 group (gloo, ranks on two nodes) synced into FP8_BLOCK rollouts,
through the object store and over the collective transport.

The reference for every sync is a sync of the same weights from a
single-process trainer (the group's weights saved and loaded into a
`TrainerActor`): the rollouts must serve identical tokens and logprobs.
"""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

import refit
from actors import TrainerGroup, TrainerRank
from fixtures import NEW_TOKENS, PROMPT_LEN, accuracy, make_prompts, make_sequences, model_dir
from refit.engine import Phase
from tests.support.actors import engine_state, rank_stream, run_in, streamed_together
from tests.support.faults import die_at, fail_loading_from, quantizing_fault

PROMPTS = make_prompts(24, PROMPT_LEN, seed=41)
FP8_DUMMY = {"load_format": "dummy", "kv_cache_dtype": "fp8_e4m3"}
TWO_NODES = [{"node0": 0.01}, {"node1": 0.01}]


def max_abs_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b))


def serve(replica):
    return ray.get(replica.generate.remote(PROMPTS, NEW_TOKENS, prompt_logprobs=True))


@pytest.fixture(scope="module")
def replicas(shared_replicas):
    """The session's two dummy-loaded FP8 replicas: every test's first sync makes them whole again."""
    return shared_replicas


def test_fsdp2_group_sync_equals_a_single_process_sync_and_tracks_training(replicas, actors_factory, ray_cluster, tmp_path):
    group = actors_factory.trainer_group(model_dir(True, "bf16"), reinitialize=True, seed=5, lr=3e-3)
    reference = actors_factory.rollout(model_dir(True, "fp8_block"), node=2, **FP8_DUMMY)
    syncer = refit.Syncer(group, replicas, refit.SyncConfig(bucket_bytes=256 << 10))
    accuracies, versions = [], []
    for round_ in range(2):
        for step in range(25):  # from a random init: ~0.3 counting accuracy after one round, ~0.95 after two
            group.train_step(make_sequences(32, 32, seed=100 * round_ + step).tolist())
        report = syncer.sync()
        assert all(r.served_version == report.version for r in report.replicas)
        held, sent = run_in(group.ranks[0], lambda rank: ({str(p.dtype) for p in rank.model.parameters()},
                                                         {m.dtype for m in rank.weight_metadata()}))
        assert (held, sent) == ({"torch.float32"}, {"bfloat16"})  # fp32 masters, bf16 on the wire
        versions.append(report.version)  # consecutive; the module's replicas may have served earlier syncs

        single = actors_factory.trainer(group.save(tmp_path / f"round{round_}"), node=0)
        refit.sync(single, reference)
        expected = serve(reference)
        for replica in replicas:
            got = serve(replica)
            assert got.token_ids == expected.token_ids
            assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5
            assert max_abs_diff([r[1:] for r in got.prompt_logprobs], [r[1:] for r in expected.prompt_logprobs]) < 1e-5
        rollout_accuracy = accuracy(PROMPTS, expected.token_ids)
        trainer_accuracy = accuracy(PROMPTS, group.generate(PROMPTS, NEW_TOKENS))
        accuracies.append((trainer_accuracy, rollout_accuracy))

    # Over the collective transport each rank broadcasts its parts on a channel of its own: the same model.
    report = refit.sync(group, replicas, refit.SyncConfig(transport="collective", bucket_bytes=256 << 10))
    assert versions[1] == versions[0] + 1 and report.version == versions[1] + 1 and report.buckets > 2
    for replica in replicas:
        got = serve(replica)
        assert got.token_ids == expected.token_ids
        assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5

    # Training moves the policy, and the FP8 rollouts follow it (FP8 rounding flips a few greedy tokens).
    assert accuracies[-1][0] > accuracies[0][0] + 0.3, accuracies
    assert all(abs(trainer - rollout) <= 0.15 for trainer, rollout in accuracies), accuracies

    # Both paths ran: block-aligned shards quantized where they lie (q, o, gate, up, down), k and v
    # (64 rows per rank, half an FP8 block) gathered, each rank owning half of them.
    stats = group.stream_stats()
    assert [s["quantized_rows"] for s in stats] == [10, 10]
    assert [s["gather"] for s in stats] == [2, 2]
    assert all(s["gathered_bytes"] == 4 * 128 * 256 * 2 for s in stats)  # every rank joins each all-gather


@pytest.mark.parametrize(("transport", "method", "call", "where"), [
    ("ray", "gathered", 2, "rank 0 is gathering k/v from it"),
    ("ray", "rows", 3, "the driver awaits its part; rank 0's part still arrives"),
    ("collective", "rows", 3, "every replica's workers are receiving its broadcast"),
])
def test_a_rank_that_dies_mid_sync_is_named_whichever_symptom_arrives_first(replicas, actors_factory, transport, method, call,
                                                                          where):
    """Rank 1 dies at a chosen point; its echoes (a broken gloo pair, a lost stream, a failed receive) are only notes."""
    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=20)
    run_in(group.ranks[1], die_at, method, call)
    config = refit.SyncConfig(bucket_bytes=32 << 10, max_buckets_in_flight=1, timeout_s=20, transport=transport)
    start = time.monotonic()
    with pytest.raises(refit.ActorDiedError, match=r"^trainer rank 1 died or is unreachable") as error:
        refit.sync(group, replicas, config)
    assert time.monotonic() - start < 60, where
    assert error.value.who == "trainer rank 1"
    notes = "\n".join(error.value.__notes__)
    for i, replica in enumerate(replicas):
        status = ray.get(replica.status.remote(), timeout=30)
        assert status.phase in (Phase.SERVING, Phase.REFUSING), status  # whole, or refusing: never half-served
        assert f"rollout {i}:" in notes


def test_two_syncers_on_one_group_syncing_at_once_both_complete(replicas, actors_factory):
    """Two Syncers of one driver on one FSDP2 group, each with its own replica, in two threads (regression: the ranks
    could start the two syncs' streams in different orders, each then waiting for the other in a gather, until the
    deadline broke the group's process group for good). Each set of rank calls is submitted whole: both complete."""
    import threading

    group = actors_factory.trainer_group(model_dir(True, "bf16"))
    config = refit.SyncConfig(bucket_bytes=64 << 10, timeout_s=60)  # many buckets, each of them gathering k and v
    syncers = [refit.Syncer(group, [replica], config) for replica in replicas]

    def run(index: int, results: dict[int, object]) -> None:
        try:
            results[index] = syncers[index].sync()
        except Exception as error:  # noqa: BLE001 (reported below)
            results[index] = error

    for _ in range(3):
        results: dict[int, object] = {}
        threads = [threading.Thread(target=run, args=(i, results)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(180)
        assert all(isinstance(results.get(i), refit.SyncReport) for i in range(2)), results
    states = [run_in(replica, engine_state) for replica in replicas]
    assert states[0] == states[1]


def one_ran_and_the_other_was_refused(outcomes: dict[str, list[str]]) -> bool:
    """Of two syncs' streams (by sync id, each rank's outcome), one completed on every rank and the other was
    refused on every rank, naming the one that ran."""
    first, second = outcomes
    for ran, refused in ((first, second), (second, first)):
        if outcomes[ran] == ["complete", "complete"] and all(
                f"sync {refused} was refused: this trainer's ranks are streaming sync {ran}" in o for o in outcomes[refused]):
            return True
    return False


def test_two_syncs_whose_streams_reach_the_ranks_in_crossed_orders_run_one_and_refuse_the_other(replicas, actors_factory):
    """Regression: two callers (two drivers) can reach the ranks in different orders, as this one caller does on
    purpose: rank 0 got A then B, rank 1 B then A. Each rank ran the first it got, each waiting for the other in a
    gather until the group's timeout broke its process group for good. Now whichever took the group first runs on
    every rank, the other is refused on every rank at once, and the group syncs on."""
    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=30)
    rank0, rank1 = group.ranks
    plan = refit.Syncer(group, replicas[0], refit.SyncConfig(bucket_bytes=64 << 10)).plan()
    a, b = plan.for_sync(None, "A", 30), plan.for_sync(None, "B", 30)
    streams = [rank_stream(rank0, a), rank_stream(rank1, b), rank_stream(rank0, b), rank_stream(rank1, a)]
    a_on_0, b_on_1, b_on_0, a_on_1 = streamed_together(streams)
    assert one_ran_and_the_other_was_refused({"A": [a_on_0, a_on_1], "B": [b_on_0, b_on_1]}), (a_on_0, a_on_1, b_on_0, b_on_1)
    report = refit.sync(group, replicas, refit.SyncConfig(bucket_bytes=64 << 10, timeout_s=60))
    assert len(report.replicas) == 2


def test_the_next_sync_waits_for_a_rank_still_ending_the_last_one_instead_of_being_refused(replicas, actors_factory):
    """One caller's syncs reach every rank in one order, but a rank may still be ending sync A (an interrupted one's
    stream, cancelled) when another rank, done with A, starts B: B waits for A's end there (it was refused at once)."""
    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=30)
    rank0, rank1 = group.ranks
    plan = refit.Syncer(group, replicas[0], refit.SyncConfig(bucket_bytes=256 << 10)).plan()
    a, b = plan.for_sync(None, "A", 30), plan.for_sync(None, "B", 30)
    a_on_0, a_on_1 = rank_stream(rank0, a), rank_stream(rank1, a)
    for index in range(len(plan.buckets)):
        ray.get(next(a_on_0), timeout=60)
        if index < len(plan.buckets) - 1:  # rank 1 stays in A, its last part not taken
            ray.get(next(a_on_1), timeout=60)
    with pytest.raises(StopIteration):
        next(a_on_0)  # rank 0 has ended A
    b_on_0, b_on_1 = rank_stream(rank0, b), rank_stream(rank1, b)
    assert not ray.wait([b_on_0], timeout=1)[0]  # B waits on rank 0...
    assert streamed_together([a_on_1]) == ["complete"]  # ...until rank 1 ends A
    assert streamed_together([b_on_0, b_on_1]) == ["complete", "complete"]


def test_a_syncer_whose_streams_cross_another_callers_loses_nothing_served_and_syncs_on(replicas, actors_factory, monkeypatch):
    """The same race through a Syncer: stream X reaches rank 0 before the sync's streams and rank 1 after them. One
    of the two runs, the other is refused at once; a refused sync leaves its replicas serving what they served."""
    import threading

    from refit.orchestration.streaming import BucketRelay

    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=30)
    syncer = refit.Syncer(group, replicas, refit.SyncConfig(bucket_bytes=64 << 10, timeout_s=30))
    version = syncer.sync().version
    rank0, rank1 = group.ranks
    opened = threading.Event()
    open_streams = BucketRelay.open
    monkeypatch.setattr(BucketRelay, "open", lambda relay, *args: (open_streams(relay, *args), opened.set())[0])
    other = syncer.plan().for_sync(None, "X", 30)
    x_on_0 = rank_stream(rank0, other)
    outcome: list[object] = []
    sync = threading.Thread(target=lambda: outcome.extend(_outcome(syncer.sync)))
    sync.start()
    assert opened.wait(60)
    x_on_1 = rank_stream(rank1, other)
    x_outcomes = streamed_together([x_on_0, x_on_1])
    sync.join(120)
    served = [ray.get(r.status.remote(), timeout=30).served_version for r in replicas]
    if isinstance(outcome[0], refit.SyncReport):  # the sync took the group first
        assert all("sync X was refused: this trainer's ranks are streaming sync " in o for o in x_outcomes), x_outcomes
        assert served == [outcome[0].version] * 2
    else:
        assert isinstance(outcome[0], refit.LifecycleError) and "this trainer's ranks are streaming sync X" in str(outcome[0])
        assert x_outcomes == ["complete", "complete"] and served == [version] * 2
    assert syncer.sync().version > version  # a failed sync spends its version number


def _outcome(call) -> list[object]:
    try:
        return [call()]
    except Exception as error:  # noqa: BLE001 (the test asserts what it was)
        return [error]


def test_a_nan_in_one_ranks_shard_is_refused_on_every_rank_and_the_group_syncs_on(replicas, actors_factory):
    """Regression: each rank checks only the rows it holds, so a NaN in rank 1's shard made rank 1 alone refuse
    while rank 0 went on into a gather of k and v that rank 1 never entered, and waited there until the group's
    timeout broke its process group for good. Now every rank refuses, naming the tensor, and the next sync runs."""
    import re

    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=30)
    name = "model.layers.1.mlp.down_proj.weight"

    def poison(rank, value: float) -> float:  # its last row lies in rank 1's shard (FSDP2 shards rows)
        with torch.no_grad():
            local = rank.model.get_parameter(name).to_local()
            old, local[-1, 0] = local[-1, 0].item(), value
        return old

    config = refit.SyncConfig(bucket_bytes=64 << 10, timeout_s=30)  # many buckets, each of them gathering k and v
    served = [ray.get(replica.status.remote(), timeout=60).served_version for replica in replicas]
    old = run_in(group.ranks[1], poison, float("nan"))
    with pytest.raises(refit.InvalidTensorError, match=re.escape(name) + " holds NaN or Inf on rank 1"):
        refit.sync(group, replicas, config)
    assert [ray.get(replica.status.remote(), timeout=60).served_version for replica in replicas] == served
    run_in(group.ranks[1], poison, old)
    report = refit.sync(group, replicas, config)
    assert [r.served_version for r in report.replicas] == [report.version] * 2


@pytest.mark.parametrize("transport", ["ray", "shm"])
def test_a_rank_failing_mid_stream_fails_the_sync_with_its_error_and_the_group_syncs_on(replicas, actors_factory,
                                                                                          transport):
    """Regression: a rank that raised after the preflight (out of memory while quantizing, say) left the other rank
    in a gather of k and v it never entered, until the group's timeout broke the process group for good. Now it
    reports its error first, then joins the gathers its peer waits in; the sync fails with that error, not a
    timeout, nothing served changes, and the next sync runs on the same group."""
    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=60)
    config = refit.SyncConfig(bucket_bytes=64 << 10, timeout_s=60, transport=transport)  # every bucket gathers k, v
    served = [ray.get(replica.status.remote(), timeout=60).served_version for replica in replicas]
    run_in(group.ranks[1], quantizing_fault, 2, 1.0)  # after 1 s in layer 0's q_proj: rank 0 waits to gather its k
    try:
        with pytest.raises(Exception, match="out of memory quantizing") as raised:  # over ray: from a replica's fetch
            refit.sync(group, replicas, config)
        assert not isinstance(raised.value, refit.SyncTimeoutError)
        assert transport == "ray" or isinstance(raised.value, MemoryError)  # read by the driver itself: the rank's error
    finally:
        run_in(group.ranks[1], quantizing_fault)
    assert [ray.get(replica.status.remote(), timeout=60).served_version for replica in replicas] == served
    report = refit.sync(group, replicas, config)
    assert [r.served_version for r in report.replicas] == [report.version] * 2


def test_a_sync_failed_by_a_replica_while_a_rank_waits_in_a_gather_leaves_the_group_whole(replicas, actors_factory):
    """Regression: a failed sync cancels the ranks' streams, and each stopped at its next yield. Rank 0, slower here,
    stopped short of the gather of k or v that rank 1 already waited in, which then waited until the group's timeout
    broke the process group for good. Now a stopped stream joins the gathers left to it, and the group syncs on."""
    group = actors_factory.trainer_group(model_dir(True, "bf16"), timeout_s=60)
    config = refit.SyncConfig(bucket_bytes=192 << 10, timeout_s=60, transport="ray")  # k and v gathered in most buckets
    refit.sync(group, replicas, config)
    expected = serve(replicas[1])
    run_in(group.ranks[0], quantizing_fault, None, 0.2)  # rank 1 waits for rank 0 in each gather
    run_in(replicas[0], fail_loading_from, 4)
    try:
        with pytest.raises(Exception, match="this replica failed to load a bucket"):
            refit.sync(group, replicas, config)
    finally:
        run_in(group.ranks[0], quantizing_fault)
        run_in(replicas[0], fail_loading_from, None)
    report = refit.sync(group, replicas, config)
    assert [r.served_version for r in report.replicas] == [report.version] * 2
    assert [serve(replica).token_ids for replica in replicas] == [expected.token_ids] * 2  # the same weights


def test_per_rank_memory_during_a_sync_stays_within_the_stated_bound(ray_cluster, tmp_path):
    """Each rank holds its shards plus what one bucket needs; a full BF16 copy (108 MiB per rank here) would not fit.

    The one group here that starts its own ranks (`resources=`); the others' come from the pool (`ranks=`).
    """
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir(False, "bf16"))
    config.update({"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 8,
                   "num_key_value_heads": 1, "head_dim": 128, "layer_types": ["full_attention"] * 8})
    config.save_pretrained(tmp_path / "bf16")
    quantized = json.loads((model_dir(False, "fp8_block") / "config.json").read_text())
    (tmp_path / "fp8").mkdir()
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config.to_dict() | {"quantization_config": quantized["quantization_config"]}))

    group = TrainerGroup(tmp_path / "bf16", 2, reinitialize=True, resources=TWO_NODES)
    try:
        metas = ray.get(group.ranks[0].weight_metadata.remote())
        rollout = refit.RolloutModelInfo.from_checkpoint(tmp_path / "fp8", from_files=False)
        sync_config = refit.SyncConfig(bucket_bytes=8 << 20, max_buckets_in_flight=2)
        plan = refit.plan.make_plan(metas, rollout, sync_config)
        streams = [rank.stream_buckets.options(num_returns="streaming", _generator_backpressure_num_objects=2).remote(plan)
                   for rank in group.ranks]
        for _ in plan.buckets:
            for stream in streams:
                ray.get(next(stream), timeout=60)  # what a replica does; the parts are then dropped
        stats = group.stream_stats()
        largest_gathered = max(t.source_bytes for t in plan.tensors if t.is_quantized and t.shape[0] % 256)  # k, v: 128 rows
        # The bound: the bucket being built (its BF16 inputs, FP8 output and packed buffer: 3 bucket sizes),
        # one gathered tensor, and 16 MiB of allocator slack. The rank's shards are already resident.
        bound = 3 * sync_config.bucket_bytes + largest_gathered + (16 << 20)
        full_copy = sum(t.source_bytes for t in plan.tensors) // 2
        assert full_copy > bound
        for s in stats:
            assert s["peak_bytes"] < bound, (s, bound)
            assert s["gather"] == 8 and s["gathered_bytes"] == 16 * largest_gathered  # k and v of 8 layers, owners alternate
        print(f"per-rank peak above the shards: {[s['peak_bytes'] >> 20 for s in stats]} MiB; bound {bound >> 20} MiB; "
              f"a full BF16 copy {full_copy >> 20} MiB")
    finally:
        group.kill()


def test_ranks_passed_in_are_refused_unless_they_are_free_handles_constructed_for_their_place(actors_factory):
    model = model_dir(True, "bf16")
    group = actors_factory.trainer_group(model)
    with pytest.raises(refit.ConfigError, match=r"ranks\[0\] was constructed as rank 1 of 2: this group needs rank 0 of 2"):
        TrainerGroup(model, 2, ranks=group.ranks[::-1])
    with pytest.raises(refit.ConfigError, match=r"^ranks: 1 actors for world_size=2$"):
        TrainerGroup(model, 2, ranks=group.ranks[:1])
    with pytest.raises(refit.ConfigError, match=r"ranks\[1\] is .*TrainerRank.*, not an actor handle"):
        TrainerGroup(model, 2, ranks=[group.ranks[0], TrainerRank])
    with pytest.raises(refit.ConfigError, match="give one of them"):
        TrainerGroup(model, 2, ranks=group.ranks, resources=TWO_NODES)
    with pytest.raises(refit.ConfigError, match=r"trainer rank \d is in a group already: its leave_group\(\) comes before"):
        TrainerGroup(model, 2, ranks=group.ranks)
    assert group.generate(PROMPTS[:2], 2)  # refused before any call reached them: the group still runs


def test_a_rank_that_leaves_its_group_is_in_no_group_and_sets_up_in_a_new_one(replicas, actors_factory):
    """`leave_group()` leaves the torch.distributed group and the open Syncer's collective group, and drops the
    delta base (its rows were the old model's): the same processes set up again, and the next sync is full."""
    model = model_dir(True, "bf16")
    group = actors_factory.trainer_group(model)
    config = refit.SyncConfig(transport="collective", bucket_bytes=256 << 10, verify="probe")
    with refit.Syncer(group, replicas, config) as syncer:
        syncer.sync()
        assert all(ray.get([rank.transport_group.remote() for rank in group.ranks], timeout=30))
        ray.get([rank.leave_group.remote() for rank in group.ranks], timeout=60)
        assert ray.get([rank.transport_group.remote() for rank in group.ranks], timeout=30) == [None, None]
        assert ray.get([rank.base_entries.remote() for rank in group.ranks], timeout=30) == [[], []]

        TrainerGroup(model, 2, ranks=group.ranks, seed=7, reinitialize=True)  # another model: the old one's rows are no base
        report = syncer.sync()  # the Syncer sees its ranks left the group and makes a new one; the probe checks what is served
    assert [(r.mode, r.served_version) for r in report.replicas] == [("full", report.version)] * 2


def test_ranks_that_disagree_on_a_tensor_are_refused_before_anything_starts():
    from refit.orchestration.syncer import _merge_metadata
    from refit.plan.tensors import TensorMeta

    a = TensorMeta("w", (4, 4), "bfloat16", ("Linear",))
    b = TensorMeta("w", (4, 8), "bfloat16", ("Linear",))
    with pytest.raises(refit.PlanMismatchError, match=r"w: \(4, 4\) bfloat16 on trainer rank 0, \(4, 8\) bfloat16 on trainer rank 1"):
        _merge_metadata([("trainer rank 0", None), ("trainer rank 1", None)], [[a], [b]])
    assert _merge_metadata([("r0", None), ("r1", None)], [[a], [TensorMeta("v", (2,), "bfloat16", ("Norm",))]])[1].name == "v"


def test_moe_group_sends_each_expert_from_the_rank_that_holds_it(actors_factory, ray_cluster):
    """FSDP2 shards the fused experts by expert: each rank sends its experts whole, per expert, in FP8_BLOCK;
    after a step, only what changed, and the replica then serves what a full sync gives it."""
    moe = dict(tied=False, arch="qwen3_moe")
    group = actors_factory.trainer_group(model_dir(variant="bf16", **moe), lr=1e-5)
    fresh = actors_factory.rollout(model_dir(variant="fp8_block", **moe), node=1, kv_cache_dtype="fp8_e4m3")
    expected = serve(fresh)
    replica = actors_factory.rollout(model_dir(variant="fp8_block", **moe), node=2, **FP8_DUMMY)
    ray_config = refit.SyncConfig(transport="ray")  # deltas, as between hosts (on one host auto maps memory, whole)
    full = refit.sync(group, replica, ray_config)
    got = serve(replica)
    assert got.token_ids == expected.token_ids
    assert max_abs_diff(got.logprobs, expected.logprobs) < 1e-5
    stats = group.stream_stats()
    # 4 experts x 3 projections x 2 layers, 2 experts on each rank; the k/v projections (128 rows) gathered.
    assert [s["whole"] for s in stats] == [12, 12] and [s["gather"] for s in stats] == [2, 2]

    # A step at an RL learning rate, then a delta: each rank diffs the rows it sent last (its own experts).
    group.train_step(make_sequences(8, 16, seed=1).tolist())
    report = refit.sync(group, replica, ray_config)
    (delta,) = report.replicas
    assert delta.mode == "delta" and delta.digest == report.digest
    assert delta.bytes_received < 0.3 * full.replicas[0].bytes_received, (delta.bytes_received, full.replicas[0].bytes_received)
    by_delta = serve(replica)
    assert refit.sync(group, replica, refit.SyncConfig(transport="ray", delta="off")).replicas[0].mode == "full"
    by_full = serve(replica)
    assert (by_delta.token_ids, by_delta.logprobs) == (by_full.token_ids, by_full.logprobs)


def test_a_family_whose_layers_lie_elsewhere_is_sharded_by_its_blocks_and_syncs_like_one_process(actors_factory, tmp_path):
    """GPT-NeoX keeps its layers at `gpt_neox.layers`, not `model.layers` (regression: the group could not start); its
    head is `embed_out` and its attention one fused `query_key_value`. The group's sync leaves the replica exactly as a
    single-process trainer's sync of the same checkpoint does."""
    from transformers import GPTNeoXConfig

    from tests.support.checkpoints import write_random, write_variant

    config = GPTNeoXConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=256, architectures=["GPTNeoXForCausalLM"])
    bf16, fp8 = write_random(config, tmp_path / "neox", seed=13, like=model_dir(False, "fp8_block"), ignore=["re:.*embed_out$"])
    other, _ = write_variant(bf16, tmp_path / "other", seed=14)
    replica = actors_factory.rollout(fp8, node=2, **FP8_DUMMY)
    refit.sync(actors_factory.trainer(bf16), replica)
    expected = run_in(replica, engine_state)
    refit.sync(actors_factory.trainer(other), replica)  # every weight away from the checkpoint's
    assert run_in(replica, engine_state) != expected
    report = refit.sync(actors_factory.trainer_group(bf16), replica)
    assert report.replicas[0].mode == "full" and run_in(replica, engine_state) == expected
