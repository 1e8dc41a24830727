"""The GPU ops, one module an op: each holds its host launchers (the prompt path's, over a chunk's
rows, and the decode graph's, into its static buffers), its variants and the one place that
chooses among them by shape and type, saying once why a chosen path gave way
(`compute_options.fall_back`). The backends (CupyBackend, the decode graphs and their
GraphLayerOps) keep their methods and hand the work to these; the kernels these launch are in
strata_dist/kernels/. Nothing here imports a backend: an op is given the backend or graph whose
buffers it launches into."""
