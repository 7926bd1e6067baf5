"""The collective transport on its own: a real gloo group, members as threads of this process.

Pins: bytes arrive intact with the next bucket posted early (double
buffering), a member that never joins or a rendezvous nobody hosts fails
within the deadline naming it, and a member leaving fails the others' waits.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from refit.errors import SyncTimeoutError, TransportError
from refit.transport.buckets import pack_bucket
from refit.transport.collective import BucketReceiver, BucketSender, CollectiveGroup, Rendezvous, RendezvousHost


def _buckets(seed: int, count: int):
    generator = torch.Generator().manual_seed(seed)
    return [
        pack_bucket(i, [(f"model.layers.{i}.w", torch.randn(17 + i, 33, generator=generator).to(torch.bfloat16)),
                        (f"model.layers.{i}.b", torch.randn(5 + 3 * i, generator=generator))])
        for i in range(count)
    ]


def _join_all(host: RendezvousHost, ranks):
    with ThreadPoolExecutor(len(ranks)) as pool:
        return list(pool.map(lambda rank: CollectiveGroup.join(host.rendezvous, rank), ranks))


def test_buckets_arrive_intact_with_the_next_one_posted_early():
    host = RendezvousHost(["trainer", "rollout 0 worker 0", "rollout 1 worker 0"], timeout_s=20)
    sender_group, *worker_groups = _join_all(host, range(3))
    buckets = _buckets(0, 5)
    received: dict[int, list] = {1: [], 2: []}

    def worker(group: CollectiveGroup) -> None:
        receiver = BucketReceiver(group)
        receiver.prepare(max(b.nbytes for b in buckets))
        for i, bucket in enumerate(buckets):
            nxt = buckets[i + 1].nbytes if i + 1 < len(buckets) else None
            got = receiver.receive(bucket.contents(), nxt)
            received[group.rank].append([(n, t.clone()) for n, t in got.unpack()])

    threads = [threading.Thread(target=worker, args=(g,)) for g in worker_groups]
    for t in threads:
        t.start()
    contents = list(BucketSender(sender_group).send(buckets))
    for t in threads:
        t.join(timeout=30)
    assert [c.nbytes for c in contents] == [b.nbytes for b in buckets]
    for rank in (1, 2):
        assert len(received[rank]) == len(buckets)
        for bucket, got in zip(buckets, received[rank]):
            for (name, want), (got_name, value) in zip(bucket.unpack(), got):
                assert name == got_name and torch.equal(want, value)
    for group in (sender_group, *worker_groups):
        group.close()
    host.close()


def test_a_member_that_never_joins_fails_the_others_naming_it():
    host = RendezvousHost(["trainer", "rollout 0 worker 0", "rollout 1 worker 0"], timeout_s=1.5)
    start = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(CollectiveGroup.join, host.rendezvous, rank) for rank in (0, 1)]
        for future in futures:
            with pytest.raises(SyncTimeoutError, match=r"rollout 1 worker 0 did not join within 2 s"):
                future.result(timeout=30)
    assert time.monotonic() - start < 10
    host.close()


def test_a_rendezvous_nobody_hosts_is_refused_with_its_address():
    rendezvous = Rendezvous("127.0.0.1", 1, "nobody", ("trainer", "worker"), timeout_s=1.0)
    with pytest.raises(TransportError, match=r"cannot reach the rendezvous .* at 127.0.0.1:1"):
        CollectiveGroup.join(rendezvous, 1)


def test_a_member_that_leaves_fails_the_senders_wait():
    host = RendezvousHost(["trainer", "rollout 0 worker 0"], timeout_s=2)
    sender_group, worker_group = _join_all(host, range(2))
    worker_group.close()
    start = time.monotonic()
    with pytest.raises((TransportError, RuntimeError)):
        list(BucketSender(sender_group).send(_buckets(1, 2)))
    assert time.monotonic() - start < 15
    sender_group.close()
    host.close()


def test_a_bucket_larger_than_the_prepared_buffers_is_refused():
    host = RendezvousHost(["trainer", "rollout 0 worker 0"], timeout_s=5)
    _, worker_group = _join_all(host, range(2))
    receiver = BucketReceiver(worker_group)
    receiver.prepare(64)
    bucket = _buckets(2, 1)[0]
    with pytest.raises(TransportError, match="more than the 64 prepared"):
        receiver.receive(bucket.contents(), None)
