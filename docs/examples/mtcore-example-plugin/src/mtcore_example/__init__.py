"""mtcore-example-plugin: the smallest useful mtcore plugin (backend "example")."""

__version__ = "0.1.0"
