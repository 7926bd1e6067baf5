"""Wire buckets: every dtype survives Ray's object store, float8 included.

Ray 2.60 cannot carry float8 tensors (`ray.get` fails with "UntypedStorage has
no attribute 'dtype'", FACTS.md); a bucket travels as raw bytes instead.
"""

from __future__ import annotations

import ray
import torch

from refit.transport.buckets import pack_bucket


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

