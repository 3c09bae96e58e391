"""Shared fixtures: the rank pools come from collectives.testing (its pytest plugin)."""
