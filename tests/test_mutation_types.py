"""scripts/mutation_types.py: which of mypy's errors in a mutated file are a mutant's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from scripts.mutation_types import caused_by_mutations, generated_functions

# The layout mutmut writes: the trampoline (the original body, first), then each function's unmutated
# copy and its mutants, side by side.
MUTATED = textwrap.dedent(
    """\
    class Engine:
        def __init__(self) -> None:
            self.closing: bool = False
            self.count = 0
        def x__init____mutmut_orig(self) -> None:
            self.closing: bool = False
            self.count = 0
        def x__init____mutmut_1(self) -> None:
            self.closing: bool = None
            self.count = 0
        def x__init____mutmut_2(self) -> None:
            self.closing: bool = False
            self.count = None


    def x_total__mutmut_orig(rows: list[int]) -> int:
        return sum(
            rows
        )


    def x_total__mutmut_1(rows: list[int]) -> int:
        return sum(None)


    def x_total__mutmut_2(rows: list[int]) -> int:
        return sum(rows) + 1
    """
)
SCRIPT = Path(__file__).parents[1] / "scripts" / "mutation_types.py"


def _error(line: int, code: str, message: str, file: str = "m.py") -> dict:
    return {"file": file, "line": line, "column": 0, "message": message, "code": code, "severity": "error"}


def test_the_generated_copies_are_found_with_their_spans() -> None:
    spans = [(s.name, s.first, s.last) for s in generated_functions(MUTATED)]
    assert spans == [
        ("x__init____mutmut_orig", 5, 7),
        ("x__init____mutmut_1", 8, 10),
        ("x__init____mutmut_2", 11, 13),
        ("x_total__mutmut_orig", 16, 19),
        ("x_total__mutmut_1", 22, 23),
        ("x_total__mutmut_2", 26, 27),
    ]


def test_only_errors_a_mutation_caused_are_kept() -> None:
    errors = [
        # the copies' repeated attribute declarations: the layout's, not a mutant's
        _error(6, "no-redef", 'Attribute "closing" already defined on line 3'),
        _error(9, "no-redef", 'Attribute "closing" already defined on line 3'),
        # the mutant's own error: None for a declared bool
        _error(9, "assignment", 'Incompatible types in assignment (expression has type "None", variable has type "bool")'),
        # None for an attribute whose type only the trampoline's `self.count = 0` inferred: the real file
        # would re-infer it, so the tests decide
        _error(13, "assignment", 'Incompatible types in assignment (expression has type "None", variable has type "int")'),
        # an error the unmutated copy has too, on another line of the function (the mutant joined the
        # call's three lines into one): not the mutant's
        _error(18, "misc", "Something the original has at line 18"),
        _error(23, "misc", "Something the original has at line 23"),
        # the mutant's own, on the line of the original's error
        _error(23, "arg-type", 'Argument 1 to "sum" has incompatible type "None"'),
        # outside every generated function (the trampoline's imports and ignores), or in another file
        _error(1, "unused-ignore", 'Unused "type: ignore" comment'),
        _error(3, "import-not-found", 'Cannot find implementation or library stub for module named "mutmut"'),
        _error(9, "assignment", "an error in a file that is not mutated", file="other.py"),
        {**_error(27, "misc", "a note"), "severity": "note"},
    ]
    kept = caused_by_mutations(errors, {"m.py": MUTATED})
    assert [(e["line"], e["code"]) for e in kept] == [(9, "assignment"), (23, "arg-type")]


def test_a_real_mypy_run_reports_the_mutants_it_refuses_and_not_the_others(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(MUTATED)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "mypy", "--no-incremental", "--strict", "m.py"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    lines = sorted({json.loads(line)["line"] for line in done.stdout.splitlines()})
    # __init__'s first mutant (None for a bool) and total's first (sum of None); not __init__'s second
    # (an inferred attribute), nor total's second (+ 1 type-checks), nor the copies' repeated declarations.
    assert lines == [9, 23], done.stdout


def test_a_failed_mypy_run_prints_a_line_mutmut_cannot_parse(tmp_path: Path) -> None:
    # mutmut takes an empty report for "nothing caught"; a line that is not JSON stops the part instead.
    (tmp_path / "m.py").write_text(MUTATED)
    for args in (["--no-such-flag", "m.py"], ["gone.py"]):
        done = subprocess.run([sys.executable, str(SCRIPT), "mypy", *args], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout.startswith("mutation_types.py: "), done.stdout
