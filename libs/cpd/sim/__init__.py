"""The simulated engine and the paper's experiment, as pure building blocks
(DESIGN.md §9 "sim"): a cost model fitted to public B200/H200 figures, a vLLM-like
step scheduler, the :class:`~cpd.sim.engine.SimEngine` (engine protocol), workload
generators and the analysis of a run."""
