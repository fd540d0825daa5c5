"""The agent's face to the host: sd_notify, the journal, signals, the Prometheus endpoint and the exec
health probe (`--health-check`).

May import: contracts, text, backoff, config, modes, waits, wire, device, node.
"""
