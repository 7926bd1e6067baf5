"""Whether replicas serve a trainer's current weights: greedy tokens against the trainer's own, on the same prompts."""

from __future__ import annotations

import ray

from fixtures import NEW_TOKENS, PROMPT_LEN, make_prompts
from refit import Phase

__all__ = ["PROMPTS", "SAME_MODEL", "agreement", "assert_serves", "status", "tokens"]

PROMPTS = make_prompts(64, PROMPT_LEN, seed=41)

# The trainers are random models with flat distributions, so FP8 weights flip
# a few near-tied greedy tokens, while two trainers of different seeds still
# agree on some (random models often repeat a prompt's last token). 0.8 and 0.55
# sit between the two with room on each side (docs/performance.md, "Other measurements").
SAME_MODEL = 0.8


def status(replica):
    return ray.get(replica.status.remote(), timeout=120)  # never blocks once the engine has started


def tokens(replica, prompts=PROMPTS):
    return ray.get(replica.generate.remote(prompts, NEW_TOKENS), timeout=60).token_ids


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of prompts whose first greedy token two runs share (later tokens cascade from a flip)."""
    return sum(x[0] == y[0] for x, y in zip(a, b)) / len(a)


def assert_serves(replicas, trainer, version=None):
    """Every replica serves (`version`, if given) the trainer's current weights, all of them bit-identical ones."""
    expected = ray.get(trainer.generate.remote(PROMPTS, NEW_TOKENS), timeout=120)
    served = [tokens(replica) for replica in replicas]
    for replica, got in zip(replicas, served):
        state = status(replica)
        assert state.phase is Phase.SERVING, state
        assert version is None or state.served_version == version, (state, version)
        assert agreement(got, expected) >= SAME_MODEL
    assert all(got == served[0] for got in served)  # the replicas serve bit-identical weights
