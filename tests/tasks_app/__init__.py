"""A sample Django app for Relay's django.tasks backend and application-worker tests.

``tasks.py`` holds ``@task`` functions (plain module-level functions: no app registration is
needed); ``handlers.py`` holds handlers for ``relay_worker --app
tests.tasks_app.handlers.HANDLERS``.
"""
