"""Packing tensors into one flat byte buffer per bucket, and back.

Why a flat buffer: Ray stores a numpy array in its object store with one
copy and hands it to every reader without another (zero-copy `ray.get`);
a list of torch tensors is pickled tensor by tensor instead. Raw bytes also
sidestep Ray's lack of float8 support (in Ray 2.60 `ray.get` of a
`float8_e4m3fn` tensor fails), because dtypes travel as names.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from refit.errors import InvalidTensorError
from refit.transport.integrity import tag

__all__ = ["BucketContents", "BucketWriter", "ReadersDone", "WireBucket", "WireTensor", "as_bytes", "assemble_bucket", "buffers_from",
           "element_view", "pack_bucket", "wire_dtype_problem"]

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32, torch.float64,
    torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool,
)}
_ALIGN = 64  # every tensor starts cache-line aligned, so views are aligned too
_where = threading.local()  # `buffers_from`'s allocator, while a producer writes a bucket on this thread


@contextmanager
def buffers_from(allocate: Callable[[int], np.ndarray] | None) -> Iterator[None]:
    """Within this block, a `BucketWriter` on this thread lays its bucket out in `allocate(nbytes)` (a writable uint8
    array of that size) instead of fresh host memory; None: fresh memory.

    Why: a transport whose bytes travel from memory of its own (the shm transport's files) then gets each bucket
    written once, where it travels from, instead of written and copied; and memory it reuses is not faulted in anew.
    The producer's code (a trainer's `produce(plan)`) is unchanged: the sender wraps each step of it.
    """
    before = getattr(_where, "allocate", None)
    _where.allocate = allocate
    try:
        yield
    finally:
        _where.allocate = before


@dataclass(frozen=True, slots=True)
class WireTensor:
    """Where one tensor lies in a bucket's buffer.

    `row_offset`: the first row of the named tensor this one holds; a rank of
    a sharded trainer sends only its rows, and the replica puts them together.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    row_offset: int = 0
    tag: str | None = None  # keyed integrity tag of the bytes (refit.transport.integrity), made by the sender while packing
    changed: int | None = None  # a delta of this many elements (refit.transport.delta), whose tag is the rebuilt tensor's
    encoding: str | None = None  # a delta's form: "sparse", "bitmap" or "steps" (refit.transport.delta)

    @property
    def identity(self) -> str:
        """What a tag binds the bytes to: the entry they are, so bytes moved to another entry fail."""
        return f"{self.name}|{self.dtype}|{list(self.shape)}|{self.row_offset}"


_entry_fields = operator.attrgetter(*(field.name for field in dataclasses.fields(WireTensor)))
"""A `WireTensor`'s fields as a tuple, in order (`dataclasses.astuple` copies deeply: slow for a bucket's table)."""


@dataclass(frozen=True, slots=True)
class BucketContents:
    """A bucket's table of contents without its bytes: what crosses an RPC when the bytes take another road.

    The collective transport broadcasts the bytes into the workers' buffers;
    the ipc transport leaves them in the trainer's GPU memory and sends a
    CUDA IPC handle (`ipc_handle`, JSON: `refit.transport.ipc.encode_handle`) to open them with; the shm
    transport leaves them in a memory file of the trainer's and sends its
    place (`shm`, a `refit.transport.shm.SegmentRef` as plain values).
    """

    index: int
    tensors: tuple[WireTensor, ...]
    nbytes: int
    ipc_handle: bytes | None = None
    shm: tuple[int, int, str, int] | None = None

    def to_plain(self) -> tuple:
        """Plain data for vLLM's RPC (msgpack carries no refit classes)."""
        return (self.index, [_entry_fields(t) for t in self.tensors], self.nbytes, self.ipc_handle, self.shm)

    def __reduce__(self) -> tuple:
        # Why: every bucket's contents cross Ray several times on a sync's critical path (the trainer's yield, the
        # driver's hand-on to each replica). Pickled as dataclasses, each entry goes through cloudpickle's reducers;
        # as plain tuples the whole table of contents pickles an order of magnitude faster.
        return _contents_from_plain, (self.to_plain(),)

    @classmethod
    def from_plain(cls, plain: tuple | list) -> BucketContents:
        index, tensors, nbytes, ipc_handle, shm = plain
        return cls(index, tuple(WireTensor(n, d, tuple(s), *rest) for n, d, s, *rest in tensors), nbytes, ipc_handle,
                   None if shm is None else tuple(shm))

    def with_bytes(self, buffer: np.ndarray | torch.Tensor) -> WireBucket:
        """The whole bucket, once its bytes have arrived in `buffer` (a host array or a uint8 tensor on any device)."""
        return WireBucket(self.index, self.tensors, buffer[: self.nbytes])


