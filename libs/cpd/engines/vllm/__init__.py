"""vLLM behind a CPD worker: the engine (``AsyncLLM``), CPD's KV connector, and the bridge
of vLLM's KV events into ``CPD_KV``. Modules are imported on use: vLLM is heavy."""
