"""Two questions asked of classes in several places, answered once: which package a class comes from, and which
class in an MRO defines an attribute."""

from __future__ import annotations


def from_package(cls: type, package: str) -> bool:
    """Whether ``cls`` or one of its bases is defined in the top-level package ``package`` (e.g. ``"trl"``)."""
    return any(base.__module__.split(".")[0] == package for base in cls.__mro__)


def mro_owner(cls: type, name: str) -> type | None:
    """The class in ``cls``'s MRO whose ``__dict__`` defines ``name`` (None when none does)."""
    return next((base for base in cls.__mro__ if name in base.__dict__), None)
