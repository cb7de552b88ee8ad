"""The decode node daemon: `python -m decode_node --help`."""
