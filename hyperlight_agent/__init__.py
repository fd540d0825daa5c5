"""hyperlight-agent: a Kubernetes device plugin that hands /dev/kvm or /dev/mshv to Hyperlight sandboxes.

This module stays import-free on purpose: the probe helper imports the package with only the
standard library on its path, so nothing here may pull in grpc or protobuf.
"""

__version__ = "0.1.0"
