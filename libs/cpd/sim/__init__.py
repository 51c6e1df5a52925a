"""The simulated engine and the paper's experiment, as pure building blocks
(docs/architecture.md, "Engines"): a cost model fitted to public B200/H200 figures, a vLLM-like
step scheduler, the :class:`~cpd.engines.sim.engine.SimEngine` (engine protocol), workload
generators and the analysis of a run."""
