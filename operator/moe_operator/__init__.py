"""The kopf operator that turns MoEDeployments into RayClusters and drives their live resizes."""
