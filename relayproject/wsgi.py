"""The WSGI application, for a WSGI server (``gunicorn relayproject.wsgi`` with gunicorn's own
sync workers, or uWSGI, mod_wsgi).

Relay's gunicorn settings (``gunicorn.conf.py``, ``relayproject/gunicorn_conf.py``) serve
``relayproject.asgi`` with gunicorn's ``asgi`` worker instead, so that waiting lease long-polls
hold no thread: run ``gunicorn -c gunicorn.conf.py`` with no application argument (naming this
module there hands a WSGI application to the ASGI worker, which answers 500).
"""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "relayproject.settings")

application = get_wsgi_application()
