"""strata-dist: a GGUF MoE model across every GPU a user has."""
__version__ = "0.1.0"
