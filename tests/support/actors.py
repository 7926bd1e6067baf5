"""Functions tests run inside an actor with `actor.__ray_call__.remote(fn, ...)`.

Ray calls `fn(actor_instance, *args)` in the actor's process, so tests can
inspect or poke a trainer or a rollout without methods that exist only for
them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Sequence

import ray
import torch


def run_in(actor, fn, *args, timeout: float = 120):
    return ray.get(actor.__ray_call__.remote(fn, *args), timeout=timeout)


def set_parameter(trainer, name: str, value: torch.Tensor) -> None:
    """Overwrite one trainer parameter (to inject bad values)."""
    with torch.no_grad():
        dict(trainer.model.named_parameters())[name].copy_(value)


def parameter(trainer, name: str) -> torch.Tensor:
    """A copy of one trainer parameter."""
    return trainer.model.get_parameter(name).detach().clone()


@torch.no_grad()
def prompt_logprobs(trainer, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
    """log p(token_i | tokens_<i) for i >= 1, as vLLM's prompt_logprobs reports them."""
    from refit.verification.probe import prompt_logprobs as of_model

    return of_model(trainer.model, prompts)


def attention_amax(trainer, prompts: Sequence[Sequence[int]]) -> dict[str, float]:
    from tests.support.reference import attention_amax as measure

    return measure(trainer.model, prompts)


def save(trainer, directory: str) -> None:
    """Write the trainer's current weights as an HF checkpoint."""
    trainer.model.save_pretrained(directory)


def hold_update_lock(rollout, seconds: float) -> None:
    """Occupy a rollout's update lock for `seconds` (from a timer thread), or until `release_update_lock`, so its
    update calls hang."""
    lock, once = rollout.replica._lock, threading.Lock()

    def release() -> None:
        if once.acquire(blocking=False):
            lock.release()

    lock.acquire()
    threading.Timer(seconds, release).start()
    rollout.__dict__["_release_held_update_lock"] = release


def release_update_lock(rollout) -> None:
    """End `hold_update_lock`'s hold now, once the test has seen what the hold was for."""
    rollout.__dict__.pop("_release_held_update_lock")()


def node_id(_actor) -> str:
    return ray.get_runtime_context().get_node_id()


def process_id(_actor) -> int:
    return os.getpid()


def collector_state(_actor) -> tuple[bool, bool]:
    """Whether the process's garbage collector is on, and whether it froze a heap (refit/import_heap.py)."""
    import gc

    return gc.isenabled(), gc.get_freeze_count() > 0


def rss_bytes(_actor) -> int:
    """Resident memory private to the actor's process (`actors._measure.private_rss_bytes`), after glibc returned
    the free memory it keeps at the top of its heaps (`malloc_trim`).

    Why trim: across syncs glibc's heaps grow for a while even when every sync frees all it allocated (on a Xeon
    with AMX, 1-2 MiB per sync for 10-20 syncs, then flat; the code before the change that surfaced it did the
    same), so an RSS count without it confuses the allocator's retention with a leak. What a leak holds is live
    memory and stays after the trim.
    """
    import ctypes

    from actors._measure import private_rss_bytes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: measure as it is
        pass
    return private_rss_bytes()


def double_weight_scale(rollout, module: str) -> None:
    """Corrupt one FP8 block scale inside a rollout's engine (doubles its first block)."""

    def corrupt(worker) -> None:
        scale = dict(worker.model_runner.model.named_modules())[module].weight_scale
        scale.data[0, 0] *= 2

    rollout.engine.llm.collective_rpc(corrupt)


def redraw(trainer, seed: int) -> None:
    """New random weights for a trainer, drawn as `TrainerActor(reinitialize=True, seed=seed)` draws them."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    fresh = AutoModelForCausalLM.from_config(trainer.model.config).to(torch.bfloat16)
    with torch.no_grad():
        trainer.model.load_state_dict(fresh.state_dict())


def snapshot_weights(trainer, version: int) -> None:
    """Keep a copy of the trainer's current weights under `version` (for `greedy_gaps`)."""
    snapshots = trainer.__dict__.setdefault("_test_snapshots", {})
    snapshots[version] = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@torch.no_grad()
