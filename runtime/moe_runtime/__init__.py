"""The in-pod runtime: an expert-parallel MoE inference server whose DP size changes while serving."""
