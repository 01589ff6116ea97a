"""The examples in the public entry points' docstrings run and print what they say (doctest)."""

import doctest
import importlib

import pytest

MODULES = ["workbench", "workbench.define", "workbench.define.targets", "workbench.blocks", "workbench.verify",
           "workbench.verify.verdict", "workbench.verify.oracle", "workbench.export", "workbench.export.spec",
           "workbench.invariance", "workbench.port", "workbench.port.check",
           "workbench.port.layout", "workbench.translate.derivative", "workbench.fa4"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples in {name} failed"
