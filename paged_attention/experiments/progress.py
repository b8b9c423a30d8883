"""One progress bar over an experiment's runs (each run is a whole trace served by one manager)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], enabled: bool, desc: str) -> Iterator[T]:
    """``items``, with a tqdm bar on stderr when ``enabled`` (commands), silently otherwise (notebooks)."""
    if not enabled:
        yield from items
        return
    from tqdm.auto import tqdm

    items = list(items)
    with tqdm(items, desc=desc, unit="run", leave=False) as bar:
        for item in bar:
            bar.set_postfix_str(str(item))
            yield item
