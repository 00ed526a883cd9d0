"""Reading the keys of the ``TypedDict``s in ``queue_core.types``."""

from __future__ import annotations


def typed_keys(typed_dict: type, *, required: bool | None = None) -> set[str]:
    """The keys of ``typed_dict``: all (``required=None``), the required or the NotRequired."""
    if required is None:
        return set(typed_dict.__annotations__)
    keys = typed_dict.__required_keys__ if required else typed_dict.__optional_keys__  # type: ignore[attr-defined]
    return set(keys)