def greedy_gaps(trainer, version: int, sequences: Sequence[Sequence[int]], prompt_len: int) -> list[float]:
    """Per sequence (prompt + continuation, one length): under `version`'s weights, how far (in nats) its
    least greedy continuation token falls below that step's best token; 0 for a greedy continuation."""
    current = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    trainer.model.load_state_dict(trainer._test_snapshots[version])
    try:
        ids = torch.tensor([list(s) for s in sequences])
        logprobs = trainer.model(input_ids=ids).logits[:, prompt_len - 1 : -1].float().log_softmax(-1)
        chosen = logprobs.gather(-1, ids[:, prompt_len:, None])[..., 0]
        return (logprobs.max(-1).values - chosen).max(-1).values.tolist()
    finally:
        trainer.model.load_state_dict(current)


def hold_a_request(rollout, hold_s: float) -> None:
    """Open a request on the rollout's lifecycle gate, as `generate` does, and keep it open until
    `release_the_request` (or `hold_s`, so a failed test cannot leave it held). An update's `begin` waits for it:
    unlike a real generation, it ends when the test says, not when the machine's load says."""
    entered, release = threading.Event(), threading.Event()
    rollout._test_release = release

    def hold() -> None:
        with rollout.replica.lifecycle.request():
            entered.set()
            release.wait(hold_s)

    threading.Thread(target=hold, daemon=True).start()
    if not entered.wait(hold_s):
        raise TimeoutError("the held request did not start")


def release_the_request(rollout) -> None:
    rollout._test_release.set()


def buckets_loaded(rollout) -> int:
    """Buckets the open update has loaded so far; -1 when no update is open."""
    replica = rollout.replica
    with replica._lock:  # begin opens the update before it resets the count: never read the last update's
        return replica._progress["buckets"] if replica.lifecycle.open_update() is not None else -1


def alter_delta_base(rollout) -> int:
    """Flip the first byte of every tensor a rollout keeps as its delta base (over `ray`); returns how many.

    Every tensor, not one: which tensors the next sync sends as deltas (rebuilt from the base, so checked)
    and which travel whole (replacing the altered bytes unchecked) depends on how much each changed."""
    entries = rollout.replica._base._entries
    for _, stored in entries.values():
        stored[0] ^= 0xFF
    return len(entries)


STARTUP_S = 900
"""How long a test waits for an actor's constructor (an engine's start takes minutes on a loaded 2-core machine);
deadlines that test behaviour start after it."""


def all_started(*actors) -> None:
    """Return once every actor's constructor has finished (the first one's error if one failed); test deadlines count
    from here. The starts overlap: one wait for all."""
    ray.get([actor.__ray_ready__.remote() for actor in actors], timeout=STARTUP_S)


def started(actor):
    """`actor` once its constructor has finished (`all_started`)."""
    all_started(actor)
    return actor


def rank_stream(rank, plan):
    """`rank`'s stream of parts of `plan`, each made only once the one before it was taken, as a sync's relay asks."""
    return rank.stream_buckets.options(num_returns="streaming", _generator_backpressure_num_objects=1).remote(plan)


def streamed_together(streams, timeout_s: float = 30) -> list[str]:
    """Take each stream's parts as they come, as a sync's relay takes a bucket's parts from every rank; how each
    ended: "complete", its error, or that no stream made a part for `timeout_s` (a stream queued behind another on
    its rank starts only once that one ended)."""
    outcomes: list[str | None] = [None] * len(streams)
    last_part = time.monotonic()
    while None in outcomes:
        for i, stream in enumerate(streams):
            if outcomes[i] is not None or not ray.wait([stream], timeout=0.01)[0]:
                continue
            last_part = time.monotonic()
            try:
                ray.get(next(stream), timeout=timeout_s)
            except StopIteration:
                outcomes[i] = "complete"
            except ray.exceptions.RayTaskError as error:
                outcomes[i] = str(error.cause)
        if time.monotonic() - last_part > timeout_s:
            return [outcome or f"no part within {timeout_s} s" for outcome in outcomes]
    return outcomes


