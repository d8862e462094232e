"""The contract between the operator and the runtime: stage names, shared names, the serve flags, the status payload and the log line format, imported by both sides."""
