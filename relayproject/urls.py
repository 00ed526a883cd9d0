"""URL routes: /admin/ (operator console), /api/v1/ (HTTP API), /metrics (Prometheus).

``/static/`` is served by Django itself (``insecure=True``) so the admin and the API docs page
work under gunicorn without a separate static server; put a real one in front for heavy use.
"""

from typing import Any

from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import URLPattern, path, re_path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_safe

from queue_api.api import api
from queue_api.views import api_not_found, metrics_view


def _api_urls() -> Any:
    """``api.urls``, its schema and docs pages answering GET and HEAD only, and its root
    (``/api/v1/``) the API's 404 problem: django-ninja serves those three pages to any method,
    behind Django's CSRF check, so a POST got an HTML 403 page and the root an HTML 404
    (hostile review); now any other method gets the API's 405 problem."""
    urls = api.urls
    for pattern in urls[0]:
        if not isinstance(pattern, URLPattern):
            continue
        if pattern.name in ("openapi-json", "openapi-view"):
            pattern.callback = csrf_exempt(require_safe(pattern.callback))
        elif pattern.name == "api-root":
            pattern.callback = api_not_found
    return urls


urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", _api_urls()),
    # Any other path under /api/, also with more slashes before it (//api/v1/stats): the
    # API's 404 problem, not Django's HTML page.
    re_path(r"^(?:/*)api/(?P<rest>.*)$", api_not_found),
    path("metrics", metrics_view, name="metrics"),
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
]
