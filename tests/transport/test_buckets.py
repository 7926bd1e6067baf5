"""Wire buckets: every dtype survives Ray's object store, float8 included; a table that does not fit its buffer is
refused by name.

Ray 2.60 cannot carry float8 tensors (`ray.get` fails with "UntypedStorage has
no attribute 'dtype'", docs/troubleshooting.md); a bucket travels as raw bytes instead.
"""

from __future__ import annotations

import re

import pytest
import ray
import torch

from refit.errors import InvalidTensorError
from refit.transport.buckets import WireBucket, pack_bucket


def sample_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(130, 260, generator=g)
    return [
        ("a.weight", w.to(torch.float8_e4m3fn)),
        ("a.weight_scale", torch.rand(2, 3, generator=g).to(torch.bfloat16)),
        ("b.bias", torch.randn(7, generator=g)),
        ("c.k_scale", torch.tensor(0.25)),
        ("d.weight", w[:, :3].to(torch.float16)),  # non-contiguous source
        ("e.mask", torch.tensor([True, False, True])),
    ]


def assert_same(got, expected):
    assert [n for n, _ in got] == [n for n, _ in expected]
    for (name, a), (_, b) in zip(got, expected):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), name


def test_round_trip_in_process():
    tensors = sample_tensors()
    bucket = pack_bucket(3, tensors)
    assert bucket.index == 3
    assert all(t.offset % 64 == 0 for t in bucket.tensors)
    assert_same(bucket.unpack(), tensors)


def test_round_trip_through_the_object_store(ray_cluster):
    tensors = sample_tensors()
    fetched = ray.get(ray.put(pack_bucket(0, tensors)))
    assert not fetched.buffer.flags.writeable  # zero-copy view of the object store
    assert_same(fetched.unpack(), tensors)



@pytest.mark.parametrize(("wrong", "says"), [
    ({"nbytes": 12}, "layer.1.w: 12 bytes for shape [8] of float32"),
    ({"offset": 112}, "layer.1.w: bytes 112..144 lie outside its 128-byte buffer"),
    ({"dtype": "float4_e2m1fn_x2"}, "layer.1.w: dtype float4_e2m1fn_x2 cannot travel in a refit bucket"),
    ({"shape": (5,)}, "layer.1.w: 32 bytes for shape [5] of float32"),
])
def test_a_table_of_contents_that_does_not_fit_its_buffer_is_refused_naming_the_entry(wrong, says):
    """Found by review: such a table failed with a bare KeyError or torch's "shape is invalid", naming no tensor."""
    import dataclasses

    packed = pack_bucket(3, [("layer.0.w", torch.ones(4)), ("layer.1.w", torch.ones(8))])
    entries = list(packed.tensors)
    entries[1] = dataclasses.replace(entries[1], **wrong)
    with pytest.raises(InvalidTensorError, match=re.escape(f"bucket 3: {says}")):
        WireBucket(3, tuple(entries), packed.buffer).unpack_rows()
