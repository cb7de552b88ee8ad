"""The prefill node daemon: `python -m prefill_node --help`."""
