"""`refit plan`: what a sync would send, from two checkpoints, nothing started."""

import json
import shutil

from fixtures import model_dir
from refit.cli import main


def test_plan_lists_every_tensor_with_its_form(capsys):
    assert main(["plan", str(model_dir(True, "bf16")), str(model_dir(True, "fp8_block")), "--bucket-mib", "0.5"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines()[1:] if line[:6].strip().isdigit()]
    assert len(rows) == 25
    assert sum(row[-2] == "fp8_block" for row in rows) == 14
    head = next(row for row in rows if row[1] == "lm_head.weight")
    assert head[2] == "model.embed_tokens.weight" and head[-2] == "bfloat16"
    assert "25 tensors in 4 buckets" in out


def test_plan_refuses_an_unsupported_rollout_scheme(tmp_path, capsys):
    rollout = tmp_path / "rollout"
    shutil.copytree(model_dir(True, "fp8_block"), rollout)
    config = json.loads((rollout / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "channel"
    (rollout / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(model_dir(True, "bf16")), str(rollout)]) == 1
    assert "weights.strategy='channel', FP8_BLOCK needs 'block'" in capsys.readouterr().err
