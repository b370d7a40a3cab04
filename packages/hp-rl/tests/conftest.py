"""Fixtures shared by hp-rl's tests."""
