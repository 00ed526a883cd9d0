"""Fencing tokens drawn many at once (``queue_core.service.new_tokens``)."""

from __future__ import annotations

import re
import secrets

from queue_core.service import TOKEN_BYTES, new_tokens


def test_tokens_drawn_at_once_look_like_token_urlsafe_and_differ() -> None:
    tokens = new_tokens(100)
    width = len(secrets.token_urlsafe(TOKEN_BYTES))
    shape = re.compile(rf"[A-Za-z0-9_-]{{{width}}}")
    assert len(tokens) == 100 and all(shape.fullmatch(t) for t in tokens)
    assert len(set(tokens)) == 100
    assert new_tokens(0) == [] and len(new_tokens(1)) == 1
