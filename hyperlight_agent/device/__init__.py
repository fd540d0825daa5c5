"""The hypervisor device: the table of hypervisors, the kernel-level checks, the probe helper (its
own process and the agent's side of it), the single-flight device check and the observation it
publishes.

Import-free on purpose: the probe helper imports this package with the standard library only.

Import rules: pyproject.toml, [tool.importlinter].
"""
