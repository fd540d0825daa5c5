"""Dynamic Resource Allocation, the kubelet's second protocol for devices. The node side: its
messages and method tables (DRAPlugin v1 and v1beta1, the plugin watcher's Registration), the
record of prepared claims shared by every agent instance on the node, the DRAPlugin service
answering NodePrepareResources and NodeUnprepareResources, and registration with the plugin
watcher. The API side: this node's ResourceSlice and the claims Prepare reads, on a client that
only this package loads.

Import rules: pyproject.toml, [tool.importlinter].
"""
