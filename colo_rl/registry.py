"""Named registries: a decorator registers a function under a name, `get` finds it or says which names exist.

The config's choices are the registries' names (`colo_rl/config/schema.py` names them beside the options), so
adding an algorithm is one decorated function: the option accepts it everywhere at once.
"""

from __future__ import annotations

from typing import Callable, Generic, Iterator, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions by name for one config key (e.g. `algo.kl_estimator`)."""

    def __init__(self, key: str):
        self.key = key
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def wrap(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.key}: {name!r} is registered twice ({self._entries[name].__qualname__} "
                                 f"and {fn.__qualname__})")
            self._entries[name] = fn
            return fn

        return wrap

    def get(self, name: str) -> F:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"{self.key}={name!r} is not one of {self.names()}") from None

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)
