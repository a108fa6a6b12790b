"""The command-line face: one module per command, each with ``register(subparsers)``."""
