"""refit's log lines in an actor process, where no one else configures logging.

Ray forwards an actor's stderr to the driver, prefixed with the actor's
name, but Python prints nothing below WARNING without a handler. The level
comes from `REFIT_LOG_LEVEL` (default INFO); a handler the user installed
first is left alone.
"""

from __future__ import annotations

import logging
import os

from refit.engine.vllm_logs import quiet_benign_vllm_warnings


def show_refit_logs() -> None:
    # Before the engine starts: the warnings every healthy start and sync logs would otherwise reach the driver.
    quiet_benign_vllm_warnings()
    # vLLM configures its logging only when an engine starts; what it logs while being imported
    # (on CPUs: "Triton is installed, but doesn't include CPU backend") would reach Python's
    # last-resort handler, unformatted and whatever VLLM_LOGGING_LEVEL says.
    if level := os.environ.get("VLLM_LOGGING_LEVEL"):
        logging.getLogger("vllm").setLevel(level.upper())
    logger = logging.getLogger("refit")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(os.environ.get("REFIT_LOG_LEVEL", "INFO").upper())
    logger.propagate = False
