"""The agent's face to the host: sd_notify, the journal, signals, the Prometheus endpoint and the exec
health probe (`--health-check`).

Import rules: pyproject.toml, [tool.importlinter].
"""
