"""The OpenAI-compatible HTTP server of a launch (`strata-launch --port P`): /v1/chat/completions,
/v1/completions, /v1/models, /health, /v1/status, /metrics and the Monitor page at /."""
from .run import ServeError, serve_launch

__all__ = ["serve_launch", "ServeError"]
