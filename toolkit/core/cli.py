"""Command lines built from option dataclasses: one source per option, shared by the command line and its function.

A command declares its options once, as a dataclass whose fields carry their help in `option(...)` and, for
numbers and devices, their domain (`lo`, `hi`, `above`, `kind`); `parser()` turns it into an argparse parser and
`run()` checks every parsed value against its field's domain (`check_options`) before calling the command's
function with them (as keywords: a function that takes the options object is handed over as
`lambda **kw: f(Options(**kw))`); a string option must not be empty or hold bytes that are not UTF-8. Libraries raise
`OptionError(field, message)` naming the *field*; `run` prints it with the field's flag, so the same error reads
`--max-new-tokens must be >= 1` on the command line and `max_new_tokens must be >= 1` from Python.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
import types
import typing
from typing import Any, Callable

from .errors import OptionError, ToolkitError, run_cli

INT_MAX = 2**31 - 1          # no count, size or index of the toolkit's options comes near it
FLOAT_MAX = 1e9              # nor any float (seconds, minutes, temperatures, gigabytes)
SEED_MAX = 2**63 - 1         # torch.manual_seed takes a signed 64-bit value
DEVICES = {"device": r"cpu|cuda|cuda:\d+|mps", "device_auto": r"auto|cpu|cuda|cuda:\d+|mps",
           "device_index": r"cpu|cuda|cuda:\d+|\d+"}


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values an option may take: for a number [lo, hi] (and > `above`), finite; `kind` "seed", a device kind
    of DEVICES, or "text" for a string that may be empty (any other string option must not be)."""

    lo: float | None = None
    hi: float | None = None
    above: float | None = None
    kind: str = ""
    whole: bool = False          # a float option that takes whole values only (e.g. bits 1-8)


OUTPUT_POLICY = ("Outputs: a non-empty folder that is not this command's own earlier output is refused unless --force; "
                 "nothing it did not write is deleted; --force replaces only once the new output is complete (docs/outputs.md).")


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors end stderr with the house's one line, `error: ...`, and exit 2."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def option(default: Any = dataclasses.MISSING, help: str = "", *, flag: str | None = None, short: str | None = None,
           choices: typing.Sequence | None = None, metavar: str | None = None, positional: bool = False,
           group: str | None = None, negatable: bool = False, lo: float | None = None, hi: float | None = None,
           above: float | None = None, kind: str = "", whole: bool = False) -> Any:
    """A dataclass field that is also a command-line option (flag defaults to --field-name); `lo`, `hi`, `above`,
    `kind` and `whole` declare its domain, checked by `check_options` before the command runs."""
    meta = {"help": help, "flag": flag, "short": short, "choices": choices, "metavar": metavar,
            "positional": positional, "group": group, "negatable": negatable,
            "domain": Domain(0, SEED_MAX, kind=kind) if kind == "seed" else Domain(lo, hi, above, kind, whole)}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def domain_of(cls: type, name: str) -> Domain:
    """The domain a field of an options dataclass declares (every value allowed when it declares none)."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("domain") or Domain()


def like(cls: type, name: str, default: Any = dataclasses.MISSING, help: str = "") -> Any:
    """An option with the domain of `cls`'s field `name` (its default too, unless given): one source for a value
    that several commands take, such as GenSettings' temperature."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    d = domain_of(cls, name)
    return option(f.default if default is dataclasses.MISSING else default, help or f.metadata.get("help", ""),
                  lo=d.lo, hi=d.hi, above=d.above, kind=d.kind, whole=d.whole)


def flag_of(cls: type, name: str) -> str:
    """The command-line spelling of a field of an options dataclass."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.metadata.get("positional"):
                return f.name.upper()
            return f.metadata.get("flag") or "--" + name.replace("_", "-")
    return "--" + name.replace("_", "-")


def _base(tp) -> tuple[type, bool, bool]:
    """(element type, optional, is_list) of a field annotation such as `int | None` or `list[float]`."""
    optional = False
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        tp = args[0] if len(args) == 1 else str
        origin = typing.get_origin(tp)
    if origin in (list, tuple, typing.Sequence):
        return (typing.get_args(tp) or (str,))[0], optional, True
    return tp, optional, False


def _num(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def rule_broken(value, d: Domain, integer: bool) -> str | None:
    """The rule of the domain that `value` breaks ("a finite number", ">= 1", "from 0 to 3", ...), or None.
    An undeclared bound is INT_MAX or FLOAT_MAX: nothing the toolkit counts comes near it."""
    cap = INT_MAX if integer else FLOAT_MAX
    lo, hi = (d.lo if d.lo is not None else -cap), (d.hi if d.hi is not None else cap)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        return "a whole number" if integer else "a number"
    if not math.isfinite(value):
        return "a finite number"
    if d.above is not None and not value > d.above:
        return f"> {_num(d.above)}"
    if d.whole and (not float(value).is_integer() or not lo <= value <= hi):
        return f"an integer from {_num(lo)} to {_num(hi)}"
    if not lo <= value <= hi:
        return (f"from {_num(lo)} to {_num(hi)}" if d.lo is not None and d.hi is not None
                else f">= {_num(lo)}" if value < lo else f"<= {_num(hi)}")
    return None


def check_number(field: str, value, d: Domain, integer: bool, many: list | None = None) -> None:
    """One value against its domain: one OptionError naming the field and the rule (with `many`, the list the
    value came from: "must be integers >= 1, got [0]")."""
    rule = rule_broken(value, d, integer)
    if rule is None:
        return
    if many is None:
        raise OptionError(field, f"must be {rule}, got {value!r}")
    kind = "integers" if integer else "numbers"
    plural = {"a whole number": "integers", "a number": "numbers", "a finite number": f"finite {kind}"}
    raise OptionError(field, f"must be {plural.get(rule, f'{kind} {rule}')}, got {many}")


def check_device(field: str, value, kind: str) -> None:
    """A device string of its kind's form, and one this machine has (`cuda` without a GPU is refused here)."""
    from . import checks

    if not isinstance(value, str) or not re.fullmatch(DEVICES[kind], value):
        forms = DEVICES[kind].replace("\\d+", "N").replace("|", ", ")
        raise OptionError(field, f"{value!r} is not a device: use one of {forms}")
    if value != "auto" and not value.isdigit():
        checks.device(field, value)
    elif value.isdigit():
        checks.device(field, f"cuda:{value}")


