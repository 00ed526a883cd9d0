"""WSGI entry point for gunicorn: ``gunicorn relayproject.wsgi``."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")

application = get_wsgi_application()
