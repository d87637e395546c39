"""The transfer worker process: one per device, pinned to the device's NUMA node. It takes
copy, spill-staging and promote jobs from its ring and moves blocks between the engine's KV
cache and the pool: host memory through :mod:`.copy` (the C kernels), CUDA devices through
:mod:`.cuda`. Imports no server code (``tests/test_layering.py``)."""
