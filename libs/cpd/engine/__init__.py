"""Engines behind the CPD workers: the vLLM engine and its KV connector."""
