"""Names the CLI offers as choices, without importing torch at parse time (tests/gonka_node/test_cli_help.py
checks them against `training.model.PRESETS` and `training.codecs.CODEC_NAMES`)."""

from __future__ import annotations

import argparse

PRESET_NAMES = ("tiny", "devnet", "10m", "12m", "1b", "8b", "30b")
CODEC_NAMES = ("fp32", "bf16", "int8", "int4", "topk", "mask")
ROUND_STATES = ("carry", "fresh")  # training.inner's RoundState


def add_codec_flag(parser: argparse.ArgumentParser, default: str) -> None:
    """--codec, checked by `codec_name`, its help the recipe field's with every codec named."""
    from gonka_node.core.recipe import recipe_help

    parser.add_argument("--codec", default=default, type=codec_name, metavar="CODEC",
                        help=f"{recipe_help('codec', default)}; NAME one of {', '.join(CODEC_NAMES)}")


def codec_name(text: str) -> str:
    """An argparse type: a codec name with options that `get_codec` accepts (the error names the choices)."""
    from training.codecs import get_codec

    try:
        get_codec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text