def _contents_from_plain(plain: tuple) -> BucketContents:
    return BucketContents.from_plain(plain)  # a module's function: pickled by name, unlike a bound class method


@dataclass(frozen=True, slots=True)
class ReadersDone:
    """Yielded by a sender after its last bucket, a few times: no bucket, but a question its consumer answers by
    taking it only once every bucket it handed on was read (a sync's relay: once every replica loaded every bucket).

    Why: a sender whose memory later buckets reuse (the shm transport's ring) learns how far its readers are only
    from how many items its consumer took (Ray's backpressure pauses a stream a window of items ahead of its reader
    at most); after its last bucket it would learn nothing more, and the next stream of the same trainer (another
    Syncer's sync) would rewrite files this sync's replicas still load. Paused at these, the stream ends only once
    they are done, and a trainer actor runs its next stream only after this one ended."""


@dataclass(frozen=True, slots=True)
class WireBucket:
    """One bucket as it travels: an index, a table of contents, and the bytes.

    `buffer` is a host array when the bucket travels through Ray's object
    store, or a uint8 tensor on the receiving device when it was broadcast.
    """

    index: int
    tensors: tuple[WireTensor, ...]
    buffer: np.ndarray | torch.Tensor

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def contents(self, *, ipc_handle: bytes | None = None, shm: tuple[int, int, str, int] | None = None) -> BucketContents:
        return BucketContents(self.index, self.tensors, self.nbytes, ipc_handle, shm)

    def unpack(self) -> list[tuple[str, torch.Tensor]]:
        """Views into the buffer (no copy); the engine's loaders copy them into place."""
        return [(t.name, tensor) for t, tensor in self.unpack_rows()]

    def unpack_rows(self) -> list[tuple[WireTensor, torch.Tensor]]:
        """Each table entry (with its row offset) and its view into the buffer; a delta entry's as raw bytes."""
        flat = _as_tensor(self.buffer)
        for t in self.tensors:  # a table that does not fit its buffer is refused by name, before any view is made
            if problem := _entry_problem(t, flat.numel()):
                raise InvalidTensorError(f"bucket {self.index}: {problem}")
        return [(t, raw if t.changed is not None else raw.view(_DTYPES[t.dtype]).reshape(t.shape))
                for t in self.tensors for raw in (flat[t.offset : t.offset + t.nbytes],)]


class BucketWriter:
    """A bucket's buffer, laid out from its table before any of its tensors exists.

    Producers write each tensor straight into its place (`slot(i)`), e.g. the
    quantizer its FP8 codes, then `seal(i)` tags it (with `key`, one sync's
    secret; None: untagged) while its bytes are still in cache; `finish()`
    hands over the bucket. That writes every byte
    once, where it travels from: the quantizer's own output tensors and a
    copy of them into the buffer cost a sync about as much as quantizing did.
    `entries`: `(name, dtype, shape)` in bucket order; `row_offsets` marks row
    slices of a tensor.
    """

    def __init__(
        self, index: int, entries: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
        *, row_offsets: Mapping[str, int] | None = None, key: bytes | None = None,
    ) -> None:
        row_offsets = row_offsets or {}
        table: list[WireTensor] = []
        offset = 0
        for name, dtype, shape in entries:
            dtype_name = str(dtype).removeprefix("torch.")
            if problem := wire_dtype_problem(name, dtype_name):
                raise InvalidTensorError(problem)
            nbytes = math.prod(shape) * dtype.itemsize
            table.append(WireTensor(name, dtype_name, tuple(shape), offset, nbytes, row_offsets.get(name, 0)))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        self.index = index
        self._table = table
        self._key = key
        self._sealed = [False] * len(table)
        allocate = getattr(_where, "allocate", None)
        self._buffer = np.empty(offset, dtype=np.uint8) if allocate is None else allocate(offset)
        self._flat = _as_tensor(self._buffer)

    def slot(self, i: int) -> torch.Tensor:
        """Entry `i`'s place in the buffer, as a tensor of its dtype and shape, to write into."""
        entry = self._table[i]
        return self._flat[entry.offset : entry.offset + entry.nbytes].view(_DTYPES[entry.dtype]).view(entry.shape)

    def seal(self, i: int) -> None:
        """Entry `i` is written: tag its bytes (if the bucket has a key)."""
        entry = self._table[i]
        if self._key is not None:
            data = self._flat[entry.offset : entry.offset + entry.nbytes]
            self._table[i] = dataclasses.replace(entry, tag=tag(self._key, entry.identity, data))
        self._sealed[i] = True

    def finish(self) -> WireBucket:
        """The bucket; every entry must have been written and sealed."""
        unsealed = [t.name for t, sealed in zip(self._table, self._sealed) if not sealed]
        if unsealed:
            raise InvalidTensorError(f"bucket {self.index}: {', '.join(unsealed)} never written into it")
        return WireBucket(self.index, tuple(self._table), self._buffer)


