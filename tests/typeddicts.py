"""Reading the keys of the ``TypedDict``s in ``queue_core.types`` (declared under
``from __future__ import annotations``, so ``__required_keys__`` cannot tell NotRequired)."""

from __future__ import annotations


def typed_keys(typed_dict: type, *, required: bool | None = None) -> set[str]:
    """The keys of ``typed_dict``: all (``required=None``), the required or the NotRequired."""
    out = set()
    for key, hint in typed_dict.__annotations__.items():
        text = getattr(hint, "__forward_arg__", str(hint))
        if required is None or text.startswith("NotRequired[") != required:
            out.add(key)
    return out
