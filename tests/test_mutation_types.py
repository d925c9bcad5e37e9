"""scripts/mutation_types.py: which of mypy's errors in a mutated file are a mutant's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from scripts.mutation_types import caused_by_mutations, generated_functions, real_source

# The layout mutmut writes: the trampoline (the original body, first), then each function's unmutated
# copy and its mutants, side by side.
MUTATED = textwrap.dedent(
    """\
    class Engine:
        def __init__(self) -> None:
            self.closing: bool = False
            self.count = 0
            self.label = "a"
        def xǁEngineǁ__init____mutmut_orig(self) -> None:
            self.closing: bool = False
            self.count = 0
            self.label = "a"
        def xǁEngineǁ__init____mutmut_1(self) -> None:
            self.closing: bool = None
            self.count = 0
            self.label = "a"
        def xǁEngineǁ__init____mutmut_2(self) -> None:
            self.closing: bool = False
            self.count = None
            self.label = "a"
        def xǁEngineǁ__init____mutmut_3(self) -> None:
            self.closing: bool = False
            self.count = 0
            self.label = None
        def bump(self) -> None:
            self.count += 1


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
# The module the layout stands for (mutmut's mutants/ sits in the project, beside it).
CLEAN = textwrap.dedent(
    """\
    class Engine:
        def __init__(self) -> None:
            self.closing: bool = False
            self.count = 0
            self.label = "a"
        def bump(self) -> None:
            self.count += 1


    def total(rows: list[int]) -> int:
        return sum(
            rows
        )
    """
)
SCRIPT = Path(__file__).parents[1] / "scripts" / "mutation_types.py"


def _error(line: int, code: str, message: str, file: str = "m.py") -> dict:
    return {"file": file, "line": line, "column": 0, "message": message, "code": code, "severity": "error"}


def test_the_generated_copies_are_found_with_their_spans() -> None:
    spans = [(s.name, s.first, s.last) for s in generated_functions(MUTATED)]
    assert spans == [
        ("xǁEngineǁ__init____mutmut_orig", 6, 9),
        ("xǁEngineǁ__init____mutmut_1", 10, 13),
        ("xǁEngineǁ__init____mutmut_2", 14, 17),
        ("xǁEngineǁ__init____mutmut_3", 18, 21),
        ("x_total__mutmut_orig", 26, 29),
        ("x_total__mutmut_1", 32, 33),
        ("x_total__mutmut_2", 36, 37),
    ]


def test_only_errors_a_mutation_caused_are_kept() -> None:
    errors = [
        # the copies' repeated attribute declarations: the layout's, not a mutant's
        _error(7, "no-redef", 'Attribute "closing" already defined on line 3'),
        _error(11, "no-redef", 'Attribute "closing" already defined on line 3'),
        # the mutant's own error: None for a declared bool
        _error(11, "assignment", 'Incompatible types in assignment (expression has type "None", variable has type "bool")'),
        # None for attributes whose type only the trampoline's first assignment inferred: undecided
        _error(16, "assignment", 'Incompatible types in assignment (expression has type "None", variable has type "int")'),
        _error(21, "assignment", 'Incompatible types in assignment (expression has type "None", variable has type "str")'),
        # an error the unmutated copy has too, on another line of the function (the mutant joined the
        # call's three lines into one): not the mutant's
        _error(28, "misc", "Something the original has at line 28"),
        _error(33, "misc", "Something the original has at line 33"),
        # the mutant's own, on the line of the original's error
        _error(33, "arg-type", 'Argument 1 to "sum" has incompatible type "None"'),
        # outside every generated function (the trampoline's imports and ignores), or in another file
        _error(1, "unused-ignore", 'Unused "type: ignore" comment'),
        _error(3, "import-not-found", 'Cannot find implementation or library stub for module named "mutmut"'),
        _error(11, "assignment", "an error in a file that is not mutated", file="other.py"),
        {**_error(37, "misc", "a note"), "severity": "note"},
    ]
    verdicts = caused_by_mutations(errors, {"m.py": MUTATED})
    assert [(e["line"], e["code"]) for e in verdicts.caught] == [(11, "assignment"), (33, "arg-type")]
    assert [(f, span.name, e["line"]) for f, span, e in verdicts.undecided] == [
        ("m.py", "xǁEngineǁ__init____mutmut_2", 16), ("m.py", "xǁEngineǁ__init____mutmut_3", 21),
    ]


def test_an_undecided_mutant_stands_for_the_clean_module_with_its_function_replaced() -> None:
    mutant = next(s for s in generated_functions(MUTATED) if s.name == "xǁEngineǁ__init____mutmut_2")
    assert real_source(CLEAN, MUTATED, mutant) == CLEAN.replace("self.count = 0", "self.count = None")
    total = next(s for s in generated_functions(MUTATED) if s.name == "x_total__mutmut_1")
    assert real_source(CLEAN, MUTATED, total) == CLEAN.replace("sum(\n        rows\n    )", "sum(None)")


def test_a_real_mypy_run_reports_the_mutants_it_refuses_and_not_the_others(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(CLEAN)
    (tmp_path / "mutants").mkdir()
    (tmp_path / "mutants" / "m.py").write_text(MUTATED)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "mypy", "--no-incremental", "--strict", "m.py"],
        cwd=tmp_path / "mutants", capture_output=True, text=True, check=True,
    )
    lines = sorted({json.loads(line)["line"] for line in done.stdout.splitlines()})
    # __init__'s first mutant (None for a bool); its second (`count = None`: the real file then refuses
    # `bump`'s `+= 1`); total's first (sum of None). Not __init__'s third (`label = None`: nothing else
    # uses it, so the real file passes), nor total's second (+ 1 type-checks), nor the copies'
    # repeated declarations.
    assert lines == [11, 16, 33], done.stdout


def test_a_failed_mypy_run_prints_a_line_mutmut_cannot_parse(tmp_path: Path) -> None:
    # mutmut takes an empty report for "nothing caught"; a line that is not JSON stops the part instead.
    (tmp_path / "m.py").write_text(MUTATED)
    for args in (["--no-such-flag", "m.py"], ["gone.py"]):
        done = subprocess.run([sys.executable, str(SCRIPT), "mypy", *args], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout.startswith("mutation_types.py: "), done.stdout
