"""The router daemon (`python -m router`): routing over pools of prefill and decode nodes, the
client side of the three-call hand-off. May import any common package (common.peers holds the
membership and prefill client it shares with the decode node); nothing imports it."""
