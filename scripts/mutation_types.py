"""mypy as mutmut's type checker, reporting only the errors a mutation causes (scripts/mutation.sh).

    python scripts/mutation_types.py mypy MYPY_ARGS... FILE...

mutmut (`type_check_command`) runs this in its `mutants/` copy of the tree, where every function of a
mutated module is followed by its unmutated copy (`NAME__mutmut_orig`) and its mutants
(`NAME__mutmut_N`). A mutant that mypy refuses is reported "caught by type check" and its tests are
not run: the project's own CI runs the same mypy (scripts/test.sh), so such a bug could never land.

mypy's raw report holds errors no mutation caused, and mutmut would count them against a mutant or
stop on them. Errors outside the generated copies (the trampoline's `# type: ignore` comments, its
imports) are dropped, and so is any error of a mutant that its function's unmutated copy has too (the
same code and message anywhere in `NAME__mutmut_orig`, line numbers aside: a mutation may join a
call's lines, so the line within the function is no guide), such as the copies' repeated
`self.x: T = ...` declarations (`no-redef`). Nor does the layout type an unannotated attribute as the real
file would: the first copy, mutmut's trampoline, holds the original body, so its `self.x = 0` fixes
`x`'s type, and a mutant's `self.x = None` is refused where the real file would re-infer `x` (and then
perhaps refuse another use of it, or not). A mutant whose only errors are of that kind is checked
again as the real file it stands for: the clean module (`../FILE`: mutmut's `mutants/` sits in the
project) with the function replaced by the mutant, given to mypy as a `--shadow-file`; it is caught
only if mypy refuses that file. Only the rest is printed, as mypy's JSON lines, which mutmut parses
because "mypy" is among its command's words.
If mypy itself fails, one line that is not JSON is printed instead: mutmut then stops the part and
shows why, rather than take an empty report for "no mutant caught".
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_MUTANT = re.compile(r"^(?P<base>.+)__mutmut_(?P<n>\d+|orig)$")


@dataclass(frozen=True)
class Span:
    name: str  # the generated function's name: BASE__mutmut_N or BASE__mutmut_orig
    first: int  # its `def` line (1-based)
    last: int


def generated_functions(source: str) -> list[Span]:
    """The mutated file's generated copies (methods included), with their line spans."""
    spans = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _MUTANT.match(node.name):
            assert node.end_lineno is not None
            spans.append(Span(node.name, node.lineno, node.end_lineno))
    return sorted(spans, key=lambda s: s.first)


def _signature(error: dict) -> tuple[str, str]:
    # Line numbers inside messages ("defined on line 128") differ between copies.
    return str(error.get("code")), re.sub(r"\d+", "#", error["message"])


_UNANNOTATED_SELF = re.compile(r"^\s*self\.(\w+)\s*=[^=]")


def _retypes_an_inferred_attribute(error: dict, source: str) -> bool:
    """An assignment error on `self.x = ...` where nothing declares x's type: the layout's, not the
    mutation's (the trampoline's original assignment typed x first)."""
    if error.get("code") != "assignment":
        return False
    match = _UNANNOTATED_SELF.match(source.splitlines()[error["line"] - 1])
    if match is None:
        return False
    declared = re.compile(rf"^\s*(self\.)?{match[1]}\s*:(?!=)", re.MULTILINE)
    return declared.search(source) is None


@dataclass(frozen=True)
class Verdicts:
    caught: list[dict]  # errors the mutations caused
    # mutants whose only errors retype an inferred attribute: (file, mutant, one such error), for
    # `real_source` and a second look
    undecided: list[tuple[str, Span, dict]]


