"""Attacks on the data plane, on real Ray and vLLM: refused by name, before a byte is loaded, over every transport.

A sync's bytes cross the object store, a collective group's sockets or a
memory file of the trainer's, which others may reach; its key travels inside the plan over
Ray. So: bytes altered in transit (their tag recomputed with the attacker's
own key, as a CRC would be, or dropped) are refused; a bucket a broken
source tagged with the sync's own key is still refused when it breaks the
plan (a scale that is zero, negative or NaN, a wrong dtype, an unplanned
name); a stranger who writes a group's keys in its rendezvous store cannot
break the sync. Every refusal happens at the first bucket, so the replicas
keep serving their version, and the next honest sync heals them. (CUDA IPC
needs a GPU: scripts/gpu_check.sh.)
"""

from __future__ import annotations

import datetime
import threading

import pytest
import torch

import refit
from fixtures import model_dir
from refit import Phase
from refit.transport import collective
from tests.support.actors import run_in
from tests.support.faults import tamper_next_stream
from tests.support.serving import assert_serves, status

# Whole buckets: an altered delta is refused as well, as a base that does not rebuild the sender's bytes, and the
# Syncer then begins again with whole buckets (tests/sync/test_delta.py), which this one-shot tampering would pass.
CONFIGS = {
    "shm": refit.SyncConfig(transport="shm", bucket_bytes=256 << 10, timeout_s=60),
    "ray": refit.SyncConfig(transport="ray", timeout_s=60, delta="off"),
    "collective": refit.SyncConfig(transport="collective", bucket_bytes=256 << 10, timeout_s=60, delta="off"),
}


@pytest.fixture(scope="module")
def trainer(module_actors):
    return module_actors.trainer(model_dir(True, "bf16"), reinitialize=True, seed=11)


@pytest.fixture(scope="module")
def replicas(shared_replicas):
    return shared_replicas


def refused_keeping_the_version(syncer, trainer, replicas, how: str, match: str) -> None:
    """The next sync, whose first bucket `trainer` alters `how`, fails with `match` and leaves every replica serving."""
    before = [status(r).served_version for r in replicas]
    run_in(trainer, tamper_next_stream, how)
    with pytest.raises((refit.VerificationError, refit.InvalidTensorError), match=match):
        syncer.sync()
    after = [status(r) for r in replicas]
    assert [s.phase for s in after] == [Phase.SERVING] * len(replicas), after
    assert [s.served_version for s in after] == before


@pytest.mark.parametrize("transport", ["shm", "ray", "collective"])
def test_bytes_altered_in_transit_are_refused_and_the_next_honest_sync_heals(trainer, replicas, transport):
    syncer = refit.Syncer(trainer, replicas, CONFIGS[transport])
    try:
        served = syncer.sync().version
        for how, match in (("forged", r"arrived altered \(its keyed integrity tag does not match\) in: model\.embed_tokens\.weight"),
                           ("stripped", r"carry no integrity tag: model\.embed_tokens\.weight")):
            refused_keeping_the_version(syncer, trainer, replicas, how, match)
            assert_serves(replicas, trainer, served)
        report = syncer.sync()
        assert report.version > served and all(r.mode == "full" for r in report.replicas)
        assert_serves(replicas, trainer, report.version)
    finally:
        syncer.close()


def test_a_bucket_that_breaks_the_plan_is_refused_naming_the_tensor_even_with_the_syncs_own_tag(trainer, replicas):
    syncer = refit.Syncer(trainer, replicas, CONFIGS["ray"])
    served = syncer.sync().version
    scale = r"model\.layers\.0\.self_attn\.q_proj\.weight_scale"
    for how, match in (
        ("zero_scale", scale + r": FP8 weight scale holds zero, negative or non-finite values \(min 0\)"),
        ("negative_scale", scale + r": FP8 weight scale holds zero, negative or non-finite values \(min -0\.5\)"),
        ("nan_scale", scale + r": FP8 weight scale holds zero, negative or non-finite values"),
        ("wrong_dtype", scale + r": float16 arrived, the plan has bfloat16"),
        ("unplanned", r"model\.layers\.0\.self_attn\.injected\.weight: not in the plan's bucket 0"),
    ):
        refused_keeping_the_version(syncer, trainer, replicas, how, match)
    assert_serves(replicas, trainer, served)
    assert_serves(replicas, trainer, syncer.sync().version)


def test_a_stranger_who_writes_the_groups_keys_in_its_store_cannot_break_a_sync(trainer, replicas, monkeypatch):
    """The stranger knows the store's address and the group's id (`refit inspect` shows it), not its secret."""
    written = threading.Event()

    class WatchedHost(collective.RendezvousHost):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            threading.Thread(target=self.stranger, daemon=True).start()

        def stranger(self) -> None:
            seen = self.rendezvous
            store = torch.distributed.TCPStore(seen.host, seen.port, is_master=False, timeout=datetime.timedelta(seconds=30))
            guesses = [f"refit/{seen.group_id}/", "refit/", ""]  # the prefix of the old code, and none
            for prefix in guesses:
                store.set(prefix + "abandoned", "a stranger says: give up")
                for member in range(seen.world_size):
                    store.set(f"{prefix}joined/{member}", "stranger")
            written.set()

    monkeypatch.setattr("refit.orchestration.collective_group.RendezvousHost", WatchedHost)
    syncer = refit.Syncer(trainer, replicas, CONFIGS["collective"])
    try:
        report = syncer.sync()
        assert written.is_set()
        assert_serves(replicas, trainer, report.version)
    finally:
        syncer.close()
