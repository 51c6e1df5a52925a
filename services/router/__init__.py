"""Router: admission, tokenization, hashing, the routing decision and the client API
(DESIGN.md §8). Built by the router issue."""
