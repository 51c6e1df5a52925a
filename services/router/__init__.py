"""Router: admission, tokenization, hashing, the routing decision and the client API
(DESIGN.md §8). ``policy`` and ``cost`` hold the pure decision logic; the service lands
with the router issue."""
