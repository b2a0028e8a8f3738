"""Settings every test directory shares.

Hypothesis' per-example deadline (200 ms by default) times the example on the wall clock, so
on a 2-core machine shared with vLLM engines a property test fails for the machine's load,
not for its property; the suite's bounds on time are its ``perf`` tests."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("pushkv", deadline=None)
settings.load_profile("pushkv")
