"""Pre-prefill worker: full prefill of cold prompts, sealing every full block
(docs/architecture.md, "Services")."""
