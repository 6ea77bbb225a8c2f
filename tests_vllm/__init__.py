"""kvseal inside vLLM (``make test-vllm``, ``make test-vllm-033``).

The daemons these tests start treat the test's uid as an operator
(``KVSEAL_OPERATOR_UIDS``): the tests read the daemon-wide ``Stats``.
"""

import os

os.environ.setdefault("KVSEAL_OPERATOR_UIDS", str(os.geteuid()))
