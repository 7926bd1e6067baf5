"""Delta encoding, pure logic: a delta rebuilds the sender's bytes exactly, or the replica refuses it by name."""

from __future__ import annotations

import pytest
import torch

from refit.errors import BaseMismatchError
from refit.quantizer import _fused_cpu
from refit.transport import delta
from refit.transport.buckets import pack_bucket
from refit.transport.delta import DeltaMode, ReplicaBase, SenderBase, version_digest
from refit.transport.integrity import new_sync_key

KEY = new_sync_key()  # one sync's; every test here stands for one sync's worth of keys


def bucket(weight: torch.Tensor, scale: torch.Tensor, embedding: torch.Tensor, *, index: int = 0, rows: int = 0):
    return pack_bucket(index, [("w", weight), ("w_scale", scale), ("emb", embedding)], row_offsets={"emb": rows}, key=KEY)


def tensors(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(300, 260, generator=gen).to(torch.float8_e4m3fn), torch.rand(3, 3, generator=gen),
            torch.randn(70, 64, generator=gen).to(torch.bfloat16))


def changed(values: tuple, fraction: float, seed: int = 1, byte: int = 0) -> tuple:
    """Each tensor with about `fraction` of its elements' byte `byte` flipped in its lowest bit (0, the lowest byte:
    a step of one unit in the last place; NaN patterns included)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for value in values:
        value = value.clone()
        raw = value.view(-1).view(torch.uint8)
        flip = torch.rand(value.numel(), generator=gen) < fraction
        raw.view(value.numel(), -1)[flip, byte] ^= 0x01
        out.append(value)
    return tuple(out)


def sync(sender: SenderBase, replica: ReplicaBase, buckets: list, mode: DeltaMode) -> list:
    replica.begin()
    sent = list(sender.stream(buckets, mode))
    rebuilt = [replica.rebuild(part.unpack_rows(), key=KEY) for part in sent]
    replica.finish()
    return sent, rebuilt


def torch_ops_only(monkeypatch, *forms: str) -> None:
    """The C kernels of `forms` ("delta", "steps", "bitmap") say they do not apply, so torch ops run instead."""
    for form in forms:
        monkeypatch.setattr(_fused_cpu, f"encode_{form}", lambda *args: False)
        monkeypatch.setattr(_fused_cpu, f"apply_{form}", lambda *args: None)


def after_a_full_sync() -> tuple[SenderBase, ReplicaBase, tuple]:
    """A sender and a replica whose bases hold `tensors()`."""
    sender, replica = SenderBase(), ReplicaBase()
    state = tensors()
    sync(sender, replica, [bucket(*state)], DeltaMode.FULL)
    return sender, replica, state


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_a_chain_of_deltas_rebuilds_the_senders_bytes_and_its_digest(monkeypatch, kernel):
    if kernel == "torch":
        torch_ops_only(monkeypatch, "delta")
    sender, replica = SenderBase(), ReplicaBase()
    state = tensors()
    sent, _ = sync(sender, replica, [bucket(*state)], DeltaMode.FULL)
    assert all(entry.changed is None for entry in sent[0].tensors)
    for step, fraction in enumerate((0.003, 0.03, 0.0)):
        state = changed(state, fraction, seed=step)
        full = bucket(*state)
        (sent,), (rows,) = sync(sender, replica, [full], DeltaMode.DELTA)
        assert all(entry.changed is not None for entry in sent.tensors) and sent.nbytes < 0.2 * full.nbytes
        for (entry, got), value in zip(rows, state):
            assert torch.equal(got.view(torch.uint8), value.view(torch.uint8)), entry.name
        assert replica.digest() == version_digest(sender.entries())


def test_an_entry_whose_delta_is_not_smaller_travels_whole_and_both_mode_yields_both():
    sender, replica, state = after_a_full_sync()
    state = (changed(state[:1], 0.97)[0], *state[1:])  # nearly every FP8 code: even a bitmap is not smaller
    whole, delta_part = sender.stream([bucket(*state)], DeltaMode.BOTH)
    kinds = {entry.name: entry.changed for entry in delta_part.tensors}
    assert kinds["w"] is None and kinds["w_scale"] == 0 and kinds["emb"] == 0
    assert all(entry.changed is None for entry in whole.tensors)
    replica.begin()
    replica.rebuild(delta_part.unpack_rows(), key=KEY)
    assert replica.finish() == version_digest(sender.entries())


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("fraction", [0.08, 0.2, 0.5])
def test_where_many_bf16_elements_move_a_little_their_steps_are_sent_and_rebuild_the_bytes(monkeypatch, kernel, fraction):
    """bf16 tensors at RL learning rates change 5-25% of their elements, mostly by one unit in the last place: one
    bit per element plus an int8 step per changed one. A few elements that move further (here 1%, by 256 units)
    are escaped, their new values sent whole."""
    if kernel == "torch":
        torch_ops_only(monkeypatch, "steps")
    sender, replica, state = after_a_full_sync()
    embedding = changed(changed(state[2:], fraction)[0:1], 0.01, seed=5, byte=1)[0]
    (sent,), (rows,) = sync(sender, replica, [bucket(state[0], state[1], embedding)], DeltaMode.DELTA)
    (emb,) = [entry for entry in sent.tensors if entry.name == "emb"]
    numel = 70 * 64
    assert emb.encoding == "steps" and emb.nbytes < 0.125 * numel + (fraction + 0.05) * numel + 2 * 0.02 * numel
    assert torch.equal(rows[2][1].view(torch.uint8), embedding.view(torch.uint8))
    assert replica.digest() == version_digest(sender.entries())


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("fraction", [0.08, 0.5])
def test_where_many_elements_jump_a_bitmap_of_positions_and_new_values_is_sent(monkeypatch, kernel, fraction):
    """Steps that do not fit int8 (here the exponent's lowest bit, 128 units) would all be escaped: the bitmap
    with the new values is smaller. So it is for FP8 codes, once more than 1 in 16 change."""
    if kernel == "torch":
        torch_ops_only(monkeypatch, "bitmap")
    sender, replica, state = after_a_full_sync()
    embedding = changed(state[2:], fraction, byte=1)[0]
    codes = changed(state[:1], 0.3)[0]
    (sent,), (rows,) = sync(sender, replica, [bucket(codes, state[1], embedding)], DeltaMode.DELTA)
    w, _, emb = sent.tensors
    numel = 70 * 64
    assert emb.encoding == "bitmap" and emb.nbytes == delta._bitmap_size(numel, emb.changed, 2)
    assert emb.nbytes < 0.125 * numel + 2 * (fraction + 0.05) * numel
    assert w.encoding == "bitmap" and w.nbytes == delta._bitmap_size(300 * 260, w.changed, 1)
    assert torch.equal(rows[2][1].view(torch.uint8), embedding.view(torch.uint8))
    assert torch.equal(rows[0][1].view(torch.uint8), codes.view(torch.uint8))
    assert replica.digest() == version_digest(sender.entries())


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("byte", [0, 1], ids=["steps", "bitmap"])
def test_a_bitmap_that_marks_another_count_than_the_entry_says_is_refused(monkeypatch, kernel, byte):
    if kernel == "torch":
        torch_ops_only(monkeypatch, "bitmap", "steps")
    sender, replica, state = after_a_full_sync()
    (sent,) = sender.stream([bucket(state[0], state[1], changed(state[2:], 0.3, byte=byte)[0])], DeltaMode.DELTA)
    rows = [(entry, tensor.clone()) for entry, tensor in sent.unpack_rows()]
    emb, payload = rows[2]
    assert emb.encoding == ("steps", "bitmap")[byte]
    payload[0] ^= 0x01  # one position more or fewer than `changed`
    replica.begin()
    with pytest.raises(BaseMismatchError, match="emb: a delta's bitmap"):
        replica.rebuild(rows, key=KEY)


def test_a_base_that_differs_is_refused_by_name_and_dropped():
    sender, replica, state = after_a_full_sync()
    replica._entries[("emb", 0)][1][5] ^= 0x40  # altered after it was served
    state = changed(state, 0.01)
    (sent,) = sender.stream([bucket(*state)], DeltaMode.DELTA)
    replica.begin()
    with pytest.raises(BaseMismatchError, match="emb: rebuilt from this replica's base"):
        replica.rebuild(sent.unpack_rows(), key=KEY)
    replica.abort()
    assert replica.digest() is None and replica.nbytes() == 0
    with pytest.raises(BaseMismatchError, match="w: a delta arrived for a tensor this replica's base does not hold"):
        ReplicaBase().rebuild(sent.unpack_rows(), key=KEY)


def test_a_failed_update_that_changed_nothing_keeps_the_base():
    sender, replica = SenderBase(), ReplicaBase()
    sync(sender, replica, [bucket(*tensors())], DeltaMode.FULL)
    digest = replica.digest()
    replica.begin()
    replica.abort()
    assert replica.digest() == digest and replica.nbytes() > 0


def test_row_slices_of_a_sharded_sender_are_their_own_entries_and_the_digest_ignores_order():
    first, second = SenderBase(), SenderBase()  # two ranks, each with its rows of "emb"
    state = tensors()
    list(first.stream([bucket(*state, rows=0)], DeltaMode.FULL))
    list(second.stream([bucket(*state, index=1, rows=70)], DeltaMode.FULL))
    entries = first.entries() + second.entries()
    assert {(name, row) for name, row, *_ in entries} >= {("emb", 0), ("emb", 70)}
    assert version_digest(entries) == version_digest(list(reversed(entries)))
    assert version_digest(entries) != version_digest(first.entries())


def test_a_full_sync_of_another_split_leaves_no_entry_of_the_old_one_in_the_replicas_base():
    """Found by review: entries a full sync no longer sent (a trainer resharded: its rows split anew) stayed in the
    replica's base and digest, which then never equalled the sender's again: every later sync was a full one."""
    state = tensors()
    replica = ReplicaBase()
    two_ranks = [bucket(*state, rows=0), bucket(*state, index=1, rows=70)]  # "emb" as two ranks' row slices
    sync(SenderBase(), replica, two_ranks, DeltaMode.FULL)
    sender = SenderBase()  # one rank now: "emb" whole, from row 0
    sync(sender, replica, [bucket(*state)], DeltaMode.FULL)
    assert replica.digest() == version_digest(sender.entries())
    sync(sender, replica, [bucket(*changed(state, 0.01))], DeltaMode.DELTA)  # a delta syncs on that base
    assert replica.digest() == version_digest(sender.entries())


def test_a_delta_stream_of_another_split_leaves_both_bases_with_the_same_entries():
    """The sender's side of the same: a delta stream whose rows split anew dropped the old split on the replica but
    kept it on the sender, and the digests differed."""
    state = tensors()
    sender, replica = SenderBase(), ReplicaBase()
    sync(sender, replica, [bucket(*state, rows=0), bucket(*state, index=1, rows=70)], DeltaMode.FULL)
    sync(sender, replica, [bucket(*changed(state, 0.01))], DeltaMode.DELTA)  # "emb" whole from row 0: sent whole
    assert replica.digest() == version_digest(sender.entries())
    assert {(name, row) for name, row, *_ in sender.entries()} == {("w", 0), ("w_scale", 0), ("emb", 0)}


def test_off_keeps_no_base_and_leaves_another_syncers_base_alone():
    """A Syncer with `delta="off"` streams whole buckets and makes no base; streaming between two syncs of a Syncer
    that sends deltas, it leaves that Syncer's base as it was, so the next delta still rebuilds the sender's bytes."""
    off_only = SenderBase()
    assert list(off_only.stream([bucket(*tensors())], DeltaMode.OFF))
    assert off_only.nbytes() == 0 and off_only.entries() == []

    sender, replica = SenderBase(), ReplicaBase()
    sync(sender, replica, [bucket(*tensors())], DeltaMode.FULL)
    base, digest = sender.entries(), replica.digest()
    assert sender.nbytes() > 0 and version_digest(base) == digest

    (whole,) = list(sender.stream([bucket(*changed(tensors(), 0.5, seed=5))], DeltaMode.OFF))  # another Syncer's sync
    assert whole.index == 0 and sender.entries() == base

    new = changed(tensors(), 0.02)
    (sent,), (rebuilt,) = sync(sender, replica, [bucket(*new)], DeltaMode.DELTA)
    assert all(entry.changed is not None for entry in sent.tensors)  # a delta, made against the kept base
    assert [entry.name for entry, _ in rebuilt] == ["w", "w_scale", "emb"]
    for (_, got), want in zip(rebuilt, new):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert replica.digest() == version_digest(sender.entries())


def test_the_c_kernel_and_torch_encode_the_same_delta_and_refuse_more_than_the_cap(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    for nbytes in (7, 64, 1000, 4099 * 8, (1 << 17) + 24):
        old = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        new = old.clone()
        new[torch.randint(0, nbytes, (nbytes // 9 + 1,), generator=gen)] ^= 0x80
        for width in (1, 2, 4, 8):
            if nbytes % width:
                continue
            chunks = -(-nbytes // width // 65536)
            by_c = delta._delta_parts(new, old, width, nbytes, chunks)
            with monkeypatch.context() as patch:
                patch.setattr(_fused_cpu, "encode_delta", lambda *args: False)
                by_torch = delta._delta_parts(new, old, width, nbytes, chunks)
            assert all(torch.equal(c, t) for c, t in zip(by_c, by_torch)), (nbytes, width)
            changed = by_torch[2].numel()
            assert delta._delta_parts(new, old, width, changed - 1, chunks) is None
            assert delta._delta_parts(new, old, width, changed, chunks) is not None


def test_a_delta_whose_positions_do_not_fit_is_refused_by_both_kernels(monkeypatch):
    sender, replica, state = after_a_full_sync()
    (sent,) = sender.stream([bucket(*changed(state, 0.01))], DeltaMode.DELTA)
    entry, payload = sent.unpack_rows()[0]
    payload = payload.clone()
    payload[:4].view(torch.int32)[0] += 1  # one more change counted than the delta holds
    for kernel in ("c", "torch"):
        with monkeypatch.context() as patch:
            if kernel == "torch":
                patch.setattr(_fused_cpu, "apply_delta", lambda *args: None)
            with pytest.raises(BaseMismatchError, match="w: a delta's position counts"):
                delta._apply(replica._entries[("w", 0)][1].clone(), payload, entry)
