"""A seam for measurements: subscribers see what decoding reports (a benchmark cell starting, an engine step
and its time) without patching it. Nothing is reported while nobody listens."""

from __future__ import annotations

from collections.abc import Callable

Listener = Callable[[str, dict], None]
LISTENERS: list[Listener] = []


def subscribe(fn: Listener) -> Callable[[], None]:
    """Call fn(kind, fields) for every event from now on; returns the function that stops it."""
    LISTENERS.append(fn)
    return lambda: LISTENERS.remove(fn) if fn in LISTENERS else None


def emit(kind: str, **fields) -> None:
    for fn in list(LISTENERS):
        fn(kind, fields)
