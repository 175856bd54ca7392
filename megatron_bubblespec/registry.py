"""Entries registered once by name (tasks, verification rules) -> a table the rest of the project
reads, which refuses a second registration and names the registered entries for an unknown one."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


class Registry(dict):
    """A ``dict`` of name -> entry, filled by ``register``; ``entry`` looks one up."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what          # what an entry is, for messages ("task")

    def register(self, name: str, entry: T) -> T:
        if name in self:
            raise ValueError(f"{self.what} {name!r} is registered twice")
        self[name] = entry
        return entry

    def entry(self, name: str):
        if name not in self:
            raise ValueError(f"unknown {self.what} {name!r}: valid names are "
                             f"{', '.join(sorted(self))}")
        return self[name]