def valid_text(text: str) -> bool:
    """No undecodable byte (argv that is not UTF-8 arrives as lone surrogates) and no NUL."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


def check_options(cls: type, values: dict) -> None:
    """Every parsed value of the options dataclass `cls` against its field's domain (None: not given)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        value = values.get(f.name)
        if value is None:
            continue
        d = f.metadata.get("domain") or Domain()
        tp, _, many = _base(hints[f.name])
        texts = [v for v in (value if many else [value]) if isinstance(v, str)]
        if tp is str and d.kind != "text" and any(not v.strip() for v in texts):
            raise OptionError(f.name, "is empty")               # an unset shell variable, never a path or a name
        bad = next((v for v in texts if not valid_text(v)), None)
        if bad is not None:
            raise OptionError(f.name, f"is not UTF-8 text: {ascii(bad)[:80]}")
        if d.kind in DEVICES:
            check_device(f.name, value, d.kind)
        elif tp in (int, float):
            for v in (value if many else [value]):
                check_number(f.name, v, d, tp is int, list(value) if many else None)


def check_values(cls: type, values: dict) -> None:
    """check_options for a command function called from Python: the error names the flag, as on the command line."""
    try:
        check_options(cls, values)
    except OptionError as e:
        raise ToolkitError(f"{flag_of(cls, e.field)}{e.rest}") from None


def with_default(help: str, default: Any, tp: type) -> str | None:
    """The help text with the field's default appended, unless the text already states one."""
    if tp is bool or default is None or default == [] or "default" in help:
        return help or None
    shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
    return f"{help} (default {shown})" if help else f"default {shown}"


def parser(cls: type, prog: str, description: str = "", epilog: str | None = None,
           output_policy: bool = False) -> argparse.ArgumentParser:
    """An argparse parser with one argument per field of the options dataclass `cls`."""
    if output_policy:
        epilog = f"{epilog}\n\n{OUTPUT_POLICY}" if epilog else OUTPUT_POLICY
    ap = Parser(prog=prog, description=description, epilog=epilog,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_fields(ap, cls)
    return ap


def add_fields(ap: argparse.ArgumentParser, cls: type) -> None:
    """One argument per dataclass field: type, default, choices and help from the field."""
    groups: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        m = f.metadata
        target = ap
        if m.get("group"):
            target = groups.setdefault(m["group"], ap.add_argument_group(m["group"]))
        tp, optional, many = _base(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
        kw: dict[str, Any] = {"help": with_default(m.get("help") or "", default, tp)}
        if m.get("choices"):
            kw["choices"] = list(m["choices"])
        if m.get("metavar"):
            kw["metavar"] = m["metavar"]
        if m.get("positional"):
            target.add_argument(f.name, type=tp if tp in (int, float) else str, **kw)
            continue
        names = [n for n in (m.get("short"), m.get("flag") or "--" + f.name.replace("_", "-")) if n]
        if tp is bool:
            action = argparse.BooleanOptionalAction if (m.get("negatable") or default is True) else "store_true"
            target.add_argument(*names, dest=f.name, action=action, default=bool(default), **kw)
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if many:
            kw["nargs"] = "+"
        conv = tp if tp in (int, float, str) else str
        target.add_argument(*names, dest=f.name, type=conv, default=None if required else default,
                            required=required and not optional, **kw)


def run_sub(subs: dict[str, tuple[Callable[..., Any], type, str]], argv: list[str] | None, prog: str,
            description: str = "", output_policy: bool = False) -> Any:
    """`prog SUBCOMMAND ...`: each subcommand is (function, options dataclass, help); calls the chosen one."""
    ap = Parser(prog=prog, description=description,
                                 epilog=OUTPUT_POLICY if output_policy else None)
    sp = ap.add_subparsers(dest="_command", metavar="COMMAND", required=True, parser_class=Parser)
    for name, (_, cls, help) in subs.items():
        add_fields(sp.add_parser(name, help=help, description=help, epilog=OUTPUT_POLICY if output_policy else None), cls)
    args = vars(ap.parse_args(argv))
    fn, cls, _ = subs[args.pop("_command")]
    try:
        check_options(cls, args)
        return fn(**args)
    except OptionError as e:
        raise ToolkitError(f"{flag_of(cls, e.field)}{e.rest}") from None


def run(fn: Callable[..., Any], cls: type, argv: list[str] | None, prog: str, description: str = "",
        epilog: str | None = None, output_policy: bool = False) -> Any:
    """Parse argv with `cls`'s parser and call `fn(**vars(args))`; an OptionError is re-worded with the flag."""
    args = parser(cls, prog, description, epilog, output_policy).parse_args(argv)
    try:
        check_options(cls, vars(args))
        return fn(**vars(args))
    except OptionError as e:
        raise ToolkitError(f"{flag_of(cls, e.field)}{e.rest}") from None


def entry(main: Callable) -> None:
    """`if __name__ == "__main__": entry(main)`: one-line errors, exit 2 on bad input."""
    run_cli(lambda: main(sys.argv[1:]))
