"""Expert-parallel load balancing: pure placement policy, load windows and move planning."""
