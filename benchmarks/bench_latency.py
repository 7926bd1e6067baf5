"""A small model's sync is fixed cost: how long the 1.6 MiB fixture takes to reach two replicas, and where it goes.

The tiny Qwen3 fixture (bf16 trainer on node 0; its FP8_BLOCK checkpoint
dummy-loaded, FP8 KV cache, in two rollouts on nodes 1 and 2), synced with
the default `SyncConfig` `--syncs` times, the trainer taking a small AdamW
step before each (untimed). The three Ray nodes are one host, so the
default maps shared memory (`shm`) and sends whole buckets; over `ray`
(`--transport ray`, as between hosts) each sync after the first is a delta
of a real update. At this size the bytes are nothing; what is left is the
remote rounds between driver, trainer and replicas, Ray's streaming
generator, and vLLM's layerwise reload. Prints the medians of the total and
of each stage (issue 49's target: at most 25 ms).

Then what a large model's plan costs a sync, per member it crosses to: the
plan of an MoE of 48 layers of 128 experts (18.8k tensors, from metadata
alone: no model is made), pickled and unpickled as Ray does with a call's
arguments, the first time (the text made, then decoded) and each time after
(`TransferPlan.to_plain`). Run with
`.venv/bin/python -m benchmarks.bench_latency`.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import ray

import refit
from actors import RolloutActor, TrainerActor
from benchmarks import _docs_table
from benchmarks.bench_alternatives import cluster
from fixtures import make_sequences, model_dir
from refit.plan import RolloutModelInfo, TensorMeta, make_plan
from refit.plan.transfer_plan import TransferPlan
from refit.transport.integrity import new_sync_key

TARGET_S = 0.025


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--syncs", type=int, default=20)
    parser.add_argument("--transport", default="auto", help="SyncConfig.transport (default: auto, the default config)")
    _docs_table.add_write_docs_argument(parser, "bench_latency")
    args = parser.parse_args(argv)
    engine = refit.EngineConfig(model=str(model_dir(False, "fp8_block")), load_format="dummy", kv_cache_dtype="fp8_e4m3",
                                max_model_len=128, kv_cache_bytes=64 << 20)
    with cluster(nodes=3):
        trainer = TrainerActor.options(num_cpus=0, resources={"node0": 0.01}).remote(str(model_dir(False, "bf16")),
                                                                                      lr=1e-5)
        rollouts = [RolloutActor.options(num_cpus=0, resources={f"node{n}": 0.01}).remote(engine) for n in (1, 2)]
        try:
            syncer = refit.Syncer(trainer, rollouts, refit.SyncConfig(transport=args.transport))
            syncer.sync()  # warm-up: plan, first-touch allocations, the first delta bases
            reports = []
            for step in range(args.syncs):
                ray.get(trainer.train_step.remote(make_sequences(8, 16, seed=step).tolist()), timeout=600)
                reports.append(syncer.sync())
        finally:
            for actor in (trainer, *rollouts):
                ray.kill(actor)
    printed = table(reports) + "\n" + plan_crossing()
    print(printed)
    if args.write_docs:
        _docs_table.write_block("bench_latency", printed, argv=argv)


def table(reports: list[refit.SyncReport]) -> str:
    def median_ms(values) -> str:
        return f"{statistics.median(values) * 1e3:7.1f} ms"

    def rest(r: refit.SyncReport) -> float:
        return r.total_seconds - r.begin_seconds - r.stream_seconds - r.finish_seconds

    modes = sorted({r.mode for report in reports for r in report.replicas})
    lines = [f"tiny Qwen3 fixture, {reports[0].bytes_on_wire / 2**20:.2f} MiB full, to 2 replicas, {len(reports)} syncs "
             f"({reports[0].transport}, {'/'.join(modes)}); medians:",
             f"  total                {median_ms([r.total_seconds for r in reports])}   (target {TARGET_S * 1e3:.0f} ms)",
             f"  begin                {median_ms([r.begin_seconds for r in reports])}",
             f"  stream               {median_ms([r.stream_seconds for r in reports])}",
             f"  finish               {median_ms([r.finish_seconds for r in reports])}",
             f"  report and the rest  {median_ms([rest(r) for r in reports])}",
             f"  bytes received       {statistics.median(max(x.bytes_received for x in r.replicas) for r in reports) / 2**10:7.1f} KiB"]
    return "\n".join(lines)


def moe_plan(bucket_bytes: int, layers: int = 48, experts: int = 128, hidden: int = 2048, expert_hidden: int = 768) -> TransferPlan:
    """The plan of a Qwen3-MoE-shaped model (FP8_BLOCK rollout, untied), from metadata alone."""
    linear, norm = ("Linear", "Module"), ("RMSNorm", "Module")
    metas = [TensorMeta("model.embed_tokens.weight", (151936, hidden), "bfloat16", ("Embedding", "Module"))]
    for layer in range(layers):
        prefix = f"model.layers.{layer}."
        metas += [TensorMeta(prefix + name, shape, "bfloat16", classes) for name, shape, classes in (
            ("self_attn.q_proj.weight", (4096, hidden), linear), ("self_attn.k_proj.weight", (512, hidden), linear),
            ("self_attn.v_proj.weight", (512, hidden), linear), ("self_attn.o_proj.weight", (hidden, 4096), linear),
            ("input_layernorm.weight", (hidden,), norm), ("post_attention_layernorm.weight", (hidden,), norm),
            ("mlp.gate.weight", (experts, hidden), linear))]
        metas += [TensorMeta(f"{prefix}mlp.experts.{e}.{name}.weight", shape, "bfloat16", linear)
                  for e in range(experts) for name, shape in (("gate_proj", (expert_hidden, hidden)),
                                                              ("up_proj", (expert_hidden, hidden)),
                                                              ("down_proj", (hidden, expert_hidden)))]
    metas += [TensorMeta("model.norm.weight", (hidden,), "bfloat16", norm),
              TensorMeta("lm_head.weight", (151936, hidden), "bfloat16", linear)]
    quantization = json.loads((model_dir(False, "fp8_block") / "config.json").read_text())["quantization_config"]
    return make_plan(metas, RolloutModelInfo(quantization, False), refit.SyncConfig(bucket_bytes=bucket_bytes))


def plan_crossing(repeats: int = 5) -> str:
    """Seconds to pickle and unpickle one sync's plan of `moe_plan`: the first time in a process, and after."""
    def crossing(plan: TransferPlan) -> float:
        start = time.perf_counter()
        pickle.loads(pickle.dumps(plan))
        return time.perf_counter() - start

    firsts, laters = [], []
    for attempt in range(repeats):
        plan = moe_plan((64 << 20) + attempt)  # a plan of its own each time: its text is made, then decoded, anew
        firsts.append(crossing(plan.for_sync(new_sync_key())))
        laters.append(statistics.median(crossing(plan.for_sync(new_sync_key())) for _ in range(repeats)))
    size = len(pickle.dumps(plan.for_sync(new_sync_key())))
    return (f"the plan of a 48-layer, 128-expert MoE ({len(plan.tensors)} tensors, {size / 2**20:.1f} MiB pickled), "
            f"pickled and unpickled once per member of each sync; medians of {repeats}:\n"
            f"  first sync           {statistics.median(firsts) * 1e3:7.1f} ms\n"
            f"  each sync after      {statistics.median(laters) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
