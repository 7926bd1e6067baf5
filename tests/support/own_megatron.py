"""A Megatron job's own rank actor, as a user's would be, made a weight source with refit's one call.

The job builds and loads its model its own way (here: as `actors.MegatronRank`
does, standing in for the job's code); what refit asks of it is the
decorator and the `TrainerWeights` line. docs/sharded.md quotes this file.
"""

from __future__ import annotations

import json
from pathlib import Path

import ray
import torch

import refit
from refit.sharding.megatron import CheckpointNames, load_hf_checkpoint, megatron_source


@ray.remote
@refit.delegate_to_weights  # weight_metadata, stream_buckets, ... as calls on self.weights
class OwnMegatronRank:
    def __init__(self, rank: int, world_size: int, address: str, port: int, model_dir: str, tp: int, cp: int = 1) -> None:
        from megatron.core import parallel_state

        from actors.megatron_group import MegatronParallel, _gpt_model
        from refit.provenance.tracker import checkpoint_tensor_names

        torch.distributed.init_process_group("gloo", init_method=f"tcp://{address}:{port}", rank=rank,
                                             world_size=world_size)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        config = json.loads((Path(model_dir) / "config.json").read_text())
        self.model = _gpt_model(config, checkpoint_tensor_names(model_dir), MegatronParallel(tp=tp))  # built its own way
        self.source = megatron_source(self.model, vocab_size=config["vocab_size"],
                                      names=CheckpointNames.for_model_type(config["model_type"]))
        load_hf_checkpoint(self.source.layout, model_dir)
        self.weights = refit.TrainerWeights(self.source.metadata, self.source.stream)
