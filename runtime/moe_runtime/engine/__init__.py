"""Request queue, continuous batching and the lockstep step loop across DP ranks."""
