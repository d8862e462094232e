"""The MoEDeployment API: pydantic models of spec and status, and the CRD generated from them."""
