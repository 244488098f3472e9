"""Builders shared by the test modules (import as ``from tests.helpers.<module> import ...``).

A test module never imports another test module: anything two test files need lives here.
"""
