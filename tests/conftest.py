"""Shared pytest set-up. Each area's fixtures live in its own conftest under tests/<area>/."""
