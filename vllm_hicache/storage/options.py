"""Typed option parsing shared by every L3 backend and the storage config.

Each option is declared once: a field of a frozen dataclass, with its
comment, made by ``option(default, parse=...)``. ``parse_options`` turns a
mapping (one backend's part of ``hicache_storage_backend_extra_config``) into
that dataclass:

- a key that is not a field is refused, naming it and every accepted key;
- a field without a default must be given (its ``hint`` says what to give);
- each given value goes through its field's parser, which coerces it
  (``"64MB"`` -> bytes, ``"0660"`` -> 0o660) or raises ValueError saying what
  is accepted; the error names the owner, the option and the value, except
  the value of a field declared ``repr=False`` (a secret);
- checks spanning several fields stay in the dataclass's ``__post_init__``.

A parser is any ``Callable[[Any], Any]`` that raises ValueError with the
problem (``"expected an integer in [1, 256]"``). Pure module: no numpy, no
torch (the configuration layer uses it too).

Every ``@/path/to/file`` value (a secret, a key, a config file) is read by
``option_file.read_option_file``: a regular file only, at most ``MAX_OPTION_FILE_BYTES``,
so a device (``/dev/zero``), a FIFO or a wrong, large file fails at once with
an error naming the path and the limit, never hangs or fills memory.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import TYPE_CHECKING, Any, TypeVar

from vllm_hicache.option_file import read_option_file

Parser = Callable[[Any], Any]
if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
E = TypeVar("E", bound=StrEnum)

_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}


def option(default: Any = dataclasses.MISSING, *, parse: Parser,
           default_factory: Any = dataclasses.MISSING, hint: str = "",
           repr: bool = True,  # noqa: A002 - dataclasses.field's name
           shows_files: bool = False) -> Any:
    """A dataclass field parsed by ``parse``; ``hint`` follows its errors.
    ``shows_files``: a ``repr=False`` field whose errors still show a value
    naming a file (``@path``: the name is no secret, and says which file)."""
    return dataclasses.field(default=default, default_factory=default_factory, repr=repr,
                             metadata={"parse": parse, "hint": hint,
                                       "shows_files": shows_files})


class Options:
    """Base of the option dataclasses: ``from_options`` parses a mapping."""

    # Whose options these are, in errors: "invalid {owner} option ...".
    owner = "storage"

    @classmethod
    def from_options(cls: type[T], options: Mapping[str, Any]) -> T:
        return parse_options(cls, options)


def parse_options(cls: type[T], options: Mapping[str, Any]) -> T:
    """``cls`` built from ``options``, every value parsed by its field's parser."""
    owner = getattr(cls, "owner", "storage")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    reject_unknown(owner, options, fields)
    for f in fields.values():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and f.name not in options:
            hint = f.metadata.get("hint")
            raise ValueError(f"{owner} option {f.name!r} is required"
                             + (f" ({hint})" if hint else ""))
    return cls(**{name: parse_value(owner, fields[name], v) for name, v in options.items()})


def parse_value(owner: str, field: dataclasses.Field, value: Any) -> Any:
    """``value`` as ``field``'s parser makes it, or a ValueError naming it.

    ``owner`` "" is for top-level keys (``kv_connector_extra_config``): the
    error then names the key alone. A ``repr=False`` field's value is not
    shown, except an ``@path`` one of a field declared ``shows_files``."""
    try:
        return field.metadata["parse"](value)
    except ValueError as err:
        names_file = (field.metadata.get("shows_files", False) and isinstance(value, str)
                      and value.startswith("@"))
        shown = f"={value!r}" if field.repr or names_file else ""
        hint = field.metadata.get("hint")
        where = f"{owner} option " if owner else ""
        raise ValueError(f"invalid {where}{field.name}{shown}: {err}"
                         + (f" ({hint})" if hint else "")) from None


def reject_unknown(owner: str, options: Mapping[str, Any], accepted: Any) -> None:
    accepted = sorted(accepted)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(f"unknown {owner} option(s) {unknown}; accepted: {accepted}")


# --- parsers -----------------------------------------------------------------


def _bounds(low: float, high: float | None, low_open: bool = False) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def _in_range(value: float, low: float, high: float | None, low_open: bool = False) -> bool:
    above = low < value if low_open else low <= value
    return above and (high is None or value <= high)


def integer(low: int = 0, high: int | None = None) -> Parser:
    """An int (or an integral float) in [low, high]."""
    def parse(value: Any) -> int:
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not integral or not _in_range(value, low, high):
            raise ValueError(f"expected an integer {_bounds(low, high)}")
        return int(value)
    return parse


def number(low: float = 0.0, high: float | None = None, *, low_open: bool = False) -> Parser:
    """A finite int or float in [low, high] ((low, high] if ``low_open``), as a float."""
    def parse(value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or not math.isfinite(value) or not _in_range(value, low, high, low_open)):
            raise ValueError(f"expected a number {_bounds(low, high, low_open)}")
        return float(value)
    return parse


