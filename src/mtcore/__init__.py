"""mtcore: hybrid-parallel LLM training on any accelerator, through plugins."""

__version__ = "0.1.0"


def lazy_exports(package: str, names: dict[str, str]):
    """A module ``__getattr__`` for ``package`` that imports each of ``names`` (name ->
    module: ``".runner"`` inside the package, or a whole module path) on first use:
    a package exports its torch modules' names and still imports without torch
    (``mtcore plan`` and the CLI's parser never import it). Used as
    ``__getattr__ = lazy_exports(__name__, {...})``."""

    def __getattr__(name: str):
        if name in names:
            import importlib

            return getattr(importlib.import_module(names[name], package), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
