"""Shared fixtures: the rank pools come from collectives.testing's pytest plugin, which a
project enables for itself (it is not loaded into every pytest run of an environment)."""

pytest_plugins = ["collectives.testing.plugin"]
