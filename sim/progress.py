"""Progress of a long loop, on stderr: a tqdm bar on a terminal; elsewhere (CI logs, batch jobs, the piped
output of torchrun) a plain line every few seconds, never a bar's carriage-return redraws, so that a long run
is never silent and its log stays readable. Shared by ``sim.run``, ``runner.train`` and ``calibrate.run``."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def with_progress(items: Iterable[T], desc: str, *, total: int | None = None, initial: int = 0,
                  unit: str = "step", status: Callable[[], str] | None = None, enabled: bool = True,
                  interval_s: float = 5.0) -> Iterator[T]:
    """Yield ``items``, reporting how many of ``total`` (default ``len(items)``) are done, counting from
    ``initial`` (a resumed loop's first item is ``initial + 1``). ``status()``, read after each item, is shown
    beside the count (e.g. the latest loss). Off a terminal the line comes every ``interval_s`` seconds,
    never after the last item."""
    if not enabled:
        yield from items
        return
    total = len(items) if total is None else total
    if sys.stderr.isatty():
        with tqdm(items, desc=desc, total=total, initial=initial, unit=unit, leave=False, file=sys.stderr) as bar:
            for item in bar:
                yield item
                if status is not None:
                    bar.set_postfix_str(status(), refresh=False)
        return
    start = last = time.monotonic()
    for done, item in enumerate(items, start=initial + 1):
        yield item
        now = time.monotonic()
        if now - last >= interval_s and done < total:
            detail = f", {status()}" if status is not None else ""
            print(f"{desc}: {unit} {done}/{total} after {now - start:.0f} s{detail}", file=sys.stderr, flush=True)
            last = now
