"""core.cli: parsers built from option dataclasses, and field-named errors re-worded with their flags."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from toolkit.core.cli import flag_of, option, parser, run
from toolkit.core.errors import OptionError, ToolkitError


@dataclass
class Opts:
    prompt: str = option(help="the user message")
    target: str | None = option(None, "target folder")
    block_sizes: list[int] = option([8, 16], "verify widths")
    check: bool = option(True, "compare with the reference")
    out_dir: str = option("out", "the run folder", flag="--from")
    quiet: bool = option(False, "no progress bar")
    src: str = option("", "source", positional=True)


def test_parser_takes_types_defaults_and_flags_from_the_dataclass():
    ap = parser(Opts, "prog")
    a = vars(ap.parse_args(["S", "--prompt", "hi", "--block-sizes", "4", "8", "--no-check", "--from", "d"]))
    assert a == {"prompt": "hi", "target": None, "block_sizes": [4, 8], "check": False, "out_dir": "d", "quiet": False, "src": "S"}
    assert vars(ap.parse_args(["S", "--prompt", "x"]))["block_sizes"] == [8, 16]
    text = ap.format_help()
    assert "verify widths (default 8 16)" in text and "--no-check" in text and "--from" in text


def test_required_field_is_required_on_the_command_line(capsys):
    with pytest.raises(SystemExit) as e:
        parser(Opts, "prog").parse_args(["S"])
    assert e.value.code == 2 and "--prompt" in capsys.readouterr().err


def test_option_error_names_the_field_in_python_and_the_flag_on_the_command_line():
    def fn(**kw):
        raise OptionError("out_dir", "is not a folder")

    with pytest.raises(OptionError, match="^out_dir is not a folder$"):
        fn()
    with pytest.raises(ToolkitError, match="^--from is not a folder$"):
        run(fn, Opts, ["S", "--prompt", "x"], "prog")
    assert flag_of(Opts, "block_sizes") == "--block-sizes" and flag_of(Opts, "src") == "SRC"


def test_run_calls_the_function_with_the_parsed_fields():
    got = run(lambda **kw: kw, Opts, ["S", "--prompt", "x", "--quiet"], "prog")
    assert got["quiet"] is True and got["prompt"] == "x" and got["src"] == "S"
