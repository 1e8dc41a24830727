"""The single-process tools (`strata-dist`): the CLI, the single-process runner, calibration,
expert profiles."""
