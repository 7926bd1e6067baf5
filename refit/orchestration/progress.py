"""Progress bars for the driver's waits (actors starting, buckets streamed).

Why: a sync of a large model, or engines that take minutes to start, looks
hung without one; in a log file or a CI run a bar is noise. So a bar shows
when asked (`SyncConfig.progress`), or by default when stderr is a terminal.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress_bar"]


def progress_bar(wanted: bool | None, total: int, description: str, unit: str = "actor") -> Any:
    """A bar on stderr when asked, or by default when stderr is a terminal; else a no-op."""
    from tqdm.auto import tqdm

    show = sys.stderr.isatty() if wanted is None else wanted
    return tqdm(total=total, unit=unit, desc=description, disable=not show, leave=False)
