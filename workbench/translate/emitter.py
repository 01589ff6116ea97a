"""The part every translator shares: walking a traced mod's aten graph node by node and writing
one line of kernel source per node.

An `Emitter` keeps the environment (each graph node's value in the target language), hands out
fresh names, turns captured tensors into pointer views (a table is read where it is indexed), and
dispatches each node to a hook. A translator (Triton predicate, Triton bounds, CuTe DSL next)
subclasses it and gives the hooks and a method per family of aten ops.
"""

from __future__ import annotations

import operator
import re

import torch

from workbench.define import op_name

__all__ = ["Emitter", "Untranslatable", "View", "Vec", "literal", "argument_name", "K"]


class Untranslatable(Exception):
    """A construct of the traced mod that this translator cannot write (the message names it)."""


def argument_name(name: str) -> str:
    """A captured tensor's name as the kernel argument (and the port's table) it becomes: a
    `Mask.data` key such as "score.table" turns into an identifier."""
    return name if name.isidentifier() else re.sub(r"\W", "_", name)


def literal(value) -> str:
    """A Python number or bool as source text (inf and nan as float('...'))."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else f"float('{value}')"
    return repr(value)


K = "@K@"  # stands for the element index inside a vector's expression


class View:
    """A captured tensor, or a slice of one, not yet loaded: pointer, offset, remaining shape and
    strides (row-major, as the tensor is stored in the spec and the port's tensor file)."""

    def __init__(self, ptr: str, offset: str, shape: tuple, strides: tuple):
        self.ptr, self.offset, self.shape, self.strides = ptr, offset, tuple(shape), tuple(strides)


class Vec:
    """A vector of n values per lane (e.g. `q_idx >= starts` against a captured table): an
    expression in the element index K, written out once per element where a reduction consumes it."""

    def __init__(self, n: int, expr: str):
        self.n, self.expr = n, expr


class Emitter:
    """Walks `gm` (a traced mod) in order; `captured` names the tensors the mod reads (extended
    with any it reads that were not named), `lifted` the 0-d ones passed as kernel arguments.

    Hooks for a translator: `placeholder(node)`, `constant(node, tensor)`, `call(op, node)`
    (`op` is the aten op's name: "add", "index", ...) and `output(node)`; each returns the node's
    value (or, for output, writes the return line)."""

    def __init__(self, gm, captured: dict[str, torch.Tensor], lifted: frozenset = frozenset()):
        self.gm, self.captured, self.lifted = gm, captured, lifted
        self.lines: list[str] = []
        self.env: dict[str, object] = {}
        self.pointers: list[str] = []
        self.by_ptr = {(t.data_ptr(), tuple(t.shape)): n for n, t in captured.items()}
        self._counter = 0

    # ------------------------------------------------------------ names and lines

    def fresh(self, prefix: str = "t") -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def emit(self, expr: str, prefix: str) -> str:
        """`name = expr` as a new line; returns the name."""
        name = self.fresh(prefix)
        self.lines.append(f"    {name} = {expr}")
        return name

    # ------------------------------------------------------------ captured tensors

    def tensor_name(self, tensor: torch.Tensor) -> str | None:
        return self.by_ptr.get((tensor.data_ptr(), tuple(tensor.shape)))

    def is_lifted(self, tensor: torch.Tensor) -> bool:
        return tensor.dim() == 0 and self.tensor_name(tensor) in self.lifted

    def view_of(self, tensor: torch.Tensor, target: str) -> View:
        """The captured tensor as a pointer argument (added to `pointers` on first use)."""
        name = self.tensor_name(tensor) or target.lstrip("_")
        if not name.isidentifier():  # Mask.data keys such as "score.table" name a pointer argument
            clean = argument_name(name)
            self.captured[clean] = self.captured.pop(name, tensor)
            name = clean
        if name not in self.captured:
            self.captured[name] = tensor
            self.by_ptr[(tensor.data_ptr(), tuple(tensor.shape))] = name
        ptr = f"{name}_ptr"
        if ptr not in self.pointers:
            self.pointers.append(ptr)
        return View(ptr, "0", tuple(tensor.shape), torch.empty(tensor.shape).stride())

    # ------------------------------------------------------------ the walk

    def walk(self) -> None:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self.env[node.name] = self.placeholder(node)
            elif node.op == "get_attr":
                self.env[node.name] = self.constant(node, getattr(self.gm, node.target))
            elif node.op == "output":
                self.output(node)
            elif node.op == "call_function":
                if node.target is operator.getitem:
                    raise Untranslatable("Python indexing survived tracing")
                self.env[node.name] = self.call(op_name(node.target), node)
            else:
                raise Untranslatable(f"graph node {node.op}")

    def placeholder(self, node):
        raise NotImplementedError

    def constant(self, node, tensor: torch.Tensor):
        raise NotImplementedError

    def call(self, op: str, node):
        raise NotImplementedError

    def output(self, node) -> None:
        raise NotImplementedError

    @staticmethod
    def returned(node):
        out = node.args[0]
        return out[0] if isinstance(out, (tuple, list)) else out

    def function(self, name: str, params: list[str]) -> str:
        """The walked graph as one @triton.jit function."""
        return f"@triton.jit\ndef {name}({', '.join(params)}):\n" + "\n".join(self.lines) + "\n"
