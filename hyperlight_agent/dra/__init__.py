"""Dynamic Resource Allocation, the kubelet's second protocol for devices: registration through the
kubelet's plugin watcher, the DRA node service (NodePrepareResources / NodeUnprepareResources), the
record of prepared claims, and this node's ResourceSlice and the claims it reads from the API.

May import: contracts, config, modes, waits, device, node.
"""
