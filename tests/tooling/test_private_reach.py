"""No backend reaches into the communicator's side: a transport gets what it needs through its
CallContext (``transport.context``) or what it is handed, and never reads an attribute of the
communicator, its CallCheck or its context that starts with ``_``. Read from the code (every
attribute access, not only the imports), so it also holds where the two never import each other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: What names the communicator's side in a backend: the communicator, its CallCheck, its
#: context (a name, an attribute of that name, or an annotation naming the type).
SIDE_NAMES = {"communicator", "call_check", "context", "callcheck", "call_context"}
SIDE_TYPES = ("Communicator", "CallCheck", "CommunicatorContext", "CallContext")


def _annotated(annotation: ast.expr | None) -> bool:
    """Whether an annotation names one of SIDE_TYPES."""
    return annotation is not None and re.search(rf"\b({'|'.join(SIDE_TYPES)})\b", ast.unparse(annotation)) is not None


def private_reads(source: str) -> list[str]:
    """The places of ``source`` where an attribute starting with ``_`` (not a dunder) is read of
    the communicator, its CallCheck or its context: ``line: expression``."""
    tree = ast.parse(source)
    found = []
    for scope in ast.walk(tree):
        if not isinstance(scope, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        side = set(SIDE_NAMES)  # (names bound to the communicator's side in this scope)
        if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)):
            arguments = scope.args.posonlyargs + scope.args.args + scope.args.kwonlyargs
            side |= {a.arg for a in arguments if _annotated(a.annotation)}
        for node in ast.walk(scope):  # aliases: ``x = call_check`` / ``x = self.context`` / ``x: CallCheck = ...``
            if isinstance(node, ast.Assign) and _is_side(node.value, side):
                side |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and (
                    _annotated(node.annotation) or (node.value is not None and _is_side(node.value, side))):
                side.add(node.target.id)
        for node in ast.walk(scope):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and _is_side(node.value, side)):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda line: (int(line.split(":")[0]), line))


def _is_side(node: ast.expr, side: set[str]) -> bool:
    """Whether ``node`` names the communicator's side: one of ``side``, or an attribute of that
    name (``self.context``, ``comm.call_check``)."""
    if isinstance(node, ast.Name):
        return node.id in side
    if isinstance(node, ast.Attribute):  # (``context.comm``: the communicator)
        return node.attr in SIDE_NAMES or (node.attr == "comm" and _is_side(node.value, side))
    return False


def test_no_backend_reads_a_private_attribute_of_the_communicator_its_check_or_its_context() -> None:
    found = {str(path.relative_to(ROOT)): reads for path in sorted((ROOT / "backends").rglob("*.py"))
             if (reads := private_reads(path.read_text()))}
    assert found == {}


def test_the_reader_sees_the_reaches_it_is_meant_to_see() -> None:
    # (the shapes of reach the test above forbids, each found; public reads and a transport's own are not)
    source = '''
def word_check(self, call_check):
    return CheckedWord(call_check, call_check._comm, self._compiled_round, call_check._fast_bit)

def hooked(self, check: CallCheck, ctx: "CommunicatorContext"):
    alias = self.context
    return check._hashes, ctx.comm._seq, alias._transport, self.context._farewells, self.context.call

def fine(self, comm, transport: Transport):
    return self._comm.Iallgather, comm.Get_rank(), transport._agree_word, self.context.call
'''
    assert private_reads(source) == [
        "3: call_check._comm", "3: call_check._fast_bit", "7: alias._transport", "7: check._hashes",
        "7: ctx.comm._seq", "7: self.context._farewells"]
