"""The contract both sides import: stage names, shared names, serve flags, status payload, log line."""
