"""The files the agent owns on the node: atomic replacement, the CDI spec, the node-feature-discovery
feature file, and the inotify wake-ups on the directories they live in. Nothing here knows about
the kubelet or the device.

Import rules: pyproject.toml, [tool.importlinter].
"""
