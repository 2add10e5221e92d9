"""Root conftest of the swap monorepo: loads the shared pytest plugin for every test suite."""

pytest_plugins = ("swap_core.testing.pytest_plugin",)
