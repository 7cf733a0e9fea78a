"""What a forward leaves on the host: the plain attributes of the objects it writes (recurrent layer states), so
that a replayed CUDA graph, which runs no Python, can set them as the eager forward did (graphs.py)."""

from __future__ import annotations

from contextlib import contextmanager

PLAIN = (bool, int, float, str, tuple, type(None))


def records(objects) -> dict:
    """The plain attributes of the host objects a forward may write (recurrent layer states)."""
    return {(id(o), k): (o, v) for o in objects for k, v in vars(o).items() if isinstance(v, PLAIN)}


_SPIES: dict[type, type] = {}
_WRITTEN: list[set] = []


def spy_class(cls: type) -> type:
    """A subclass of `cls` that notes every attribute set on its instances while a `writes` block runs."""
    if cls not in _SPIES:
        def __setattr__(self, name, value):
            if _WRITTEN:
                _WRITTEN[-1].add((id(self), name))
            cls.__setattr__(self, name, value)
        _SPIES[cls] = type(cls.__name__, (cls,), {"__setattr__": __setattr__, "__module__": cls.__module__})
    return _SPIES[cls]


@contextmanager
def writes(objects):
    """Yields the set of (id(object), attribute) the block assigns on `objects`, even a value equal to the old one
    (a forward that writes the shape of its pass writes it whether or not it changed)."""
    got: set = set()
    swapped = []
    for o in objects:
        try:
            cls = type(o)
            o.__class__ = spy_class(cls)
            swapped.append((o, cls))
        except TypeError:                  # a class whose instances cannot change class: changes are still seen
            pass
    _WRITTEN.append(got)
    try:
        yield got
    finally:
        _WRITTEN.pop()
        for o, cls in swapped:
            o.__class__ = cls
