"""URL routes: /admin/ (operator console) and /api/ (HTTP API, added by queue_api)."""

from django.contrib import admin
from django.urls import path

urlpatterns = [
    path("admin/", admin.site.urls),
]
