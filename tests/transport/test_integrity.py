"""Keyed integrity tags and the receiver's plan checks, pure logic: what a replica refuses before loading a byte."""

from __future__ import annotations

import pytest
import torch

from refit.errors import InvalidTensorError, PlanMismatchError, VerificationError
from refit.plan import QuantizeOn, loadable_tensors
from refit.plan.transfer_plan import PlannedTensor, TransferPlan
from refit.quantizer.fp8_block import loadable_form
from refit.transport import integrity
from refit.transport.buckets import WireBucket, pack_bucket
from refit.transport.integrity import new_sync_key, tag, tag_matches

NAME = "model.layers.0.mlp.down_proj.weight"
KEY = new_sync_key()
PLAN = TransferPlan(((PlannedTensor(NAME, NAME, (256, 384), "bfloat16", (128, 128)),),), QuantizeOn.TRAINER, KEY)
WEIGHT = torch.randn(256, 384, dtype=torch.bfloat16)


def bucket(key: bytes | None = KEY, tensors=None) -> WireBucket:
    return pack_bucket(0, tensors or loadable_form(NAME, WEIGHT, (128, 128)), key=key)


def test_a_tag_binds_the_bytes_to_their_entry_and_the_key():
    data = torch.arange(1000, dtype=torch.int32)
    good = tag(KEY, "w|int32|[1000]|0", data)
    assert tag_matches(KEY, "w|int32|[1000]|0", data, good)
    assert not tag_matches(new_sync_key(), "w|int32|[1000]|0", data, good)  # another sync's key
    assert not tag_matches(KEY, "v|int32|[1000]|0", data, good)  # the same bytes as another entry
    altered = data.clone()
    altered[999] += 1
    assert not tag_matches(KEY, "w|int32|[1000]|0", altered, good)
    assert not tag_matches(KEY, "w|int32|[1000]|0", data, "crc:" + good[3:])  # an unknown algorithm


def test_hmac_tags_verify_where_cryptography_is_missing_and_a_gmac_tag_names_the_package(monkeypatch):
    data = torch.randn(300, 300)
    gmac_tag = tag(KEY, "x", data)
    assert gmac_tag.startswith("gm:") and len(gmac_tag) == 3 + 32  # GCM's full 16-byte tag
    monkeypatch.setattr(integrity, "AESGCM", None)
    hmac_tag = tag(KEY, "x", data)
    assert hmac_tag.startswith("hs:") and tag_matches(KEY, "x", data, hmac_tag)
    assert not tag_matches(KEY, "y", data, hmac_tag)
    with pytest.raises(ModuleNotFoundError, match="install the `cryptography` package"):
        tag_matches(KEY, "x", data, gmac_tag)


def test_a_tagged_bucket_loads_and_the_plan_never_shows_its_key():
    loaded = dict(loadable_tensors(PLAN, bucket()))
    assert torch.equal(loaded[NAME].view(torch.uint8), loadable_form(NAME, WEIGHT, (128, 128))[0][1].view(torch.uint8))
    assert KEY.hex() not in repr(PLAN) and PLAN.integrity_key == KEY


def test_altered_or_untagged_entries_are_refused_by_name():
    packed = bucket()
    altered = WireBucket(0, packed.tensors, packed.buffer.copy())
    altered.buffer[packed.tensors[1].offset] ^= 1  # the scale's first byte
    with pytest.raises(VerificationError, match=rf"altered .* in: {NAME}_scale; nothing of it was loaded"):
        loadable_tensors(PLAN, altered)
    with pytest.raises(VerificationError, match=rf"carry no integrity tag: {NAME}, {NAME}_scale"):
        loadable_tensors(PLAN, bucket(key=None))
    with pytest.raises(VerificationError, match="arrived altered"):
        loadable_tensors(PLAN.for_sync(new_sync_key()), packed)  # tagged in another sync
    with pytest.raises(VerificationError, match="plan carries no integrity key"):
        loadable_tensors(PLAN.for_sync(None), packed)
    assert loadable_tensors(PLAN.for_sync(None), bucket(key=None), verify=False)  # verify="off": nothing to check


@pytest.mark.parametrize(("value", "shown"), [(0.0, "min 0"), (-1.0, "min -1"), (float("nan"), "min nan"), (float("inf"), "")])
def test_a_weight_scale_that_is_not_finite_and_positive_is_refused_with_a_valid_tag(value, shown):
    q, scale = loadable_form(NAME, WEIGHT, (128, 128))
    scale = scale[1].clone()
    scale[1, 2] = value
    with pytest.raises(InvalidTensorError, match=rf"{NAME}_scale: FP8 weight scale holds zero, negative or non-finite values.*{shown}"):
        loadable_tensors(PLAN, bucket(tensors=[q, (f"{NAME}_scale", scale)]), verify=False)


def test_a_bucket_of_many_scales_names_exactly_those_that_are_not_finite_and_positive():
    """The bucket's scales are checked in one pass (bf16 and fp32 ones together); the refusal still names each bad
    one, and only those: one bad element in an otherwise good scale is enough."""
    names = [f"model.layers.0.mlp.experts.{e}.down_proj.weight" for e in range(6)]
    dtypes = ["bfloat16", "float32"] * 3
    plan = TransferPlan((tuple(PlannedTensor(n, n, (256, 384), d, (128, 128)) for n, d in zip(names, dtypes)),),
                        QuantizeOn.TRAINER, KEY)
    tensors = [pair for n, d in zip(names, dtypes)
               for pair in loadable_form(n, torch.randn(256, 384, dtype=getattr(torch, d)), (128, 128))]
    assert len(loadable_tensors(plan, pack_bucket(0, tensors, key=KEY))) == 12
    bad = {f"{names[1]}_scale": 0.0, f"{names[2]}_scale": -1.0, f"{names[4]}_scale": float("nan"),
           f"{names[5]}_scale": float("inf")}

    def spoiled(name: str, scale: torch.Tensor) -> torch.Tensor:
        scale = scale.clone()
        scale[1, 2] = bad[name]
        return scale

    tensors = [(n, spoiled(n, t) if n in bad else t) for n, t in tensors]
    with pytest.raises(InvalidTensorError) as refused:
        loadable_tensors(plan, pack_bucket(0, tensors, key=KEY), verify=False)
    named = [line.split(":")[0].strip() for line in str(refused.value).splitlines()[1:]]
    assert named == list(bad)


def test_unplanned_names_wrong_dtypes_and_shapes_are_refused_before_any_base_sees_them():
    q, scale = loadable_form(NAME, WEIGHT, (128, 128))
    cases = [
        ([q, scale, ("model.layers.0.mlp.injected.weight", torch.ones(2))],
         r"model\.layers\.0\.mlp\.injected\.weight: not in the plan's bucket 0"),
        ([q, (scale[0], scale[1].half())], rf"{NAME}_scale: float16 arrived, the plan has bfloat16"),
        ([(NAME, WEIGHT), scale], rf"{NAME}: bfloat16 arrived, the plan has float8_e4m3fn"),
        ([(NAME, q[1][:128]), scale], rf"{NAME}: \(128, 384\) arrived, the plan has \(256, 384\)"),
    ]
    for tensors, match in cases:
        with pytest.raises(InvalidTensorError, match=match):
            loadable_tensors(PLAN, bucket(tensors=tensors))


def test_a_bucket_index_outside_the_plan_is_refused():
    packed = bucket()
    with pytest.raises(PlanMismatchError, match=r"bucket 3 arrived; the plan has buckets 0\.\.0"):
        loadable_tensors(PLAN, WireBucket(3, packed.tensors, packed.buffer))
