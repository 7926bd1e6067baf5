"""Plain-Python stand-ins for a trainer and rollout replicas, for the fast tier.

The fake replica keeps the real `UpdateLifecycle` and loads into a dict, so
tests of `Syncer` exercise its own flow without Ray or vLLM.
"""

from __future__ import annotations

import torch

from refit import EngineError, SyncConfig
from refit.engine.lifecycle import FinishedUpdate, UpdateLifecycle
from refit.plan import RolloutModelInfo, checkpoint_tensors, describe_weights, loadable_tensors, produce_buckets
from refit.transport.object_store import fetch_parts

FP8_BLOCK = {
    "quant_method": "compressed-tensors",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "block", "symmetric": True, "dynamic": False, "block_structure": [128, 128],
    }}},
    "ignore": ["lm_head"],
}


def tiny_decoder(layers: int = 3, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.embed_tokens = torch.nn.Embedding(64, 256)
    root.model.layers = torch.nn.ModuleList()
    for _ in range(layers):
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.down_proj = torch.nn.Linear(256, 256, bias=False)
        root.model.layers.append(block)
    root.model.norm = torch.nn.RMSNorm(256)
    root.lm_head = torch.nn.Linear(256, 64, bias=False)
    return root.to(torch.bfloat16)


class FakeTrainer:
    def __init__(self, model: torch.nn.Module, fail_at_bucket: int | None = None) -> None:
        self.model = model
        self.fail_at_bucket = fail_at_bucket
        self.streams_closed = 0

    def weight_metadata(self):
        return describe_weights(self.model)

    def stream_buckets(self, plan):
        try:
            for index, bucket in enumerate(produce_buckets(plan, checkpoint_tensors(self.model))):
                if index == self.fail_at_bucket:
                    raise RuntimeError(f"trainer fault at bucket {index}")
                yield bucket
        finally:
            self.streams_closed += 1


class FakeReplica:
    """A replica whose engine is a dict; `fail` maps a step to the exception it raises there.

    `at_bucket=n` fails its n-th bucket, with `bucket_error` if given (an `ActorDiedError` naming
    the replica stands for its death) or a loader fault.
    """

    def __init__(self, expected: set[str], **fail: BaseException) -> None:
        self.lifecycle = UpdateLifecycle()
        self.expected = expected
        self.weights: dict[str, torch.Tensor] = {}
        self.fail = fail
        self._pending: dict[str, torch.Tensor] = {}
        self._plan = None
        self.buckets_seen = 0
        self.begins = 0

    def describe(self):
        return RolloutModelInfo(FP8_BLOCK, False)

    def status(self):
        return self.lifecycle.status()

    def node_id(self):
        return "fake-node"

    def begin_update(self, plan, sync_id, config):
        self.begins += 1
        self._raise("begin")
        version = self.lifecycle.begin(sync_id, lease_s=config.update_lease_s, drain_timeout_s=config.timeout_s)
        self._plan, self._pending = plan, {}
        return version

    def load_bucket(self, sync_id, version, bucket):
        self.lifecycle.loading(sync_id, version)
        self.buckets_seen += 1
        if self.buckets_seen == self.fail.get("at_bucket"):
            raise self.fail.get("bucket_error") or EngineError(f"loader fault at bucket {bucket.index}")
        # Through Ray (the fake as an actor) a bucket comes as its parts' object refs, which a replica fetches itself.
        self._pending.update(loadable_tensors(self._plan, fetch_parts(bucket, timeout_s=60)))
        return 0.0

    def finish_update(self, sync_id, version):
        self.lifecycle.renew(sync_id, "finish_update")
        missing = self.expected - set(self._pending)
        if missing:
            raise EngineError(f"the update left weights unloaded: {sorted(missing)}")
        self._raise("finish")
        self.weights.update(self._pending)
        self.lifecycle.finished(sync_id, version)
        return FinishedUpdate(0.0)

    def abort_update(self, sync_id, reason):
        return self.lifecycle.failed(sync_id, reason)

    def _raise(self, step: str) -> None:
        if isinstance(self.fail.get(step), BaseException):
            raise self.fail[step]


def expected_names(model) -> set[str]:
    names = {n for n, _ in model.named_parameters()}
    return names | {n + "_scale" for n in names if n.endswith("down_proj.weight")}


CONFIG = SyncConfig(bucket_bytes=100_000, timeout_s=5)


def setup(replicas: int = 2, **fail):
    model = tiny_decoder()
    return FakeTrainer(model), [FakeReplica(expected_names(model), **(fail if i == 0 else {})) for i in range(replicas)]


class SlowToRestartReplica(FakeReplica):
    """A fake replica whose restart by Ray (`max_restarts`) takes `restart_s`, as an engine's does: Ray keeps idle
    workers ready, so a plain object's restart could finish before the next call reached it."""

    def __init__(self, expected: set[str], restart_s: float = 3.0) -> None:
        import time

        import ray

        if ray.get_runtime_context().was_current_actor_reconstructed:
            time.sleep(restart_s)
        super().__init__(expected)


class LoraEngine:
    """An engine adapter for `refit.ReplicaCore` that serves LoRA adapters into a dict, for adapter syncs in the fast
    tier; `interrupt_at_stage`: its next install raises `KeyboardInterrupt` (the driver's, as it arrives mid-stage)."""

    def __init__(self) -> None:
        from refit.engine.facts import EngineFacts

        self.facts = EngineFacts(RolloutModelInfo(FP8_BLOCK, False), vocab_size=64, workers=1, fp8_kv_cache=False,
                                 initial_refusal=None)
        self.lora_rank = 8
        self.worker_calls_beside_requests = True
        self.loaded: dict[int, str] = {}  # lora id -> the digest of the adapter installed under it
        self.interrupt_at_stage = False

    def call_workers(self, method: str, *args):
        from refit.adapters import AdapterWeights

        if method == "refit_add_adapter":
            if self.interrupt_at_stage:
                self.interrupt_at_stage = False
                raise KeyboardInterrupt
            self.loaded[args[0]] = AdapterWeights.from_plain(args[1]).digest()
            return [self.loaded[args[0]]]
        if method == "refit_remove_adapter":
            self.loaded.pop(args[0], None)
        return [None]

    def transport_refusal(self, kind):
        return None

    def check(self, config) -> None:
        pass

    def gone(self) -> None:
        return None


class LoraTrainer(FakeTrainer):
    """A `FakeTrainer` that also trains a rank-8 adapter on `down_proj` (what `Syncer.sync_adapter` sends)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.step = 0  # the adapter's values change with each `train_adapter`

    def train_adapter(self) -> None:
        self.step += 1

    def adapter_weights(self):
        from refit.adapters import AdapterWeights

        torch.manual_seed(self.step)
        module = "base_model.model.model.layers.0.mlp.down_proj"
        tensors = {f"{module}.lora_A.weight": torch.randn(8, 256), f"{module}.lora_B.weight": torch.randn(256, 8)}
        return AdapterWeights("policy", {"r": 8, "lora_alpha": 16, "target_modules": ["down_proj"]}, tensors)

    def adapter_meta(self):
        return self.adapter_weights().meta()


def lora_replica(engine: LoraEngine):
    """A `refit.ReplicaCore` over `engine`, as a plain object a `Syncer` takes."""
    from refit.engine.replica import ReplicaCore

    class LoraReplica(ReplicaCore):
        def node_id(self) -> str:
            return "fake-node"

    return LoraReplica(engine)


class SlowTrainer(FakeTrainer):
    """A `FakeTrainer` that takes `delay_s` to make each bucket: a stream with time between its buckets."""

    def __init__(self, model: torch.nn.Module, delay_s: float) -> None:
        super().__init__(model)
        self.delay_s = delay_s

    def stream_buckets(self, plan):
        import time

        for bucket in super().stream_buckets(plan):
            time.sleep(self.delay_s)
            yield bucket
