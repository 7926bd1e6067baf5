"""The provenance record's schema is frozen: RL jobs log and diff these records."""

import dataclasses
import json

from refit.provenance import ScaleRecord, ScaleSource, format_table, to_json


def test_sources_are_frozen():
    assert [s.value for s in ScaleSource] == ["dummy", "checkpoint", "placeholder", "default", "refit", "calibrated"]


def test_record_fields_are_frozen():
    assert [f.name for f in dataclasses.fields(ScaleRecord)] == ["module", "scale", "kind", "source", "version", "value"]


def test_json_and_table_forms():
    records = [
        ScaleRecord("model.layers.0.self_attn.attn", "k_scale", "attention", ScaleSource.CHECKPOINT, None, 0.0104),
        ScaleRecord("model.layers.0.mlp.down_proj", "weight_scale", "weight", ScaleSource.REFIT, 3, 0.0003),
    ]
    assert json.loads(to_json(records)) == [
        {"module": "model.layers.0.self_attn.attn", "scale": "k_scale", "kind": "attention",
         "source": "checkpoint", "version": None, "value": 0.0104},
        {"module": "model.layers.0.mlp.down_proj", "scale": "weight_scale", "kind": "weight",
         "source": "refit", "version": 3, "value": 0.0003},
    ]
    lines = format_table(records).splitlines()
    assert lines[0].split() == ["module", "scale", "source", "version", "value"]
    assert lines[2].split() == ["model.layers.0.self_attn.attn", "k_scale", "checkpoint", "-", "0.0104"]
    assert lines[3].split() == ["model.layers.0.mlp.down_proj", "weight_scale", "refit", "3", "0.0003"]
