"""gunicorn settings for Relay's HTTP API and admin in a checkout: ``gunicorn -c gunicorn.conf.py``.

The settings, and the environment variables they read, are ``relayproject/gunicorn_conf.py``
(in the package, so an installed Relay has them too: ``-c python:relayproject.gunicorn_conf``).
"""

from relayproject.gunicorn_conf import *  # noqa: F403 - gunicorn reads this module's names