def caused_by_mutations(errors: list[dict], sources: dict[str, str]) -> Verdicts:
    """The errors that lie in a mutant and that its function's unmutated copy does not have."""
    placed: list[tuple[dict, Span]] = []
    for error in errors:
        if error.get("severity") != "error" or error["file"] not in sources:
            continue
        spans = _spans_of(error["file"], sources)
        span = next((s for s in spans if s.first <= error["line"] <= s.last), None)
        if span is not None:
            placed.append((error, span))
    baseline = {
        (error["file"], _base(span), _signature(error)) for error, span in placed if span.name.endswith("__mutmut_orig")
    }
    own = [
        (error, span) for error, span in placed
        if not span.name.endswith("__mutmut_orig") and (error["file"], _base(span), _signature(error)) not in baseline
    ]
    caught = [(e, s) for e, s in own if not _retypes_an_inferred_attribute(e, sources[e["file"]])]
    decided = {(e["file"], s.name) for e, s in caught}
    undecided: dict[tuple[str, str], tuple[str, Span, dict]] = {}
    for error, span in own:
        if (error["file"], span.name) not in decided:
            undecided.setdefault((error["file"], span.name), (error["file"], span, error))
    return Verdicts([e for e, _ in caught], list(undecided.values()))


def real_source(clean: str, layout: str, mutant: Span) -> str:
    """The clean module with the mutated function replaced by `mutant`'s copy from the layout: the file
    that this mutant stands for (as `mutmut apply` would write it)."""
    base = _base(mutant)
    if base.startswith("xǁ"):  # a method: xǁCLASSǁNAME
        _, cls, name = base.split("ǁ")
        holders = [n for n in ast.walk(ast.parse(clean)) if isinstance(n, ast.ClassDef) and n.name == cls]
        body = [stmt for holder in holders for stmt in holder.body]
    else:  # a module-level function: x_NAME
        name, body = base[2:], ast.parse(clean).body
    target = next(n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)
    assert target.end_lineno is not None
    lines = clean.splitlines(keepends=True)
    copy = layout.splitlines(keepends=True)[mutant.first - 1:mutant.last]
    copy[0] = copy[0].replace(mutant.name, name, 1)
    return "".join([*lines[:target.lineno - 1], *copy, *lines[target.end_lineno:]])


_SPANS: dict[str, list[Span]] = {}


def _spans_of(path: str, sources: dict[str, str]) -> list[Span]:
    if path not in _SPANS:
        _SPANS[path] = generated_functions(sources[path])
    return _SPANS[path]


def _base(span: Span) -> str:
    match = _MUTANT.match(span.name)
    assert match is not None
    return match["base"]


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "mypy":
        print("usage: mutation_types.py mypy MYPY_ARGS... FILE...")
        return 2
    args = argv[1:]
    files = [a for a in args if a.endswith(".py")]
    missing = [f for f in files if not Path(f).is_file()]
    if not files or missing:
        print(f"mutation_types.py: no such file to type-check: {' '.join(missing) or '(none given)'}")
        return 2
    done = subprocess.run([sys.executable, "-m", "mypy", "--output", "json", *args], capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 2: mypy itself failed (a bad flag, a crash)
        print(f"mutation_types.py: mypy exited {done.returncode}: {(done.stderr or done.stdout).strip()[-2000:]}")
        return done.returncode
    sources = {f: Path(f).read_text() for f in files}
    verdicts = caused_by_mutations(_errors(done.stdout), sources)
    for error in verdicts.caught:
        print(json.dumps(error))
    for file, mutant, error in verdicts.undecided:
        real = real_source((Path("..") / file).read_text(), sources[file], mutant)
        with tempfile.NamedTemporaryFile("w", suffix=".py") as shadow:
            shadow.write(real)
            shadow.flush()
            again = subprocess.run([sys.executable, "-m", "mypy", "--output", "json", "--shadow-file", file, shadow.name,
                                    *args], capture_output=True, text=True)
        refused = [e for e in _errors(again.stdout) if e["file"] == file and e.get("severity") == "error"]
        if again.returncode not in (0, 1):
            print(f"mutation_types.py: mypy exited {again.returncode} on {mutant.name}: {again.stderr.strip()[-2000:]}")
            return again.returncode
        if refused:  # the error mutmut sees lies in the mutant's copy; the reason is the real file's
            print(json.dumps({**error, "message": f"as the real file: {refused[0]['message']}"}))
    return 0


def _errors(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.strip().startswith("{")]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
