"""vLLM warnings that every healthy refit engine logs, kept out of the user's driver; every other warning goes through.

Ray forwards an actor's stderr to the driver, so what vLLM logs inside a
rollout actor reaches the user's terminal after each sync. A handful of
vLLM's warnings are logged by every correct start or sync of an engine as
refit runs it, and read like failures ("Failed to load weights"). Each is
named below with why it is benign; each is matched on its logger and its
exact message (and arguments, where they tell a benign case from a real
one), so the same words about anything else still show. Advice a user may
act on but that reports nothing wrong (LD_PRELOAD, the in-process engine's
random seed) is kept, at INFO (`VLLM_ADVICE`). Imports no vLLM:
the filters attach to vLLM's loggers by name, before or after vLLM creates
them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["BENIGN_VLLM_WARNINGS", "VLLM_ADVICE", "BenignVllmWarnings", "layers_left_unloaded", "quiet_benign_vllm_warnings"]

Match = Callable[[logging.LogRecord], bool]


def _message(text: str, args: tuple | None = None) -> Match:
    """A record whose unformatted message is `text` (and, given `args`, whose arguments are those)."""
    return lambda record: record.msg == text and (args is None or tuple(record.args or ()) == args)


def _starts(prefix: str) -> Match:
    return lambda record: isinstance(record.msg, str) and record.msg.startswith(prefix)


_RELOAD = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED = "%s: Failed to load weights"

# logger name -> what it logs that is benign in a refit engine.
BENIGN_VLLM_WARNINGS: dict[str, tuple[Match, ...]] = {
    # Every layerwise reload (each sync): the rotary embedding's only tensor is its cos/sin cache, a buffer that
    # no checkpoint holds and that vLLM recomputes and puts back itself. Only "RotaryEmbedding" is matched: any
    # other layer that loaded nothing in a reload is a real failure, and refit's completeness check refuses it.
    _RELOAD: (
        _message(_NOT_LOADED, ("RotaryEmbedding",)),
    ),
    # The first generate: refit starts engines with `skip_tokenizer_init=True` (token ids in and out, see
    # refit/engine/config.py), so there is no tokenizer to take an EOS id from; requests stop at `max_tokens`.
    "vllm.renderers.base": (
        _message("Using None for EOS token id because tokenizer is not initialized"),
    ),
    # An engine on a CPU without triton-cpu (the Triton that torch ships has no CPU backend): vLLM's CPU kernels
    # need no Triton, and without it vLLM picks its V1 model runner, which is the one refit's CPU plugins are
    # written for. Logged on importing vLLM, on checking the engine's config, and on picking the runner.
    "vllm.triton_utils.importing": (
        _message("Triton is installed, but doesn't include CPU backend. Disabling Triton."),
    ),
    "vllm.platforms.cpu": (
        _message("Triton is not installed. triton-cpu is expected on x86 CPUs."),
        # Every CPU engine's start, whatever its model: the state-space (mamba) cache dtype is reset when no
        # accelerated GDN backend is in use ('none'); models without SSM layers have no such cache.
        _message("Reset SSM cache type to float32 for accelerated GDN mamba backend '%s'.", ("none",)),
    ),
    "vllm.config.vllm": (
        _message("Model Runner V2 requires Triton; using the V1 model runner instead."),
        # `EngineConfig.enforce_eager` (True by default: refit's CPU engines and tests run eager, and a user who wants
        # torch.compile and CUDA graphs sets it False): vLLM then says what eager mode turns off, twice, on every start.
        _starts("Enforce eager set, disabling torch.compile, CUDAGraphs, and JIT kernel warmup."),
        _starts("Inductor compilation was disabled by user settings"),
    ),
    # A CPU worker binds its threads to cores, then replaces `torch.set_num_threads` with a function that says
    # it skipped the call: torch and the libraries a sync loads call it, and the threads stay bound as vLLM set
    # them. A core whose NUMA node is no memory node (a container, a VM) falls back to the first memory node,
    # which is correct; the two lines about that say so on every start on such a host.
    "vllm.v1.worker.cpu_worker": (
        _message("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."),
        _message("Node %s is not in available memory nodes %s."),
        _starts("CPU group key %s is not a valid memory node."),
    ),
}


# logger name -> advice a user may act on, but that says nothing is wrong: kept, at INFO instead of WARNING.
VLLM_ADVICE: dict[str, tuple[Match, ...]] = {
    # A CPU engine's start without tcmalloc / Intel OpenMP preloaded: slower, not wrong (docs/cpu.md).
    "vllm.v1.worker.cpu_worker": (_starts("%s is not found in LD_PRELOAD."),),
    # An in-process engine seeds the process's global random state; in refit's rollout actors the engine owns its
    # process, and a user who embeds one in a process of their own still sees the line, at INFO.
    "vllm.engine.arg_utils": (_starts("The global random seed is set to %d."),),
}


class BenignVllmWarnings(logging.Filter):
    """Drops the records of one vLLM logger that match its `BENIGN_VLLM_WARNINGS`, turns its `VLLM_ADVICE` into INFO,
    and passes every other record as it is."""

    def __init__(self, benign: tuple[Match, ...], advice: tuple[Match, ...] = ()) -> None:
        super().__init__()
        self.matches, self.advice = benign, advice

    def filter(self, record: logging.LogRecord) -> bool:
        if any(match(record) for match in self.matches):
            return False
        if record.levelno == logging.WARNING and any(match(record) for match in self.advice):
            record.levelno, record.levelname = logging.INFO, logging.getLevelName(logging.INFO)
        return True


def quiet_benign_vllm_warnings() -> None:
    """Attach the filters to vLLM's loggers (once per process; harmless to call again)."""
    for name in BENIGN_VLLM_WARNINGS.keys() | VLLM_ADVICE.keys():
        logger = logging.getLogger(name)
        if not any(isinstance(f, BenignVllmWarnings) for f in logger.filters):
            logger.addFilter(BenignVllmWarnings(BENIGN_VLLM_WARNINGS.get(name, ()), VLLM_ADVICE.get(name, ())))


@contextmanager
def layers_left_unloaded() -> Iterator[list[str]]:
    """The layers that a reload finalized inside the block found without new tensors (vLLM puts their old ones back),
    collected rather than logged: finalizing an abandoned update would warn once for every layer not yet streamed,
    which is expected there and says nothing a single line cannot. Benign ones (the rotary cache) are not counted."""
    left: list[str] = []
    benign = BENIGN_VLLM_WARNINGS[_RELOAD]

    def collect(record: logging.LogRecord) -> bool:
        if record.msg != _NOT_LOADED:
            return True
        if not any(match(record) for match in benign):
            left.append(str(record.args[0]) if record.args else "?")
        return False

    logger = logging.getLogger(_RELOAD)
    logger.addFilter(collect)
    try:
        yield left
    finally:
        logger.removeFilter(collect)
