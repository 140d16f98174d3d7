"""The `edge0` command line: one module per command group."""
