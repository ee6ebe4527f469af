"""Helpers and fakes shared by the unit and e2e tiers; tests/conftest.py puts tests/ on sys.path so both import
them as `helpers.<module>`."""
