"""ASGI entry point, what gunicorn.conf.py serves: ``gunicorn -c gunicorn.conf.py``.

Under ASGI, slow clients and waiting long-polls cost no thread: gunicorn's ``asgi`` worker
parses requests on its event loop, and the lease long-poll is an async view. Each request's
sync work (the other views, middleware) runs in a thread of its own that ends with the request,
so a database connection kept after it would never be used again: ``RELAY_CONN_MAX_AGE_S``
defaults to 0 here (close at the end of each request).

``queue_api.middleware.AsgiBodyLimit`` bounds request bodies by ``RELAY_MAX_FRAME_BYTES``
before Django reads them (Django's ASGI handler reads the whole body first).
"""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")
os.environ.setdefault("RELAY_CONN_MAX_AGE_S", "0")

django_application = get_asgi_application()

from queue_api.middleware import AsgiBodyLimit  # noqa: E402 - needs Django set up

application = AsgiBodyLimit(django_application)
