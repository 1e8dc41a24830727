"""A rank process: its shell (sockets, register, assignment, liveness) and CLI, its stage and the
stage's step, hidden rows between stages, a prompt chunk's buffers, kept conversations' state,
the draft model (a whole-model stage beside the last one)."""
