"""What the interpreters kvserve allows (``requires-python``) refuse in source that the one CI runs accepts."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted(p for folder in ("kvserve", "tests", "benchmarks") for p in (ROOT / folder).rglob("*.py"))


def _docstrings(tree: ast.Module) -> list[tuple[int, str]]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    found = []
    for node in nodes:
        text = ast.get_docstring(node, clean=False)
        if text is not None:
            found.append((getattr(node, "lineno", 1), text))
    return found


def test_every_docstring_is_valid_utf8() -> None:
    """Python 3.13 encodes docstrings as strict UTF-8 when it compiles them: a lone surrogate escape in one (a
    ``"\\ud800"`` written without its backslash doubled) made kvserve's grammar module fail to import there,
    where 3.11 and 3.12 take it."""
    offending = []
    for path in SOURCES:
        for line, text in _docstrings(ast.parse(path.read_text(encoding="utf-8"))):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as error:
                offending.append(f"{path.relative_to(ROOT)}:{line} holds {text[error.start]!r}")
    assert not offending, f"docstrings Python 3.13 cannot compile (double the escape's backslash): {offending}"
