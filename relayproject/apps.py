"""The standalone service's admin app: Django's admin with ``RelayAdminSite`` as ``admin.site``."""

from __future__ import annotations

from django.contrib.admin.apps import AdminConfig


class RelayAdminConfig(AdminConfig):
    """``django.contrib.admin`` whose default site is the branded operator console; listed in
    ``relayproject.settings.INSTALLED_APPS`` in place of ``"django.contrib.admin"``."""

    default_site = "relayproject.admin.RelayAdminSite"

    def ready(self) -> None:
        """Discover the apps' admins, then bound the lists of Django's users and groups as
        Relay's own (``relayproject.auth_admin``)."""
        super().ready()
        from relayproject.auth_admin import bound_auth_admins

        bound_auth_admins()
