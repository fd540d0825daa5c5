"""Development tools, not shipped: a kubelet stand-in as strict as the real device manager (the
tests, the benchmarks and `make run` use it), a DRA kubelet stand-in, a fake API server, finding
the processes one created, and the `make run` demo. Nothing here imports the tests."""