@ray.remote(num_cpus=0)
class UnreadableReplica:
    """A named actor with a replica's methods whose `status` fails, as a replica whose engine died would answer."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def status(self):
        raise RuntimeError("the engine core died")

    def last_update(self) -> None:
        return None

    def scale_records(self) -> list:
        return []


@ray.remote(num_cpus=0)
class Unresponsive:
    """An actor whose `answer` never comes back (a hung trainer or replica); `ping` answers at once."""

    def ping(self) -> bool:
        return True

    def answer(self) -> None:
        threading.Event().wait()


@ray.remote(num_cpus=0)
class SlowSource:
    """A trainer whose stream yields a bucket (its index) every `every_s` seconds: a large model's stream, to a
    second stream of the same actor; `ping` answers at once when no stream runs."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s

    def ping(self) -> bool:
        return True

    def stream_buckets(self, plan, *rest):
        for index in range(3):
            time.sleep(self.every_s)
            yield index


class KeptMessages(logging.Handler):
    """A log handler that keeps each record's message and level name."""

    def __init__(self, level: int = logging.DEBUG) -> None:
        super().__init__(level)
        self.messages: list[str] = []
        self.levels: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())
        self.levels.append(record.levelname)


def keep_vllm_warnings(rollout) -> None:
    """In the rollout's process: keep every warning that reaches vLLM's root logger, where vLLM's handler prints it."""
    rollout.kept_vllm_warnings = KeptMessages(logging.WARNING)
    logging.getLogger("vllm").addHandler(rollout.kept_vllm_warnings)


def kept_vllm_warnings(rollout, also: str) -> list[str]:
    """The warnings kept, after logging `also` as the layerwise reload logs a layer that loaded nothing; keeps no more."""
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning("%s: Failed to load weights", also)
    handler = rollout.__dict__.pop("kept_vllm_warnings")
    logging.getLogger("vllm").removeHandler(handler)
    return list(handler.messages)


def engine_state(rollout) -> dict[str, str]:
    """Run in a `RolloutActor`: a hash of every parameter of its engine's model (FP8 codes and scales included)."""
    return rollout.engine.llm.collective_rpc(lambda worker: _tensor_hashes(worker.model_runner.model))[0]


def engine_tensors(rollout) -> dict[str, str]:
    """`engine_state` with every buffer of the model hashed too."""
    return rollout.engine.llm.collective_rpc(lambda worker: _tensor_hashes(worker.model_runner.model, buffers=True))[0]


def engine_buffer(rollout, name: str) -> torch.Tensor:
    """Run in a `RolloutActor`: a copy of one buffer of its engine's model."""
    return rollout.engine.llm.collective_rpc(lambda worker: worker.model_runner.model.get_buffer(name).clone())[0]


def _tensor_hashes(model: torch.nn.Module, buffers: bool = False) -> dict[str, str]:
    tensors = [*model.named_parameters(), *(model.named_buffers() if buffers else ())]
    return {name: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest() for name, p in tensors}


def change_trainer(trainer, names: list[str], change) -> None:
    """Run in a `TrainerActor`: the change `MegatronGroup.apply` makes, on the same checkpoint tensors."""
    from refit.plan.checkpoint_format import CheckpointView

    view = CheckpointView(trainer.model)
    with torch.no_grad():
        for name in names:
            tensor = view.tensor(name)
            tensor.copy_(change(tensor))


def nudge(values: torch.Tensor) -> torch.Tensor:
    """An elementwise change every layout makes alike: about 1% of each value, in the values' own dtype."""
    return (values.float() * 1.0078125 + 2.0**-9).to(values.dtype)


def change_megatron(rank, names: list[str], change) -> int:
    """Run in any Megatron rank actor holding `source` (a `megatron_source`): `change` on its parts of `names`."""
    from refit.sharding.megatron import change_checkpoint_tensors

    return change_checkpoint_tensors(rank.source.layout, names, change)


def draft_state(rollout) -> dict[str, str]:
    """Run in a `RolloutActor`: a hash of every parameter of its engine's speculative draft model."""
    return rollout.engine.llm.collective_rpc(lambda worker: _tensor_hashes(worker.model_runner.get_draft_model()))[0]


def draft_like_policy(trainer) -> None:
    """Run in a `TrainerActor` with a draft: the draft takes the policy's current weights (same architecture)."""
    with torch.no_grad():
        trainer.draft.load_state_dict(trainer.model.state_dict())
