"""The ``mtcore`` command line: one module per subcommand, dispatched by ``mtcore.cli.main``."""
