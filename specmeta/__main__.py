"""``python -m specmeta``: the ``specmeta`` command where its script is not on ``PATH`` (a
``pip install --target`` or a checkout on ``PYTHONPATH``, as on a GPU host reached by copy)."""

import sys

from .cli import main

sys.exit(main())
