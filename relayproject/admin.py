"""The standalone service's admin site: the branded operator console.

Only ``relayproject`` uses it (``relayproject.apps.RelayAdminConfig`` makes it the default
``admin.site``); in a project of one's own, ``queue_admin`` registers its pages on that
project's admin site and leaves its header, home page and "View site" link alone.
"""

from __future__ import annotations

from django.contrib import admin


class RelayAdminSite(admin.AdminSite):
    """``admin.site`` of the standalone service: Relay's header and a home page that starts
    with the queue overview (``queue_admin/index.html``)."""

    site_header = "Relay operator console"
    site_title = "Relay"
    index_title = "Operator console"
    index_template = "queue_admin/index.html"
    site_url = None  # the service serves no site at "/": no "View site" link
