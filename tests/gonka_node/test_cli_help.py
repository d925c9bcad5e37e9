"""Every verb's --help: examples, a "next:" line, help on every flag; --version; choices listed."""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterator

import pytest

from gonka_node.cli import VERB_MODULES, build_parser, main, version
from gonka_node.cli.names import CODEC_NAMES, PRESET_NAMES, ROUND_STATES
from training.codecs import CODEC_NAMES as TRAINING_CODECS
from training.inner import RoundState
from training.model import PRESETS


def leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield " ".join(path), parser
    for action in subs:
        for name, child in action.choices.items():
            yield from leaves(child, (*path, name))


def test_every_verb_has_examples_a_next_step_and_help_on_every_flag() -> None:
    verbs = dict(leaves(build_parser()))
    assert {"run", "rewards", "status", "stake withdraw", "transfer", "gov build-spec", "gov check-spec",
            "gov treasury-deposit", "gov proposals", "init host", "init aggregator", "init epoch",
            "checkpoint list", "devnet", "chain serve"} <= set(verbs)
    for name, parser in verbs.items():
        epilog = parser.epilog or ""
        assert "examples:\n  gonka-node " in epilog, name
        assert "\nnext: " in epilog and epilog.rstrip().split("\nnext: ")[1].strip(), name
        for action in parser._actions:
            if action.option_strings:
                assert action.help, f"{name} {action.option_strings[0]} has no help"
        assert "--debug" in parser.format_help(), name


def test_version_and_debug_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"gonka-node {version()}"
    assert version() != "unknown"


def test_presets_and_codecs_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    verbs = dict(leaves(build_parser()))
    for name in ("devnet", "train", "checkpoint export", "init epoch"):
        text = verbs[name].format_help()
        assert all(p in text for p in PRESETS), name
    assert "fp32, bf16, int8, int4, topk, mask" in " ".join(verbs["devnet"].format_help().split())
    assert main(["devnet", "--codec", "int9"]) == 2
    assert "unknown codec 'int9'; choose one of fp32, bf16, int8, int4, topk, mask" in capsys.readouterr().err
    assert main(["devnet", "--preset", "huge"]) == 2
    assert "invalid choice: 'huge'" in capsys.readouterr().err


def test_the_verb_map_and_the_names_match_what_they_stand_for() -> None:
    full = build_parser()
    (sub,) = [a for a in full._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(sub.choices) == set(VERB_MODULES)
    for verb, module in VERB_MODULES.items():
        (alone,) = [a for a in build_parser(verb)._actions if isinstance(a, argparse._SubParsersAction)]
        assert verb in alone.choices, (verb, module)
    assert set(PRESET_NAMES) == set(PRESETS) and CODEC_NAMES == TRAINING_CODECS
    assert typing.get_args(RoundState) == ROUND_STATES


@pytest.mark.parametrize("verb", [["train"], ["devnet"], ["init", "epoch"]])
def test_every_codec_is_named_in_the_codec_flags_help(verb: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*verb, "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "NAME one of " + ", ".join(TRAINING_CODECS) in text
