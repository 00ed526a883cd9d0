"""ASGI entry point, what gunicorn.conf.py serves: ``gunicorn -c gunicorn.conf.py``.

Under ASGI, slow clients and waiting long-polls cost no thread: gunicorn's ``asgi`` worker
parses requests on its event loop, and the lease long-poll is an async view. The sync work of
a request (middleware, the other views) runs whole on one of a few long-lived threads that keep
their database connections (``queue_api.pool.PooledAsgiHandler``, ``RELAY_HTTP_THREADS``),
instead of a thread made for each request that would have to open its own.

``queue_api.middleware.AsgiBodyLimit`` bounds request bodies by ``RELAY_MAX_FRAME_BYTES``
before Django reads them (Django's ASGI handler reads the whole body first);
``AsgiAbsoluteForm`` serves a request whose target is a whole URL as its path.
"""

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application does

from queue_api.middleware import AsgiAbsoluteForm, AsgiBodyLimit  # noqa: E402 - needs Django
from queue_api.pool import PooledAsgiHandler  # noqa: E402

django_application = PooledAsgiHandler()

application = AsgiAbsoluteForm(AsgiBodyLimit(django_application))
