"""python/fasttrain/_native.pyi against the built module: the same names, the same signatures."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import fasttrain
from fasttrain import _native

STUB = Path(fasttrain.__file__).with_name("_native.pyi")


def stub_entries() -> tuple[dict[str, ast.FunctionDef], set[str]]:
    tree = ast.parse(STUB.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    names = {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
    return functions, names


def stub_parameters(node: ast.FunctionDef) -> list[tuple[str, str, object]]:
    """(name, kind, default) per parameter, in inspect's terms."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(args.defaults)) + [
        ast.literal_eval(d) for d in args.defaults
    ]
    out = [(a.arg, "POSITIONAL_OR_KEYWORD", d) for a, d in zip(positional, defaults, strict=True)]
    for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        out.append((a.arg, "KEYWORD_ONLY", inspect.Parameter.empty if d is None else ast.literal_eval(d)))
    return out


def module_parameters(function) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_every_module_name_is_in_the_stub_and_back():
    functions, names = stub_entries()
    public = {n for n in dir(_native) if not n.startswith("_")}
    assert set(functions) == public, "functions in the stub vs the module"
    assert names == {"__version__"} and isinstance(_native.__version__, str)


def test_signatures_match():
    functions, _ = stub_entries()
    for name, node in functions.items():
        assert stub_parameters(node) == module_parameters(getattr(_native, name)), name


def test_the_check_can_fail():
    """The comparison sees a renamed parameter, a missing default and a keyword-only change."""
    node = ast.parse("def f(a, b=None, *, c): ...").body[0]
    assert stub_parameters(node) == [
        ("a", "POSITIONAL_OR_KEYWORD", inspect.Parameter.empty),
        ("b", "POSITIONAL_OR_KEYWORD", None),
        ("c", "KEYWORD_ONLY", inspect.Parameter.empty),
    ]
    assert stub_parameters(node) != module_parameters(_native.read_rows)
