"""The kubelet's Dynamic Resource Allocation protocol, node side: its messages and method tables
(DRAPlugin v1 and v1beta1, the plugin watcher's Registration), the record of prepared claims
shared by every agent instance on the node, the DRAPlugin service answering
NodePrepareResources and NodeUnprepareResources, and registration with the kubelet's plugin
watcher. Reading claims from the Kubernetes API is not here: the service is given a claim reader.

May import: contracts, config, modes, waits, device, node.
"""
