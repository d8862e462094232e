"""Stateless communication groups (one per epoch) and expert dispatch/combine over them."""
