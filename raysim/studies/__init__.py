"""Studies: many runs compared — suites (named runs x seeds), sweeps (grids and random searches), the
benchmark against a reference loop, and the memory probe they use; each writes its own plots and tables."""
