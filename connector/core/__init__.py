"""The pure protocol core: the wire, the transfer and request state tables, the KV layout.

Nothing in this package imports vLLM, NIXL, torch or threading, or reads a clock: time
arrives as ``now_ns`` arguments, so every ordering of events can be tested without them.
README.md beside this file gives a reading order.
"""
