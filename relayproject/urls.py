"""URL routes: /admin/ (operator console), /api/v1/ (HTTP API), /metrics (Prometheus).

``/static/`` is served by Django itself (``insecure=True``) so the admin and the API docs page
work under gunicorn without a separate static server; put a real one in front for heavy use.
"""

from django.contrib import admin
from django.contrib.staticfiles.views import serve as serve_static
from django.urls import path, re_path

from queue_api.api import api
from queue_api.views import api_not_found, metrics_view

urlpatterns = [
    path("admin/", admin.site.urls),
    path("api/v1/", api.urls),
    re_path(r"^api/(?P<rest>.*)$", api_not_found),
    path("metrics", metrics_view, name="metrics"),
    re_path(r"^static/(?P<path>.*)$", serve_static, {"insecure": True}),
]
