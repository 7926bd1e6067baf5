"""Delta syncs: send only the elements whose bytes changed since the version a replica serves.

Why in the wire (FP8) domain: between two RL steps at the learning rates RL
uses (1e-6 to 1e-5), 2-25% of bf16 elements change, but only 0.2-3% of the
FP8 codes and of their block scales do, since most updates are smaller than
an FP8 step. The wire bytes are what a sync moves, so they are what is
diffed, whatever produced them.

Both ends keep a *base*: the exact wire bytes of the last version, per
entry `(name, row_offset)` (a rank of a sharded trainer keeps its own rows).
The sender's base is the buckets it last produced: 1 byte per FP8 weight plus
its scales, 2 per parameter of a tensor that travels in bf16 (embeddings,
norms); `quantize_on="rollout"`, which sends every weight in bf16, turns
deltas off rather than keep a second bf16 model. The replica's is a host copy of
what it last loaded, which it patches in place.

A version is named by its digest: the keyed integrity tag of every entry's
bytes (refit/transport/integrity.py, made by the sender while packing
anyway), combined over the model (`version_digest`): content-addressed over
the served bytes, and unforgeable without the sync's key. The Syncer sends a
replica a delta only when its base's digest equals the sender's; the replica
checks every rebuilt tensor against the sender's tag before loading it, so a
base that differs in any entry (altered, or from another trainer) fails the
bucket instead of serving a mix. A delta needs those tags: a sync with
`verify="off"` (no key, no tags) sends everything.

Encoding of one entry (`WireTensor.changed` = n, the number of changed
elements; `WireTensor.encoding` names the form), the smallest that applies,
each part padded to 8 bytes so every view is aligned:
- *sparse*: one int32 count of changed elements per chunk of 65536, then the
  new elements (the entry's dtype), then the low 16 bits of each position
  (int16). 2 + itemsize bytes per changed element: 3 for FP8 codes.
- *steps* (elements of 2 bytes or more): one bit per element (set: changed),
  then each changed element's step as int8: the new element minus the old,
  as integers of the element's width. A small update moves a bf16 value by
  one or two units of its last place, and bf16 tensors (embeddings, norms)
  change in 5-25% of their elements per step at RL learning rates, so this
  is 1 byte per changed element plus 1/8 per element. Exact whatever the
  bits are (integer arithmetic modulo the width); only where every step
  fits in -128..127.
- *bitmap*: the same bitmap, then the new elements: where steps do not fit.
An entry whose delta would not be smaller travels whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable, Iterator, Sequence
from enum import StrEnum

import numpy as np
import torch

from refit.errors import BaseMismatchError
from refit.quantizer import _fused_cpu
from refit.transport.buckets import WireBucket, WireTensor, as_bytes, assemble_bucket, element_view
from refit.transport.integrity import tag_matches

__all__ = ["DeltaMode", "ReplicaBase", "SenderBase", "version_digest"]

_CHUNK_BITS = 16  # positions are chunk index (counted) + 16-bit offset in the chunk

Row = tuple[WireTensor, torch.Tensor]


class DeltaMode(StrEnum):
    """What a sender streams in one sync (the Syncer decides, from the bases' digests)."""

    OFF = "off"  # whole buckets, base left as it is (`SyncConfig(delta="off")`, or bf16 on the wire)
    FULL = "full"  # whole buckets; keep them as the base for the next sync
    DELTA = "delta"  # delta buckets against the base
    BOTH = "both"  # per bucket, the whole one then the delta one (replicas differ; over `ray` only)


def version_digest(entries: Iterable[tuple[str, int, str, tuple[int, ...], str | None]]) -> str | None:
    """The digest of a version: its entries `(name, row_offset, dtype, shape, tag)`, in any order; None if any entry
    is untagged (nothing then names the bytes)."""
    entries = sorted(entries)
    if any(tag is None for *_, tag in entries):
        return None
    text = "\n".join(f"{name}|{row}|{dtype}|{list(shape)}|{tag}" for name, row, dtype, shape, tag in entries)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _describe(entry: WireTensor) -> tuple[str, int, str, tuple[int, ...], str | None]:
    return (entry.name, entry.row_offset, entry.dtype, entry.shape, entry.tag)


class SenderBase:
    """The sender's end: keeps the last buckets it produced and turns new ones into delta buckets."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], Row] = {}  # views into the last buckets' buffers

    def entries(self) -> list[tuple[str, int, str, tuple[int, ...], str | None]]:
        """What the base holds, for `version_digest` (the Syncer merges a sharded trainer's ranks)."""
        return sorted(_describe(entry) for entry, _ in self._entries.values())

    def nbytes(self) -> int:
        return sum(entry.nbytes for entry, _ in self._entries.values())

    def stream(self, buckets: Iterable[WireBucket], mode: DeltaMode) -> Iterator[WireBucket]:
        """`buckets` as `mode` sends them; every whole bucket becomes the base, even when only its delta is sent.

        OFF neither makes nor drops a base. A trainer may be synced by several
        Syncers, and the base belongs to those that send deltas: one with
        `delta="off"` (or bf16 on the wire) streaming in between must not
        take it from them. Their replicas still hold the base's version, so
        their next delta is made against it as before.
        """
        mode = DeltaMode(mode)
        if mode is DeltaMode.OFF:
            yield from buckets
            return
        if mode is DeltaMode.FULL:
            # Nothing is diffed against the old base: freed first, it is not held beside the new one's buckets.
            self._entries.clear()
        streamed: set[tuple[str, int]] = set()
        for bucket in buckets:
            rows = [(entry, as_bytes(tensor)) for entry, tensor in bucket.unpack_rows()]
            delta = self._delta(bucket.index, rows) if mode in (DeltaMode.DELTA, DeltaMode.BOTH) else None
            for entry, raw in rows:
                self._entries[(entry.name, entry.row_offset)] = (entry, raw)
                streamed.add((entry.name, entry.row_offset))
            if mode is not DeltaMode.DELTA:
                yield bucket
            if delta is not None:
                yield delta
        # A whole stream's entries are the new version: as the replica's base drops what an update did not send
        # (`ReplicaBase.finish`), so does this one, or their digests would differ from then on.
        for slot in [slot for slot in self._entries if slot not in streamed]:
            del self._entries[slot]

    def _delta(self, index: int, rows: list[Row]) -> WireBucket:
        items: list[tuple[WireTensor, torch.Tensor]] = []
        for entry, new in rows:
            base = self._entries.get((entry.name, entry.row_offset))
            payload = None
            if base is not None and (base[0].dtype, base[0].shape) == (entry.dtype, entry.shape):
                payload = _encode(new, base[1], entry.dtype)
            if payload is None:
                items.append((entry, new))
            else:
                changed, encoding, data = payload
                items.append((dataclasses.replace(entry, changed=changed, encoding=encoding), data))
        return assemble_bucket(index, items)


class ReplicaBase:
    """The replica's end: a copy of the bytes it serves, patched by deltas; committed only by a finished update."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, int], Row] = {}
        self._digest: str | None = None  # None: no whole, served version is held
        self._changed = False  # by the open update
        self._rebuilt: set[tuple[str, int]] = set()  # the entries the open update sent

    def digest(self) -> str | None:
        """The digest of the version this base holds, or None if it holds none (new, or after a failed update)."""
        return self._digest

    def nbytes(self) -> int:
        return sum(int(tensor.numel()) for _, tensor in self._entries.values())

    def begin(self) -> None:
        self._changed = False
        self._rebuilt = set()

    def rebuild(self, rows: Sequence[Row], *, key: bytes | None) -> list[Row]:
        """Every row whole: a delta applied to the base and checked against its tag under `key` (the sync's), a whole
        one copied into it. Deltas without a key to check them are refused."""
        self._changed, self._digest = True, None
        out = []
        for entry, tensor in rows:
            slot = (entry.name, entry.row_offset)
            if entry.changed is None:
                # On the host even when the bytes arrived in GPU memory (a collective receive): a base in
                # device memory would cost every GPU a byte per parameter; the loaders copy host tensors in.
                stored = as_bytes(tensor).to("cpu", copy=True)
            else:
                base = self._entries.get(slot)
                if base is None or (base[0].dtype, base[0].shape) != (entry.dtype, entry.shape):
                    raise BaseMismatchError(
                        f"{entry.name}: a delta arrived for a tensor this replica's base does not hold as "
                        f"{entry.dtype} {list(entry.shape)}; it needs a full sync"
                    )
                if key is None or entry.tag is None:
                    raise BaseMismatchError(f"{entry.name}: a delta arrived without a key and tag to check its rebuilt bytes")
                stored = base[1]
                _apply(stored, as_bytes(tensor).cpu(), entry)
                if not tag_matches(key, entry.identity, stored, entry.tag):
                    raise BaseMismatchError(
                        f"{entry.name}: rebuilt from this replica's base and the delta, its bytes differ from the "
                        "sender's (keyed tag); the base was altered or is not the version the delta was made against, "
                        "or the delta was altered in transit. Nothing of this bucket was loaded; the base is dropped, "
                        "so the next sync is a full one"
                    )
            whole = dataclasses.replace(entry, changed=None, encoding=None, nbytes=stored.numel())
            self._entries[slot] = (whole, stored)
            self._rebuilt.add(slot)
            out.append((whole, stored.view(element_view(entry.dtype)).view(entry.shape)))
        return out

    def finish(self) -> str | None:
        """The update is served: the base now holds its version.

        Every update sends every entry (a delta, or whole), so entries it did not send are another plan's (the
        trainer's rows split anew, a tensor another trainer sent): kept, they would stay in the digest, which then
        never equals the sender's again, and every later sync would be a full one.
        """
        if self._rebuilt:
            for slot in [slot for slot in self._entries if slot not in self._rebuilt]:
                del self._entries[slot]
        self._digest = version_digest(_describe(entry) for entry, _ in self._entries.values())
        return self._digest

    def abort(self) -> None:
        """The update failed: a base it changed holds no version any more."""
        if self._changed:
            self.clear()

    def clear(self) -> None:
        self._entries.clear()
        self._digest, self._changed = None, False


def _elements(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Bytes as integers `width` bytes wide: equal bytes <=> equal integers, NaN or not."""
    return raw.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width])


def _round8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


def _chunks(numel: int) -> int:
    """How many 65536-element chunks a delta counts changes in."""
    return -(-numel // (1 << _CHUNK_BITS))


def _layout(numel: int, changed: int, width: int) -> tuple[int, int, int]:
    """Byte offsets of the values and the low positions, and the payload's size."""
    values = _round8(4 * _chunks(numel))
    low = values + _round8(width * changed)
    return values, low, low + 2 * changed


def _torch_positions(new: torch.Tensor, old: torch.Tensor, width: int) -> torch.Tensor:
    """Indices of the elements whose bytes differ, by torch ops: words first (8 bytes at a time), then inside them."""
    if new.numel() % 8:
        return (_elements(new, width) != _elements(old, width)).nonzero().view(-1)
    words = (new.view(torch.int64) != old.view(torch.int64)).nonzero().view(-1)
    per_word = 8 // width
    inside = (_elements(new, width).view(-1, per_word)[words] != _elements(old, width).view(-1, per_word)[words]).nonzero()
    return words[inside[:, 0]] * per_word + inside[:, 1]


def _delta_parts(
    new: torch.Tensor, old: torch.Tensor, width: int, cap: int, chunks: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(count per chunk, the changed elements' bytes, their positions' low 16 bits), or None past `cap` changes."""
    parts = _fused_cpu.encode_delta(new, old, width, cap, chunks)
    if parts is not False:  # the C kernel: one pass at memory speed, stopping once past `cap`
        return parts
    positions = _torch_positions(new, old, width)
    if positions.numel() > cap:
        return None
    counts = torch.bincount(positions >> _CHUNK_BITS, minlength=chunks).to(torch.int32)
    low = (positions & 0xFFFF).to(torch.int32).to(torch.int16)  # the low 16 bits, as a bit pattern
    return counts, as_bytes(_elements(new, width)[positions]), low


def _bitmap_size(numel: int, changed: int, itemsize: int) -> int:
    """A bitmap of `numel` elements then `changed` values of `itemsize` bytes (steps: 1)."""
    return _round8(-(-numel // 8)) + _round8(itemsize * changed)


def _encode(new: torch.Tensor, old: torch.Tensor, dtype: str) -> tuple[int, str, torch.Tensor] | None:
    """(changed elements, encoding, payload bytes) in the smallest encoding, or None when the whole entry is no
    larger."""
    width = element_view(dtype).itemsize
    numel = new.numel() // width
    chunks = _chunks(numel)
    cap = (new.numel() - 8 - _layout(numel, 0, width)[2]) // (2 + width)  # at most this many for a smaller payload
    # Past this many changes another form is smaller, so the sparse pass stops there: a bitmap (1/8 byte per
    # element, then `width` per change) past 1 in 16; steps (1/8, then 1 per change) past 1 in 8 * (width + 1).
    cap = min(cap, (numel // (8 * (width + 1)) if width >= 2 else numel // 16) + 8)
    parts = _delta_parts(new, old, width, cap, chunks) if cap >= 0 else None
    smallest = new.numel()  # the whole entry
    if parts is not None:
        smallest = min(smallest, _layout(numel, parts[2].numel(), width)[2])
    if parts is None or 16 * parts[2].numel() > numel:  # past 1 in 16 changed, a bitmap may be smaller
        steps = _encode_steps(new, old, width)
        if steps is None or steps[2].numel() > _bitmap_size(numel, steps[0], width):  # escapes past the values' size
            steps = _encode_bitmap(new, old, width)
        if steps is not None and steps[2].numel() < smallest:
            return steps
    if parts is None or smallest == new.numel():
        return None
    counts, values, low = parts
    values_at, low_at, size = _layout(numel, low.numel(), width)
    payload = torch.zeros(size, dtype=torch.uint8)
    payload[: 4 * chunks] = as_bytes(counts)
    payload[values_at : values_at + values.numel()] = values
    payload[low_at:] = as_bytes(low)
    return low.numel(), "sparse", payload


_ESCAPE = -128  # a step that does not fit in int8: the new element follows among the escaped ones


def _steps(new: torch.Tensor, old: torch.Tensor, width: int) -> torch.Tensor:
    """new - old per element, as integers of `width` bytes wrapped to their range (int64)."""
    return _wrapped(_elements(new, width).to(torch.int64) - _elements(old, width).to(torch.int64), width)


def _wrapped(values: torch.Tensor, width: int) -> torch.Tensor:
    """int64 `values` modulo 2^(8 * width), as signed integers of that width (int64 wraps by itself)."""
    if width == 8:
        return values
    values = values & ((1 << (8 * width)) - 1)
    return torch.where(values >= 1 << (8 * width - 1), values - (1 << (8 * width)), values)


def _steps_size(numel: int, changed: int, escaped: int, width: int) -> int:
    return _bitmap_size(numel, changed, 1) + _round8(width * escaped)


def _bitmap_payload(bitmap: torch.Tensor, *parts: torch.Tensor) -> torch.Tensor:
    """The bitmap forms' layout: the bitmap, then each part (values; or steps, then escaped values), each padded
    to 8 bytes (`_bitmap_size`, `_steps_size`)."""
    padded = [_round8(part.numel()) for part in (bitmap, *parts)]
    payload = torch.zeros(sum(padded), dtype=torch.uint8)
    offset = 0
    for part, size in zip((bitmap, *parts), padded):
        payload[offset : offset + part.numel()] = part
        offset += size
    return payload


def _encode_steps(new: torch.Tensor, old: torch.Tensor, width: int) -> tuple[int, str, torch.Tensor] | None:
    """(changed elements, "steps", payload); None for 1-byte elements or if nothing changed."""
    if width < 2:
        return None
    parts = _fused_cpu.encode_steps(new, old, width)
    if parts is False:  # torch ops
        step = _steps(new, old, width)
        changed = step != 0
        step = step[changed]
        fits = (step >= -127) & (step <= 127)
        escaped = as_bytes(_elements(new, width)[changed][~fits])
        parts = (torch.from_numpy(np.packbits(changed.numpy(), bitorder="little")),
                 torch.where(fits, step, _ESCAPE).to(torch.int8), escaped)
    bitmap, steps, escaped = parts
    if steps.numel() == 0:
        return None
    return steps.numel(), "steps", _bitmap_payload(bitmap, as_bytes(steps), escaped)


def _encode_bitmap(new: torch.Tensor, old: torch.Tensor, width: int) -> tuple[int, str, torch.Tensor] | None:
    """(changed elements, "bitmap", payload); None if nothing changed (the sparse form is smaller then)."""
    parts = _fused_cpu.encode_bitmap(new, old, width)
    if parts is False:  # torch ops
        changed = _elements(new, width) != _elements(old, width)
        parts = torch.from_numpy(np.packbits(changed.numpy(), bitorder="little")), as_bytes(_elements(new, width)[changed])
    bitmap, values = parts
    if values.numel() == 0:
        return None
    return values.numel() // width, "bitmap", _bitmap_payload(bitmap, values)


def _apply(stored: torch.Tensor, payload: torch.Tensor, entry: WireTensor) -> None:
    """Write a delta's elements into the base entry `stored`, in place."""
    width = element_view(entry.dtype).itemsize
    n, numel = entry.changed, stored.numel() // width
    expected = {"sparse": _layout(numel, n, width)[2], "bitmap": _bitmap_size(numel, n, width)}
    if entry.encoding == "steps" and width >= 2 and payload.numel() >= _bitmap_size(numel, n, 1):
        bits_size = _round8(-(-numel // 8))
        escaped = int((payload[bits_size : bits_size + n].view(torch.int8) == _ESCAPE).sum())
        expected["steps"] = _steps_size(numel, n, escaped, width)
    if entry.encoding not in expected or payload.numel() != expected[entry.encoding]:
        raise BaseMismatchError(
            f"{entry.name}: a delta of {payload.numel()} bytes in encoding {entry.encoding!r} cannot hold {n} changed "
            f"{entry.dtype} elements"
        )
    if entry.encoding == "sparse":
        _apply_sparse(stored, payload, entry, width, numel)
    else:
        _apply_bitmap(stored, payload, entry, width, numel)


def _apply_sparse(stored: torch.Tensor, payload: torch.Tensor, entry: WireTensor, width: int, numel: int) -> None:
    n = entry.changed
    values_at, low_at, _ = _layout(numel, n, width)
    chunks = _chunks(numel)
    counts, low = payload[: 4 * chunks].view(torch.int32), payload[low_at:].view(torch.int16)
    values = payload[values_at : values_at + n * width]
    applied = _fused_cpu.apply_delta(stored, width, counts, values, low)
    if applied is None:  # torch ops
        if int(counts.to(torch.int64).sum()) != n:
            raise BaseMismatchError(f"{entry.name}: a delta's position counts do not add up to its {n} changed elements")
        positions = (torch.repeat_interleave(torch.arange(chunks), counts.to(torch.int64)) << _CHUNK_BITS) | (low.to(torch.int64) & 0xFFFF)
        if n and int(positions.max()) >= numel:
            raise BaseMismatchError(f"{entry.name}: a delta names elements beyond its {numel}")
        _elements(stored, width)[positions] = values.view(_elements(stored, width).dtype)
    elif not applied:
        raise BaseMismatchError(f"{entry.name}: a delta's position counts or indices do not fit its {numel} elements and {n} changes")


def _apply_bitmap(stored: torch.Tensor, payload: torch.Tensor, entry: WireTensor, width: int, numel: int) -> None:
    """A bitmap or steps delta: the bitmap marks the changed elements, then their new values or their steps (and
    the escaped elements' new values)."""
    n = entry.changed
    bits_size = _round8(-(-numel // 8))
    bitmap, rest = payload[: -(-numel // 8)], payload[bits_size:]
    if entry.encoding == "steps":
        steps, escaped = rest[:n].view(torch.int8), rest[_round8(n) :]
        escaped = escaped[: width * int((steps == _ESCAPE).sum())]
        applied = _fused_cpu.apply_steps(stored, width, bitmap, steps, escaped)
    else:
        applied = _fused_cpu.apply_bitmap(stored, width, bitmap, rest[: width * n])
    if applied is False:
        raise BaseMismatchError(f"{entry.name}: a delta's bitmap does not mark exactly its {n} changes")
    if applied:
        return
    changed = torch.from_numpy(np.unpackbits(bitmap.numpy(), count=numel, bitorder="little").view(bool))
    if int(changed.sum()) != n:
        raise BaseMismatchError(f"{entry.name}: a delta's bitmap marks {int(changed.sum())} elements, not its {n} changes")
    elements = _elements(stored, width)
    if entry.encoding == "steps":  # torch ops: the kernel's integer arithmetic
        values = _wrapped(elements[changed].to(torch.int64) + steps.to(torch.int64), width).to(elements.dtype)
        values[steps == _ESCAPE] = escaped.view(elements.dtype)
        elements[changed] = values
    else:
        elements[changed] = rest[: width * n].view(elements.dtype)
