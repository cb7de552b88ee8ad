"""The bounds of a request's sampling parameters, apart from the sampler (and torch), so the
HTTP front's API servers check them without loading the engine."""

MAX_N = 16  # parallel samples per request; each one decodes as a sequence of its own
MAX_TOP_LOGPROBS = 20
