"""Decode worker: pulls the request's KV blocks over UCX and streams tokens
(DESIGN.md §2). Built by the workers issue."""
