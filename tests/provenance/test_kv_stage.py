"""The post-refit stage's recompute on attention layers as vLLM's look to it (pure logic on a plain module with the
scale attributes vLLM's `Attention` has; the engine itself: tests/provenance/test_kv_scales_e2e.py)."""

from __future__ import annotations

import pytest
import torch

from refit.errors import EngineError
from refit.provenance import KvScalePolicy, ScaleSource
from refit.provenance.kv_stage import (
    AttentionAmaxRecorder,
    apply_kv_scale_policy,
    live_attention_scales,
    restore_attention_scales,
)
from refit.provenance.tracker import ScaleProvenanceTracker
from refit.quantizer.fp8_block import FP8_E4M3_MAX


class Attention(torch.nn.Module):
    """The parts of vLLM's `Attention` the stage reads and writes: live scales, their host copies, the cache dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.kv_cache_dtype = "fp8_e4m3"
        for scale in ("q_scale", "k_scale", "v_scale"):
            self.register_buffer(f"_{scale}", torch.tensor(-0.000942))  # a dummy load's value
            setattr(self, f"_{scale}_float", -0.000942)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output_shape=None) -> torch.Tensor:
        return query


def model() -> torch.nn.Module:
    root = torch.nn.Module()
    root.attn = Attention()
    return root


def test_q_k_and_v_are_measured_however_the_call_passes_them():
    """Found by review: a call passing `value` by keyword (q and k by position) left v unmeasured, silently."""
    net = model()
    recorder = AttentionAmaxRecorder(net)
    recorder.start()
    net.attn(torch.full((2, 4), 1.0), torch.full((2, 4), -2.0), value=torch.full((2, 4), 3.0))
    net.attn(query=torch.full((2, 4), 0.5), key=torch.full((2, 4), 4.0), value=torch.full((2, 4), 0.25))
    assert recorder.stop() == {("attn", "q_scale"): 1.0, ("attn", "k_scale"): 4.0, ("attn", "v_scale"): 3.0}


def test_an_amax_of_zero_writes_no_scale_made_of_it():
    """Found by review: K or V all zero on the calibration prompts gave a subnormal scale, recorded as calibrated;
    the first nonzero value served would then saturate the FP8 cache. It measured nothing: placeholders become 1.0."""
    net = model()
    tracker = ScaleProvenanceTracker(net)
    tracker.record_initial_load("dummy", frozenset(), {})
    measured = {("attn", "q_scale"): 0.0, ("attn", "k_scale"): 2.0, ("attn", "v_scale"): 0.0}
    apply_kv_scale_policy(net, tracker, KvScalePolicy.RECOMPUTE, version=1, measured_amax=measured)
    assert net.attn._k_scale_float == 2.0 / FP8_E4M3_MAX and tracker.source("attn", "k_scale") is ScaleSource.CALIBRATED
    assert net.attn._v_scale_float == 1.0 and tracker.source("attn", "v_scale") is ScaleSource.DEFAULT


def test_a_per_head_scale_with_one_bad_head_is_refused_by_name():
    """Found by review: only a scale's first element was checked, so a per-head scale whose later head held 0 or
    NaN passed and reached the kernel."""
    net = model()
    tracker = ScaleProvenanceTracker(net)
    tracker.record_initial_load("dummy", frozenset(), {})
    apply_kv_scale_policy(net, tracker, KvScalePolicy.AUTO, version=1)  # every scale valid: 1.0
    net.attn._v_scale = torch.tensor([0.5, 0.0, 0.25])
    with pytest.raises(EngineError, match=r"attn\.v_scale=0 "):
        apply_kv_scale_policy(net, tracker, KvScalePolicy.KEEP, version=2)


def test_a_reload_that_reset_scales_it_was_not_sent_gets_them_back():
    """vLLM's reload makes all of a layer's attention scales anew once one arrives: those not sent are put back."""
    net = model()
    for scale, value in (("q_scale", 0.01), ("k_scale", 0.02), ("v_scale", 0.03)):
        getattr(net.attn, f"_{scale}").fill_(value)
        setattr(net.attn, f"_{scale}_float", value)
    tracker = ScaleProvenanceTracker(net)
    before = live_attention_scales(net, tracker)
    for scale in ("q_scale", "k_scale", "v_scale"):  # what the reload leaves: placeholders, then the sent k
        getattr(net.attn, f"_{scale}").fill_(1.0)
        setattr(net.attn, f"_{scale}_float", 1.0)
    net.attn._k_scale.fill_(0.5)
    assert restore_attention_scales(net, before, {"attn.k_scale"}) == ["attn.q_scale", "attn.v_scale"]
    assert [float(getattr(net.attn, f"_{s}")) for s in ("q_scale", "k_scale", "v_scale")] == pytest.approx([0.01, 0.5, 0.03])
    assert net.attn._q_scale_float == pytest.approx(0.01) and net.attn._v_scale_float == pytest.approx(0.03)


def test_a_layer_sharing_another_layers_kv_cache_takes_its_k_and_v_amax():
    """Found by review: a layer that reads another layer's KV cache (vLLM's Gemma 3n calls it with k and v None) was
    never measured, so every recompute failed naming eager mode; it dequantizes the target's cache with its own
    scales, so they must be the target's."""
    net = model()
    net.shared = Attention()
    net.shared.kv_sharing_target_layer_name = "attn"
    recorder = AttentionAmaxRecorder(net)
    recorder.start()
    net.attn(torch.full((2, 4), 1.0), torch.full((2, 4), 2.0), torch.full((2, 4), 3.0))
    net.shared(torch.full((2, 4), 0.5), None, None)
    measured = recorder.stop()
    assert {scale: measured[("shared", scale)] for scale in ("q_scale", "k_scale", "v_scale")} == {
        "q_scale": 0.5, "k_scale": 2.0, "v_scale": 3.0}


@pytest.mark.parametrize("dummy", [0.000751, 1.0], ids=["positive", "one"])
def test_keep_refuses_a_dummy_loaded_scale_whatever_its_value(dummy):
    """vLLM's dummy loader draws each scale from a seeded uniform(-1e-3, 1e-3): -0.000942 on this CPU, but the draw
    depends on the device's generator and the parameter's dtype, and may be positive. Under `keep` a positive draw
    passed the validity check and was served: the seed bug. A dummy value is never a real one, whatever its sign."""
    net = model()
    for scale in ("q_scale", "k_scale", "v_scale"):
        getattr(net.attn, f"_{scale}").fill_(dummy)
        setattr(net.attn, f"_{scale}_float", dummy)
    tracker = ScaleProvenanceTracker(net)
    tracker.record_initial_load("dummy", frozenset(), {})
    with pytest.raises(EngineError, match=rf"3 attention scale\(s\).*attn\.q_scale={dummy:.4g} \(dummy\)"):
        apply_kv_scale_policy(net, tracker, KvScalePolicy.KEEP, version=1)
    assert apply_kv_scale_policy(net, tracker, KvScalePolicy.AUTO, version=2) == ["attn.q_scale", "attn.k_scale", "attn.v_scale"]
