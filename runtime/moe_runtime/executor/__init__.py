"""Executors that run one rank per DP rank: Ray actors with a compiled step graph, or in-process."""
