"""The package's shape, checked from its source: only ``fasttrain.integration`` touches a Trainer.

An AST scan of every module of the package (no import, nothing run):

- the library (``optim/``, ``loss/``, ``data/``, the kernels and the top-level helpers) never names a trainer: no
  variable, parameter or attribute called ``trainer``, no ``*Trainer`` class of transformers' or TRL's;
- ``fasttrain.Trainer`` is the Trainer's ``__init__`` and then ``integration.apply``, and ``patch()``'s ``__init__``
  the same: the instance is handed to ``apply`` (or the original ``__init__``, or ``isinstance``) and nothing
  else is read from it or written to it;
- ``fasttrain bench`` (``bench/``, ``cli.py``) drives Trainers as a user script does: it reads their public state
  but writes no attribute and calls nothing private on them;
- a framework's plugin (``integrations/``: Axolotl's) hands the trainer the framework built to ``integration``
  and does nothing else with it.

The scan runs over a copy of the source given as text, so the same function is tested on snippets that break each
rule (a scan that found nothing in any case would pass on anything).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "fasttrain"
USER_SIDE = ("bench/", "cli.py")
ENTRY_POINTS = ("trainer.py", "patching.py")
PLUGINS = ("integrations/",)
EXEMPT = ("integration/", *USER_SIDE, *ENTRY_POINTS, *PLUGINS)


def _is_trainer_class(name: str) -> bool:
    return name.endswith("Trainer") and name != "BpeTrainer"  # tokenizers' BPE trainer trains a tokenizer


def library_violations(source: str, where: str) -> list[str]:
    """Places where a library module names a trainer."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = f"{where}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Name) and node.id == "trainer":
            found.append(f"{line} uses a variable `trainer`")
        elif isinstance(node, ast.arg) and node.arg == "trainer":
            found.append(f"{line} takes a parameter `trainer`")
        elif isinstance(node, ast.Attribute) and (node.attr == "trainer" or _is_trainer_class(node.attr)):
            found.append(f"{line} reads `.{node.attr}`")
        elif (
            isinstance(node, ast.ImportFrom)
            and (node.level, node.module) != (1, "trainer")  # the package re-exporting fasttrain.Trainer
            and any(_is_trainer_class(a.name) for a in node.names)
        ):
            found.append(
                f"{line} imports {', '.join(a.name for a in node.names if _is_trainer_class(a.name))}"
            )
    return found


_HANDED_TO = {"apply", "original", "isinstance"}  # what an entry point may hand the trainer instance to


def entry_point_violations(source: str, where: str) -> list[str]:
    """Places where ``fasttrain.Trainer`` or ``patch()``'s ``__init__`` does more with the instance than hand it on."""
    tree = ast.parse(source)
    found = []
    handed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in _HANDED_TO:
                handed.update(id(a) for a in node.args if isinstance(a, ast.Name) and a.id == "self")
        if isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Attribute) and b.attr == "Trainer" for b in node.bases
        ):
            extra = [f.name for f in node.body if isinstance(f, ast.FunctionDef) and f.name != "__init__"]
            if extra:
                found.append(f"{where}:{node.lineno} class {node.name} defines {extra} besides __init__")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "self" and id(node) not in handed:
            found.append(
                f"{where}:{node.lineno} uses the trainer instance beyond handing it to {sorted(_HANDED_TO)}"
            )
    return found


def plugin_violations(source: str, where: str) -> list[str]:
    """Places where a plugin uses the trainer a framework built other than handing it to ``integration.<f>``."""
    tree = ast.parse(source)
    handed = set()
    for node in ast.walk(tree):
        func = getattr(node, "func", None)
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "integration"
        ):
            handed.update(id(a) for a in node.args if isinstance(a, ast.Name) and a.id == "trainer")
    return [
        f"{where}:{node.lineno} uses the trainer beyond handing it to fasttrain.integration"
        for node in ast.walk(tree)
        if isinstance(node, ast.Name) and node.id == "trainer" and id(node) not in handed
    ]


def user_side_violations(source: str, where: str) -> list[str]:
    """Places where the bench writes to a trainer or calls something private on it."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "trainer"
        ):
            continue
        if isinstance(node.ctx, (ast.Store, ast.Del)):
            found.append(f"{where}:{node.lineno} sets trainer.{node.attr}")
        elif node.attr.startswith("_"):
            found.append(f"{where}:{node.lineno} reads trainer.{node.attr}")
    return found


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_the_package_is_scanned():
    names = [name for name, _ in _modules()]
    assert (
        "integration/__init__.py" in names and "loss/trl_support.py" in names and "data/packing.py" in names
    )
    assert any(n.startswith("bench/") for n in names) and "trainer.py" in names


def test_only_the_integration_touches_a_trainer():
    found = []
    for name, source in _modules():
        if name.startswith(USER_SIDE):
            found += user_side_violations(source, name)
        elif name in ENTRY_POINTS:
            found += entry_point_violations(source, name)
        elif name.startswith(PLUGINS):
            found += plugin_violations(source, name)
        elif not name.startswith(EXEMPT):
            found += library_violations(source, name)
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "snippet",
    [
        "def token_budget_loader(trainer, n):\n    return trainer._remove_unused_columns(n)\n",
        "from trl import DPOTrainer, SFTTrainer\n",
        "import transformers\nowner = transformers.Trainer\n",
        "def hook(model, trainer=None):\n    pass\n",
    ],
)
def test_the_library_rule_catches(snippet):
    assert library_violations(snippet, "x.py")


@pytest.mark.parametrize(
    "snippet",
    [
        # before the redesign: fasttrain.Trainer kept an attribute and overrode get_train_dataloader
        "class Trainer(transformers.Trainer):\n    def __init__(self, n=None):\n        self.n = n\n"
        "        super().__init__()\n        integration.apply(self)\n"
        "    def get_train_dataloader(self):\n        return super().get_train_dataloader()\n",
        "def __init__(self, *a):\n    original(self, *a)\n    self.compute_loss = None\n",
    ],
)
def test_the_entry_point_rule_catches(snippet):
    assert entry_point_violations(snippet, "x.py")


def test_the_entry_point_rule_allows_handing_on():
    ok = (
        "class Trainer(transformers.Trainer):\n    def __init__(self, *a, hot_paths=None, **k):\n"
        "        super().__init__(*a, **k)\n        integration.apply(self, hot_paths)\n"
    )
    assert entry_point_violations(ok, "x.py") == []


@pytest.mark.parametrize(
    "snippet",
    [
        "def post_trainer_create(self, cfg, trainer):\n    trainer.optimizer = None\n",
        "def post_trainer_create(self, cfg, trainer):\n    helper(trainer)\n",
    ],
)
def test_the_plugin_rule_catches(snippet):
    assert plugin_violations(snippet, "x.py")


def test_the_plugin_rule_allows_handing_on():
    ok = "def post_trainer_create(self, cfg, trainer):\n    integration.apply_from_plugin(trainer, paths)\n"
    assert plugin_violations(ok, "x.py") == []


@pytest.mark.parametrize("snippet", ["trainer.model_init = f\n", "trainer._get_train_sampler()\n"])
def test_the_user_side_rule_catches(snippet):
    assert user_side_violations(snippet, "x.py")


def test_no_file_of_the_integration_is_long():
    lengths = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "integration").glob("*.py")}
    assert max(lengths.values()) <= 300, lengths
