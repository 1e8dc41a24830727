"""The planner's one exception type."""


class PlanError(ValueError):
    """A combination the planner cannot honour. The message names the numbers (device, needed and
    free MiB, the offending split points); the CLI prints it and exits 2 — never a silent fallback."""
