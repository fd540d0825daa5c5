"""The kubelet's device plugin protocol (v1beta1): its messages and method tables, the servicer
(ListAndWatch, Allocate), registration with the kubelet and the handover to a successor. A second
kubelet protocol (Dynamic Resource Allocation) sits beside it as its own package.

Import rules: pyproject.toml, [tool.importlinter].
"""
