"""Routing over pools of prefill and decode nodes: health-checked, load-aware membership, the
client side of the three-call hand-off, and a small router daemon (`python -m common.router`)."""