def pack_bucket(
    index: int, tensors: Iterable[tuple[str, torch.Tensor]], *, row_offsets: Mapping[str, int] | None = None,
    key: bytes | None = None,
) -> WireBucket:
    """Copy `tensors` (CPU or GPU) into one contiguous host buffer, tagged with `key` (the plan's `integrity_key`);
    `row_offsets` marks row slices of a tensor."""
    items = list(tensors)
    writer = BucketWriter(index, ((name, t.dtype, tuple(t.shape)) for name, t in items), row_offsets=row_offsets, key=key)
    for i, (_, tensor) in enumerate(items):
        writer.slot(i).copy_(tensor)
        writer.seal(i)
    return writer.finish()


def assemble_bucket(index: int, items: Iterable[tuple[WireTensor, torch.Tensor]]) -> WireBucket:
    """A bucket of entries whose bytes exist already (a delta's payloads); each entry's offset and size are set here."""
    items = [(entry, as_bytes(tensor)) for entry, tensor in items]
    offsets, offset = [], 0
    for _, raw in items:
        offsets.append(offset)
        offset += -(-raw.numel() // _ALIGN) * _ALIGN
    buffer = np.empty(offset, dtype=np.uint8)
    flat = torch.from_numpy(buffer)
    table = []
    for (entry, raw), start in zip(items, offsets):
        flat[start : start + raw.numel()] = raw
        table.append(dataclasses.replace(entry, offset=start, nbytes=raw.numel()))
    return WireBucket(index, tuple(table), buffer)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes in row-major order, as a flat uint8 tensor (a view when it is contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def wire_dtype_problem(name: str, dtype: str) -> str | None:
    """Why tensor `name` cannot travel in a bucket with dtype `dtype` (torch's name, without `torch.`), or None if it
    can."""
    if dtype in _DTYPES:
        return None
    return f"{name}: dtype {dtype} cannot travel in a refit bucket; expected one of {sorted(_DTYPES)}"


def _entry_problem(entry: WireTensor, buffer_bytes: int) -> str | None:
    """Why a table entry cannot be read from a buffer of `buffer_bytes`, or None."""
    if entry.offset < 0 or entry.nbytes < 0 or entry.offset + entry.nbytes > buffer_bytes:
        return f"{entry.name}: bytes {entry.offset}..{entry.offset + entry.nbytes} lie outside its {buffer_bytes}-byte buffer"
    if problem := wire_dtype_problem(entry.name, entry.dtype):
        return problem
    if entry.changed is None and entry.nbytes != math.prod(entry.shape) * _DTYPES[entry.dtype].itemsize:
        return f"{entry.name}: {entry.nbytes} bytes for shape {list(entry.shape)} of {entry.dtype}"
    return None


def element_view(dtype: str) -> torch.dtype:
    """The torch dtype a bucket names as `dtype`."""
    return _DTYPES[dtype]


def _as_tensor(buffer: np.ndarray | torch.Tensor) -> torch.Tensor:
    if isinstance(buffer, torch.Tensor):
        return buffer
    # Buffers fetched from Ray's object store are read-only; torch warns on
    # wrapping them. Nothing writes through a view of a read-only buffer (a
    # `BucketWriter` wraps its own writable one), so it is safe.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        flat = torch.from_numpy(buffer)
    # torch gives a 0-byte array stride 0, and a view of it as a wider dtype then fails: a bucket of only empty
    # tensors (a 0-row weight, its 0-row scale) must still unpack into them.
    return flat if flat.numel() else torch.empty(0, dtype=torch.uint8)
