"""A pipeline chunk built from a run of layers (``StageModule``), named as in the whole model.

Apart from ``split`` (the arithmetic of who owns which layers), which the planner reads
without torch.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn


class StageModule(nn.Module):
    """One chunk: optional ``pre`` (embedding), a run of layers, optional ``post`` (head).

    ``layers`` maps each global layer index to its module, and ``pre`` /
    ``post`` are registered under ``names``, so parameter names
    (``layers.7.weight``, ``embed.weight``) match the whole model's.
    ``call_layer(layer, x)`` runs one layer (default ``layer(x)``), for layers
    that take extra arguments.
    """

    def __init__(
        self,
        layers: dict[int, nn.Module],
        pre: nn.Module | None = None,
        post: nn.Module | None = None,
        call_layer: Callable[[nn.Module, Tensor], Tensor] | None = None,
        names: tuple[str, str] = ("pre", "post"),
    ):
        super().__init__()
        self._names = names
        for name, module in zip(names, (pre, post), strict=True):
            if module is not None:
                self.add_module(name, module)
        self.layers = nn.ModuleDict({str(i): m for i, m in sorted(layers.items())})
        self._call = call_layer or (lambda layer, x: layer(x))

    def forward(self, x: Tensor) -> Tensor:
        pre, post = (getattr(self, n, None) for n in self._names)
        if pre is not None:
            x = pre(x)
        for layer in self.layers.values():
            x = self._call(layer, x)
        if post is not None:
            x = post(x)
        return x
