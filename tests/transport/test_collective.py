"""The collective transport on its own: a real gloo group, members as threads of this process.

Pins: bytes arrive intact with the next bucket posted early (double
buffering), from one sender or from several (a sharded trainer, a channel
each, parts of some buckets empty); a member that never joins or a
rendezvous nobody hosts fails within the deadline naming it; a member
leaving fails the others' waits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from refit.errors import SyncTimeoutError, TransportError
from refit.transport.buckets import pack_bucket
from refit.transport.collective import BucketReceiver, BucketSender, CollectiveGroup, Rendezvous, RendezvousHost, receive_parts


def _buckets(seed: int, count: int, *, empty: set[int] = frozenset()):
    generator = torch.Generator().manual_seed(seed)
    return [
        pack_bucket(i, [] if i in empty else [
            (f"model.layers.{i}.w", torch.randn(17 + i, 33, generator=generator).to(torch.bfloat16)),
            (f"model.layers.{i}.b", torch.randn(5 + 3 * i, generator=generator)),
        ])
        for i in range(count)
    ]


def _join_all(host: RendezvousHost, members):
    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(lambda member: CollectiveGroup.join(host.rendezvous, member), members))


@pytest.mark.parametrize("senders", [1, 2])
def test_parts_arrive_intact_with_the_next_one_posted_early(senders):
    names = [f"trainer rank {r}" for r in range(senders)] + ["rollout 0 worker 0", "rollout 1 worker 0"]
    host = RendezvousHost(names, timeout_s=20, senders=senders)
    joined = _join_all(host, range(len(names)))
    assert [len(groups) for groups in joined] == [1] * senders + [senders, senders]
    streams = [_buckets(rank, 5, empty={rank + 1}) for rank in range(senders)]  # each rank holds nothing of one bucket
    received: dict[int, list] = {}

    def worker(groups: list[CollectiveGroup]) -> None:
        receivers = [BucketReceiver(group) for group in groups]
        received[groups[0].member] = []
        for i in range(5):
            nxt = [stream[i + 1].nbytes if i + 1 < 5 else None for stream in streams]
            parts = receive_parts(receivers, [stream[i].contents() for stream in streams], nxt)
            received[groups[0].member].append([[(n, t.clone()) for n, t in part.unpack()] for part in parts])

    def sender(group: CollectiveGroup, buckets) -> None:
        assert [c.nbytes for c in BucketSender(group).send(buckets)] == [b.nbytes for b in buckets]

    threads = [threading.Thread(target=worker, args=(groups,)) for groups in joined[senders:]]
    threads += [threading.Thread(target=sender, args=(joined[r][0], streams[r])) for r in range(senders)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for member in (senders, senders + 1):
        assert len(received[member]) == 5
        for i, parts in enumerate(received[member]):
            for stream, got in zip(streams, parts):
                want = stream[i].unpack()
                assert [n for n, _ in got] == [n for n, _ in want]
                assert all(torch.equal(a, b) for (_, a), (_, b) in zip(want, got))
    for groups in joined:
        for group in groups:
            group.close()
    host.close()


def test_a_member_that_never_joins_fails_the_others_naming_it():
    host = RendezvousHost(["trainer", "rollout 0 worker 0", "rollout 1 worker 0"], timeout_s=1.5)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(CollectiveGroup.join, host.rendezvous, member) for member in (0, 1)]
        for future in futures:
            with pytest.raises(SyncTimeoutError, match=r"rollout 1 worker 0 did not join within 2 s"):
                future.result(timeout=30)
    assert time.monotonic() - start < 10
    host.close()


def test_members_waiting_for_one_that_is_gone_stop_when_the_driver_abandons_the_group():
    host = RendezvousHost(["trainer", "rollout 0 worker 0", "rollout 1 worker 0"], timeout_s=120)
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(CollectiveGroup.join, host.rendezvous, member) for member in (0, 1)]
        time.sleep(0.5)  # both wait for rollout 1, whose server died
        start = time.monotonic()
        host.abandon("rollout 1 died")
        for future in futures:
            with pytest.raises(TransportError, match=rf"group {host.rendezvous.group_id} will not form: rollout 1 died"):
                future.result(timeout=30)
    assert time.monotonic() - start < 10  # not the group's 120 s deadline
    host.close()


def test_a_rendezvous_nobody_hosts_is_refused_with_its_address():
    rendezvous = Rendezvous("127.0.0.1", 1, "nobody", ("trainer", "worker"), timeout_s=1.0)
    with pytest.raises(TransportError, match=r"cannot reach the rendezvous .* at 127.0.0.1:1"):
        CollectiveGroup.join(rendezvous, 1)


def test_a_member_that_leaves_fails_the_senders_wait():
    host = RendezvousHost(["trainer", "rollout 0 worker 0"], timeout_s=2)
    (sender_group,), (worker_group,) = _join_all(host, range(2))
    worker_group.close()
    start = time.monotonic()
    with pytest.raises(TransportError, match="sending bucket 0 over collective group .* failed for trainer"):
        list(BucketSender(sender_group).send(_buckets(1, 2)))
    assert time.monotonic() - start < 15
    sender_group.close()
    host.close()


def test_announced_parts_must_match_the_workers_channels():
    host = RendezvousHost(["trainer", "rollout 0 worker 0"], timeout_s=5)
    _, (worker_group,) = _join_all(host, range(2))
    bucket = _buckets(2, 1)[0]
    with pytest.raises(TransportError, match="2 part\\(s\\) announced for 1 channel"):
        receive_parts([BucketReceiver(worker_group)], [bucket.contents()] * 2, [None, None])
