"""The only code of the operator that talks to the Kubernetes API server."""
