"""Decode worker: pulls the request's KV blocks over UCX and streams tokens
(docs/architecture.md, "Services")."""
