"""The k8s fixtures live in tests/conftest.py so every test directory can use them."""
