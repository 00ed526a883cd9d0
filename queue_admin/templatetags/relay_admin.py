"""Template filters for the console: numbers, instants and spans in epoch ms."""

from __future__ import annotations

from django import template

from queue_admin import display

register = template.Library()


@register.filter
def thousands(value: object) -> str:
    """``100000`` -> ``100,000`` (non-numbers pass through)."""
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@register.filter
def iso(ms: int | None) -> str:
    """Epoch ms as ISO 8601 UTC."""
    return display.iso_ms(ms)


@register.filter
def span(ms: int | None) -> str:
    """A duration in ms, e.g. ``3m 12s``."""
    return display.span_ms(ms)


@register.simple_tag
def ago(ms: int | None, now_ms: int) -> str:
    """An instant relative to ``now_ms``: ``3m ago`` or ``in 20s``."""
    return display.relative_ms(ms, now_ms)


@register.filter
def shorten(text: str | None, limit: int = 80) -> str:
    """One line of at most ``limit`` characters."""
    return display.shorten(text, limit)


@register.filter
def hover(text: str | None) -> str:
    """What a hover title repeats of a long text: one line of ``display.HOVER_CHARS``."""
    return display.shorten(text, display.HOVER_CHARS)
