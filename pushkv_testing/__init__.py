"""Test-only harness, left out of the wheel (pyproject's package list): fault injection on a
real engine (``faults``, ``freed_check``; ``kv_connector_extra_config``'s ``_faults``) and
the plugin's worker role without vLLM (``worker_ranks``). The product imports nothing from
here but ``faults``, lazily, in ``connector.worker_side`` when ``_faults`` is set.
"""
