#!/usr/bin/env python
"""manage.py of the example shop (``docs/django.md``): a Django app whose tasks run on Relay."""

import os
import sys
from pathlib import Path

if __name__ == "__main__":
    # Use the Relay of this checkout (installed projects import queue_core from site-packages).
    sys.path.insert(1, str(Path(__file__).resolve().parent.parent))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "exampleproject.settings")
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
