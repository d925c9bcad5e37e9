"""scripts/mutation_types.py: which of mypy's errors in a mutated file are a mutant's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from scripts.mutation_types import caused_by_mutations, generated_functions

# The layout mutmut writes: each function's unmutated copy and its mutants, side by side.
MUTATED = textwrap.dedent(
    """\
    class Engine:
        def x__init____mutmut_orig(self) -> None:
            self.closing: bool = False
            self.rows: list[int] = []

        def x__init____mutmut_1(self) -> None:
            self.closing: bool = None
            self.rows: list[int] = []


    def x_total__mutmut_orig(rows: list[int]) -> int:
        return sum(rows)


    def x_total__mutmut_1(rows: list[int]) -> int:
        return sum(None)


    def x_total__mutmut_2(rows: list[int]) -> int:
        return sum(rows) + 1
    """
)


def _error(line: int, code: str, message: str, file: str = "m.py") -> dict:
    return {"file": file, "line": line, "column": 0, "message": message, "code": code, "severity": "error"}


def test_the_generated_copies_are_found_with_their_spans() -> None:
    spans = [(s.name, s.first, s.last) for s in generated_functions(MUTATED)]
    assert spans == [
        ("x__init____mutmut_orig", 2, 4),
        ("x__init____mutmut_1", 6, 8),
        ("x_total__mutmut_orig", 11, 12),
        ("x_total__mutmut_1", 15, 16),
        ("x_total__mutmut_2", 19, 20),
    ]


def test_only_errors_a_mutation_caused_are_kept() -> None:
    errors = [
        # the copies' repeated attribute declarations: the layout's, not a mutant's
        _error(7, "no-redef", 'Attribute "closing" already defined on line 3'),
        _error(8, "no-redef", 'Attribute "rows" already defined on line 4'),
        # the mutant's own error
        _error(7, "assignment", 'Incompatible types in assignment (expression has type "None", variable has type "bool")'),
        # an error the unmutated copy has too, at the same line of its function: not the mutant's
        _error(12, "misc", "Something the original has at line 12"),
        _error(16, "misc", "Something the original has at line 16"),
        # the mutant's own, on a line whose original has another error
        _error(16, "arg-type", 'Argument 1 to "sum" has incompatible type "None"'),
        # outside every generated function (the trampoline's imports and ignores), or in another file
        _error(1, "unused-ignore", 'Unused "type: ignore" comment'),
        _error(1, "import-not-found", 'Cannot find implementation or library stub for module named "mutmut"'),
        _error(7, "assignment", "an error in a file that is not mutated", file="other.py"),
        {**_error(20, "misc", "a note"), "severity": "note"},
    ]
    kept = caused_by_mutations(errors, {"m.py": MUTATED})
    assert [(e["line"], e["code"]) for e in kept] == [(7, "assignment"), (16, "arg-type")]


def test_a_real_mypy_run_reports_the_mutants_it_refuses_and_not_the_others(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(MUTATED)
    script = Path(__file__).parents[1] / "scripts" / "mutation_types.py"
    done = subprocess.run(
        [sys.executable, str(script), "mypy", "--no-incremental", "--strict", "m.py"],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    )
    lines = sorted({json.loads(line)["line"] for line in done.stdout.splitlines()})
    # __init__'s mutant (None for a bool) and total's first (sum of None); not the second (+ 1 type-checks),
    # nor the copies' repeated declarations.
    assert lines == [7, 16], done.stdout
