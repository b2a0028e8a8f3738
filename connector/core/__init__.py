"""The pure protocol core: messages, rendezvous, receive tracking, deadlines, layout mapping.

Nothing in this package imports vLLM, NIXL, torch or threading, or reads a clock:
time arrives as ``now_ns`` arguments. See README.md beside this file for a reading order.
"""
