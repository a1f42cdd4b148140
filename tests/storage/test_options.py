"""The shared option parser: every backend config declares each option once
(a field with a comment and a parser), and errors name the option."""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import time

import pytest

from vllm_hicache.option_file import MAX_OPTION_FILE_BYTES, read_option_file
from vllm_hicache.storage.file.config import FileBackendConfig
from vllm_hicache.storage.mooncake.config import MooncakeConfig
from vllm_hicache.storage.nixl.config import NixlConfig
from vllm_hicache.storage.options import (
    Options,
    choice,
    flag,
    integer,
    number,
    option,
    permissions,
    secret,
    size,
    string_map,
    text,
)
from vllm_hicache.storage.redis.config import RedisConfig

CONFIGS = [FileBackendConfig, RedisConfig, MooncakeConfig, NixlConfig]


@dataclasses.dataclass(frozen=True)
class Demo(Options):
    owner = "demo backend"

    # Required, with a hint.
    address: str = option(parse=text(empty=False), hint="e.g. 'host:1'")
    # A bounded count.
    count: int = option(4, parse=integer(1, 8))
    # Never shown.
    token: str | None = option(None, parse=text(empty=False), repr=False)


@pytest.mark.parametrize("cls", CONFIGS)
def test_every_option_is_one_commented_field_with_a_parser(cls):
    assert issubclass(cls, Options) and cls.__dataclass_params__.frozen
    source = inspect.getsource(cls).splitlines()
    for f in dataclasses.fields(cls):
        assert callable(f.metadata.get("parse")), f.name
        line = next(i for i, src in enumerate(source) if src.strip().startswith(f"{f.name}:"))
        above = source[line - 1].strip()
        # The comment sits right above the field, or above a group of fields.
        assert above.startswith("#") or ":" in above and "option(" in above, (cls, f.name)


def test_unknown_option_is_named_with_every_accepted_one():
    with pytest.raises(ValueError, match=r"unknown demo backend option\(s\) \['cuont'\]; "
                                         r"accepted: \['address', 'count', 'token'\]"):
        Demo.from_options({"address": "h:1", "cuont": 2})


def test_required_option_names_its_hint():
    with pytest.raises(ValueError, match=r"demo backend option 'address' is required \(e.g."):
        Demo.from_options({})


def test_invalid_value_names_option_and_value_but_never_a_secret():
    with pytest.raises(ValueError, match=r"invalid demo backend option count=9: expected an "
                                         r"integer in \[1, 8\]"):
        Demo.from_options({"address": "h:1", "count": 9})
    with pytest.raises(ValueError, match="invalid demo backend option token: ") as err:
        Demo.from_options({"address": "h:1", "token": ""})
    assert "''" not in str(err.value)
    assert Demo.from_options({"address": "h:1", "count": 2.0}) == Demo("h:1", 2)


@pytest.mark.parametrize("parse, good, bad", [
    (integer(0, 10), [(0, 0), (10.0, 10)], [True, -1, 11, 1.5, "3", None]),
    (number(0.0, 5.0, low_open=True), [(5, 5.0), (0.5, 0.5)], [0, 5.1, math.inf, math.nan, "1"]),
    (number(0.0), [(0, 0.0), (1e9, 1e9)], [-0.1, math.inf, False]),
    (size(1, 1 << 40), [(4096, 4096), ("64MB", 64 << 20), ("4 GiB", 4 << 30), ("2k", 2048)],
     ["lots", 0, -1, True, 1.5]),
    (flag, [(True, True), (False, False)], [1, "yes", None]),
    (permissions(0o600), [("0660", 0o660), ("0o600", 0o600), (0o640, 0o640)],
     [660, "0400", "rw-rw----", True]),
    (choice("POSIX", "OBJ", ignore_case=True), [("obj", "OBJ"), ("POSIX", "POSIX")], ["UCX", 1]),
    (string_map, [({"a": True, "b": 3, "c": "x"}, {"a": "true", "b": "3", "c": "x"})],
     [{"a": [1]}, {1: "x"}, "a=b"]),
    (text(empty=False, printable=True), [("hicache:", "hicache:")], ["", "tab\t", "é", 3]),
])
def test_parsers(parse, good, bad):
    for value, parsed in good:
        assert parse(value) == parsed
    for value in bad:
        with pytest.raises(ValueError, match="expected|must map"):
            parse(value)


def test_secret_inline_or_from_a_file(tmp_path):
    f = tmp_path / "pw"
    f.write_text("hunter2\n")
    assert secret("inline") == "inline" and secret(f"@{f}") == "hunter2"
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        secret(f"@{tmp_path / 'empty'}")
    with pytest.raises(ValueError, match="cannot read the file '/no/such'"):
        secret("@/no/such")


# --- files named by "@" -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SecretDemo(Options):
    owner = "demo backend"

    # A secret inline or @/path/to/file.
    token: str = option(parse=secret, repr=False)


def test_option_files_are_bounded_regular_files(tmp_path):
    """A device, a FIFO without a writer or a large file fails at once, with
    the option, the path and the limit named: no hang, no MemoryError."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_bytes(b"x" * (MAX_OPTION_FILE_BYTES + 1))
    exact = tmp_path / "exact"
    exact.write_bytes(b"y" * MAX_OPTION_FILE_BYTES)
    assert read_option_file(str(exact)) == b"y" * MAX_OPTION_FILE_BYTES
    start = time.monotonic()
    for path, problem in ((fifo, "not a regular file"), ("/dev/zero", "not a regular file"),
                          (tmp_path, "not a regular file"),
                          (big, f"larger than the limit of {MAX_OPTION_FILE_BYTES} bytes")):
        with pytest.raises(ValueError, match=f"^cannot read the file '{path}': {problem}"):
            read_option_file(str(path))
        with pytest.raises(ValueError, match=f"^invalid demo backend option token: cannot "
                                             f"read the file '{path}': {problem}"):
            SecretDemo.from_options({"token": f"@{path}"})
    assert time.monotonic() - start < 5


def test_named_accepts_an_enum_value_and_lists_them_all():
    from enum import StrEnum

    from vllm_hicache.storage.options import named

    class Colour(StrEnum):
        RED = "red"
        BLUE = "blue"

    parse = named(Colour)
    assert parse("blue") is Colour.BLUE
    for bad in ("green", 1, None, "Blue"):
        with pytest.raises(ValueError, match="^accepted: red, blue$"):
            parse(bad)
