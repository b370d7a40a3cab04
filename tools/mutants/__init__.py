"""Planted faults: one-line breaks of core paths, each shown to be caught by its tests."""
