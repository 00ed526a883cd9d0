"""The standalone console's users and groups: Django's admins, bounded as Relay's own.

On Django's own user admin a user who may view users sent ``?date_joined__regex=...``, which
SQLite runs in Python holding the worker (4.7 s, every HTTP request stalled; a nested pattern
would run past gunicorn's 60 s timeout), and 2,500 search words answered 500 (a review).
``relayproject.apps.RelayAdminConfig.ready`` registers these in their place; only the
standalone service does: a project's own admin is its own.
"""

from __future__ import annotations

from django.contrib import admin
from django.contrib.auth.admin import GroupAdmin, UserAdmin
from django.contrib.auth.models import Group, User

from queue_admin.listing import BoundedChangelist


class RelayUserAdmin(BoundedChangelist, UserAdmin):  # type: ignore[type-arg]
    """Django's user admin whose list takes only its filters' lookups and a short search."""


class RelayGroupAdmin(BoundedChangelist, GroupAdmin):
    """Django's group admin, bounded as ``RelayUserAdmin``."""


def bound_auth_admins() -> None:
    """Register users and groups on ``admin.site`` with the admins above."""
    for model, model_admin in ((User, RelayUserAdmin), (Group, RelayGroupAdmin)):
        if admin.site.is_registered(model):
            admin.site.unregister(model)
        admin.site.register(model, model_admin)
