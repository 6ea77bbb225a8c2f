"""kvseal's CPU test suite (``make test``) and its long suites (tests/suites).

Every daemon these tests start treats the test's own uid as an operator
(``KVSEAL_OPERATOR_UIDS``, inherited by daemon processes and read by
``config_from_args``): most tests check the daemon-wide ``Stats``. The tests of
the scoped view (tests/test_stats_scope.py) start their daemons without it.
"""

import os

os.environ.setdefault("KVSEAL_OPERATOR_UIDS", str(os.geteuid()))
