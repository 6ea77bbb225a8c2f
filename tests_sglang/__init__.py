"""kvseal inside SGLang (``make test-sglang``): real ``sglang.launch_server``
processes on the CPU and real daemons (:mod:`tests_vllm.daemon`, which sets
the test uid as the daemons' operator so tests read daemon-wide ``Stats``)."""
