"""What every worker process runs on, and the server may use too: the worker runtime
(:mod:`.worker`: rings, heartbeat, stop), the slot fence (:mod:`.fence`) and logging
(:mod:`.logs`). Imports no server code (``tests/test_layering.py``)."""