def size(low: int = 0, high: int | None = None) -> Parser:
    """Bytes: an int, or a string with a unit ("64MB", "4 GiB"; K/M/G/T are
    powers of 1024, as in Mooncake's flags), in [low, high]."""
    def parse(value: Any) -> int:
        nbytes = value if isinstance(value, int) and not isinstance(value, bool) else None
        match = _SIZE.match(value) if isinstance(value, str) else None
        if match is not None:
            nbytes = int(match.group(1)) << _SIZE_SHIFT[match.group(2).lower()]
        if nbytes is None or not _in_range(nbytes, low, high):
            raise ValueError(f"expected bytes {_bounds(low, high)} as an int or a string "
                             "such as '64MB' / '4 GiB'")
        return nbytes
    return parse


def flag(value: Any) -> bool:
    """true or false (JSON booleans only: 1 and "yes" are refused)."""
    if not isinstance(value, bool):
        raise ValueError("expected true or false")
    return value


def text(*, empty: bool = True, printable: bool = False) -> Parser:
    """A string; non-empty unless ``empty``; printable ASCII if ``printable``."""
    kind = ("" if empty else "non-empty ") + ("printable ASCII " if printable else "")

    def parse(value: Any) -> str:
        if (not isinstance(value, str) or (not empty and not value)
                or (printable and not (value.isascii() and value.isprintable()))):
            raise ValueError(f"expected a {kind}string")
        return value
    return parse


def optional(parse: Parser) -> Parser:
    """None, or what ``parse`` accepts."""
    def parse_optional(value: Any) -> Any:
        return None if value is None else parse(value)
    return parse_optional


def choice(*values: str, ignore_case: bool = False) -> Parser:
    """One of ``values`` (matched ignoring case if asked; the value as listed)."""
    def parse(value: Any) -> str:
        for accepted in values:
            if value == accepted or (ignore_case and isinstance(value, str)
                                     and value.lower() == accepted.lower()):
                return accepted
        raise ValueError(f"expected one of {list(values)}")
    return parse


def named(names: type[E]) -> Callable[[Any], E]:
    """One of the str-valued enum ``names``' values, as its member; the error
    lists them all, in order."""
    def parse(value: Any) -> E:
        if isinstance(value, str):
            for member in names:
                if value == member.value:
                    return member
        raise ValueError(f"accepted: {', '.join(m.value for m in names)}")
    return parse


def directory(value: Any) -> str:
    """A directory path ("~" expanded, made absolute); it need not exist yet."""
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ValueError("expected a directory")
    return os.path.abspath(os.path.expanduser(str(value)))


def readable_file(value: Any) -> str:
    """The path of an existing file."""
    if not isinstance(value, str) or not os.path.isfile(value):
        raise ValueError("expected a readable file")
    return value


def permissions(needed: int) -> Parser:
    """Permission bits that include ``needed``: an octal string ("0660",
    "0o660") or an int (0o660 in Python; JSON has no octal, so 660 there is
    refused as > 0o777)."""
    def parse(value: Any) -> int:
        mode = None
        if isinstance(value, str):
            digits = value[2:] if value.lower().startswith("0o") else value
            if digits and all(c in "01234567" for c in digits):
                mode = int(digits, 8)
        elif isinstance(value, int) and not isinstance(value, bool):
            mode = value
        if mode is None or not 0 <= mode <= 0o777 or mode & needed != needed:
            raise ValueError(f"expected permission bits as an octal string such as "
                             f"'{needed:04o}', including {oct(needed)} (the owner must be "
                             "able to use it)")
        return mode
    return parse


def string_map(value: Any) -> dict[str, str]:
    """A mapping of strings to strings, bools or ints, as strings ("true")."""
    if not isinstance(value, Mapping):
        raise ValueError("expected a mapping")
    out = {}
    for key, item in value.items():
        if not isinstance(key, str) or not isinstance(item, (str, bool, int)):
            raise ValueError(f"entry {key!r}={item!r} must map a string to a string, "
                             "bool or int")
        out[key] = str(item).lower() if isinstance(item, bool) else str(item)
    return out


def secret(value: Any) -> str:
    """A secret, or ``@/path/to/file`` holding it (one trailing newline
    stripped; a secret that itself starts with "@" must come from a file)."""
    if not isinstance(value, str):
        raise ValueError("expected a string, or @/path/to/file")
    if not value.startswith("@"):
        return value
    path = value[1:]
    try:
        content = read_option_file(path).decode("utf-8")
    except UnicodeError:
        raise ValueError(f"cannot read the file {path!r}: not UTF-8 text") from None
    content = content[:-1] if content.endswith("\n") else content
    if not content:
        raise ValueError(f"the file {path!r} is empty")
    return content
