"""pushkv: a push-based KV-cache connector for disaggregated prefill/decode on vLLM.

This package must import cheaply: vLLM imports the connector module in every process
(the API server too), so nothing here imports vLLM, NIXL or torch at module level.
"""

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # vLLM resolves kv_connector "PushConnector" as getattr(import_module("connector"), ...):
    # load the plugin (and vLLM's base classes) only then.
    if name == "PushConnector":
        from connector.plugin import PushConnector

        return PushConnector
    raise AttributeError(f"module 'connector' has no attribute {name!r}")
