"""The experts of a stage: the stores (host file, packed arena), the tiers (cache, helper, host),
pinned host memory, the helper tier's server side, the adaptive cache's policy."""
