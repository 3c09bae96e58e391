"""Shared fixtures: the rank pools come from collectives.testing's pytest plugin, which is
opt-in (no entry point: it must not load in other projects' test runs); this suite opts in."""

pytest_plugins = ["collectives.testing.plugin"]
