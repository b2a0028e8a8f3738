"""pushkv: a push-based KV-cache connector for disaggregated prefill/decode on vLLM.

This package must import cheaply: vLLM imports the connector module in every process
(the API server too), so nothing here imports vLLM, NIXL or torch at module level.
"""

__version__ = "0.1.0"
