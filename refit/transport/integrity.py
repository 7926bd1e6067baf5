"""Keyed integrity tags of the bytes a sync moves.

Why a keyed MAC, not a checksum: a CRC carried beside the data catches
accidents only; whoever alters the bytes recomputes it. A tag made with a
secret that never travels on the data plane cannot be forged by anyone who
sees or writes that plane (the object store's bytes, a collective group's
sockets) without the secret.

The secret is one sync's (`new_sync_key`): the driver makes it and it rides
inside the sync's plan (`TransferPlan.integrity_key`) over Ray's control
plane, or a `vllm serve` replica's key-protected HTTP, to the trainer, which
tags every entry while packing it, and to the replicas, which check each
entry before any byte of it is loaded. A tag from an earlier sync does not
verify in a later one, so old bytes cannot be replayed.

A tag covers an entry's identity (name, dtype, shape, row offset) with its
bytes, so bytes moved to another entry fail too. Keyed BLAKE3 (the `blake3`
package: several GB/s on one core, more on large tensors with its threads);
HMAC-SHA256 where `blake3` is not installed. A tag names its algorithm, so a
receiver computes the sender's or says what to install.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

import torch

try:
    import blake3 as _blake3
except ImportError:  # the tags fall back to HMAC-SHA256 (about a third of the speed)
    _blake3 = None

__all__ = ["KEY_BYTES", "new_sync_key", "tag", "tag_matches"]

KEY_BYTES = 32
_TAG_BYTES = 16  # 128-bit tags: forging one takes 2^128 tries, each a refused sync
_THREADS_FROM_BYTES = 1 << 20  # below this BLAKE3's threads cost more than they save


def new_sync_key() -> bytes:
    """A fresh secret for one sync's tags."""
    return secrets.token_bytes(KEY_BYTES)


def tag(key: bytes, identity: str, data: torch.Tensor) -> str:
    """The tag of `data`'s bytes (row-major, copied to the host first if they are not there) as the entry `identity`."""
    raw = _host_bytes(data)
    if _blake3 is not None:
        threads = _blake3.blake3.AUTO if raw.nbytes >= _THREADS_FROM_BYTES else 1
        hasher = _blake3.blake3(identity.encode() + b"\0", key=key, max_threads=threads)
        hasher.update(raw)
        return "b3:" + hasher.hexdigest(length=_TAG_BYTES)
    return "hs:" + _hmac(key, identity, raw)


def tag_matches(key: bytes, identity: str, data: torch.Tensor, expected: str) -> bool:
    """Whether `expected` is the tag of `data` as `identity` under `key`, compared in constant time.

    Raises `ModuleNotFoundError`, naming the package, for a BLAKE3 tag where `blake3` is not installed.
    """
    algorithm, _, _ = expected.partition(":")
    if algorithm == "hs":
        actual = "hs:" + _hmac(key, identity, _host_bytes(data))
    elif algorithm == "b3":
        if _blake3 is None:
            raise ModuleNotFoundError("the sender tags its bytes with keyed BLAKE3: install the `blake3` package here too")
        actual = tag(key, identity, data)
    else:
        return False
    return hmac.compare_digest(actual, expected)


def _hmac(key: bytes, identity: str, raw) -> str:
    mac = hmac.new(key, identity.encode() + b"\0", hashlib.sha256)
    mac.update(raw)
    return mac.hexdigest()[: 2 * _TAG_BYTES]


def _host_bytes(data: torch.Tensor):
    flat = data.detach().contiguous().view(-1).view(torch.uint8)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    return flat.numpy()
