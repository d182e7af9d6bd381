"""Named errors of picasso_tf's refusals: a model or feature it cannot rewrite
exactly is refused with one of these, saying what, why and what to do."""


class UnsupportedModelError(NotImplementedError):
    """The model is built in a way picasso_tf cannot rewrite without changing what it
    computes (a NotImplementedError, so picasso-train reports it as a refusal)."""

    # Raised while Keras traces its train function, an error keeps its type through
    # autograph only if it takes Exception's constructor (else it becomes a StagingError).
    __init__ = Exception.__init__


class HotTierTooLargeError(MemoryError):
    """HybridHash's hot tiers (hot_storage_bytes) do not fit in the memory of the device
    they live on (hot_tier_device); nothing was changed."""
