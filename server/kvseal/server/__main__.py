"""``python -m kvseal.server`` runs the daemon."""

import sys

from kvseal.server.main import main

sys.exit(main())
