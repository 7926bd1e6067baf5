"""The quickstart against an existing multi-node Ray cluster, with actors placed by node.

Start a two-node cluster by hand (on one machine, for a try; on two, give
the head's address to the second):

    ray start --head --port=6379 --num-cpus=2
    ray start --address=127.0.0.1:6379 --num-cpus=2
    python examples/multinode.py --address 127.0.0.1:6379
    ray stop    # on every node, when done

The trainer goes to the node this driver runs on (or `--trainer-node`), one
rollout to each other node (round robin if you ask for more rollouts than
there are nodes). Placement uses Ray's NodeAffinitySchedulingStrategy; to
place by resources instead, start nodes with `--resources='{"rollout": 1}'`
and create actors with `.options(resources={"rollout": 1})`.
"""

import argparse
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import refit
from actors import RolloutActor, TrainerActor

MODELS = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "qwen3-tiny-tied"


def on(node_id: str) -> dict:
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id, soft=False), "num_cpus": 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="an existing cluster, e.g. 127.0.0.1:6379")
    parser.add_argument("--trainer-ckpt", default=str(MODELS / "bf16"))
    parser.add_argument("--rollout-ckpt", default=str(MODELS / "fp8_block"))
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--trainer-node", help="node id for the trainer (default: the driver's node)")
    args = parser.parse_args()

    ray.init(address=args.address)
    trainer_node = args.trainer_node or ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != trainer_node] or [trainer_node]
    rollout_nodes = [others[i % len(others)] for i in range(args.rollouts)]

    trainer = TrainerActor.options(**on(trainer_node)).remote(args.trainer_ckpt)
    engine = refit.EngineConfig(model=args.rollout_ckpt, load_format="dummy", kv_cache_dtype="fp8_e4m3")
    rollouts = [RolloutActor.options(**on(node)).remote(engine) for node in rollout_nodes]

    counting = [[(start + 2 * i) % 512 for i in range(16)] for start in range(0, 512, 64)]
    ray.get(trainer.train_step.remote(counting), timeout=600)
    report = refit.Syncer(trainer, rollouts).sync()
    print(report.summary())
    prompts = [[100, 102, 104, 106, 108, 110, 112, 114]]
    print("trainer:", ray.get(trainer.generate.remote(prompts, 8), timeout=600)[0])
    for replica in report.replicas:  # those that serve it: a replica the sync dropped is missing, so not zipped
        served = ray.get(rollouts[replica.replica].generate.remote(prompts, 8), timeout=600)  # ids: the list's order
        print(f"rollout {replica.replica} on node {replica.node_id}:", served.token_ids[0])


if __name__ == "__main__":
    main()
