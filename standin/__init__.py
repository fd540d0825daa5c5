"""Development tools, not shipped: a kubelet stand-in as strict as the real device manager (the
tests, the benchmarks and `make run` use it) and the `make run` demo."""
