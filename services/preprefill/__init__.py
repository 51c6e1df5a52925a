"""Pre-prefill worker: full prefill of cold prompts, sealing every full block
(DESIGN.md §2). Built by the workers issue."""
