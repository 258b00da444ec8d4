"""HTTP endpoints, one module per endpoint family."""
