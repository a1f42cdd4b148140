"""The Grafana dashboard (examples/grafana/hicache-dashboard.json): every
PromQL expression in it parses, every ``vllm:hicache_*`` series it queries
is one HiCache exports (common/stats.METRICS), and every panel is well
formed. tests/e2e/test_graceful_stop.py checks the series it queries on a
real server's ``/metrics``, with ``dashboard_series`` and ``missing_series``.

The parser covers the PromQL the dashboard uses (selectors with matchers and
ranges, functions, aggregations with ``by``/``without``, arithmetic and
comparison operators, Grafana's ``$variables``); anything else is an error
naming the expression, so a new panel using more gets a parser rule first.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vllm_hicache.common.stats import METRICS

DASHBOARD = Path(__file__).resolve().parents[1] / "examples" / "grafana" / "hicache-dashboard.json"

AGGREGATIONS = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
                "quantile", "group"}
FUNCTIONS = {"rate", "irate", "increase", "delta", "idelta", "histogram_quantile", "abs",
             "clamp_min", "clamp_max", "avg_over_time", "max_over_time", "min_over_time",
             "sum_over_time", "vector", "scalar"}
BINARY = {"+", "-", "*", "/", "%", "^", "==", "!=", ">", "<", ">=", "<=", "and", "or", "unless"}
_TOKEN = re.compile(r"""
    \s+
  | (?P<string>"(?:[^"\\]|\\.)*")
  | (?P<duration>\[(?:\$\w+|\d+[smhdwy])\])
  | (?P<number>\d+(?:\.\d+)?)
  | (?P<op>=~|!~|==|!=|>=|<=|[-+*/%^(){},=<>])
  | (?P<name>[A-Za-z_:][\w:]*)
""", re.X)


class PromQLError(ValueError):
    pass


def tokenize(expr: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise PromQLError(f"cannot read {expr[pos:pos + 20]!r} in {expr!r}")
        pos = match.end()
        if match.lastgroup is not None:
            tokens.append((match.lastgroup, match.group(match.lastgroup)))
    return tokens


class _Parser:
    """Recursive descent over ``tokenize``'s tokens; collects metric names."""

    def __init__(self, expr: str) -> None:
        self.expr = expr
        self.tokens = tokenize(expr)
        self.pos = 0
        self.metrics: set[str] = set()

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, value: str | None = None, kind: str | None = None) -> str:
        token = self.peek()
        if token is None or (value is not None and token[1] != value) or (
                kind is not None and token[0] != kind):
            want = value or kind
            raise PromQLError(f"expected {want!r} at token {self.pos} "
                              f"({token[1] if token else 'end'!r}) in {self.expr!r}")
        self.pos += 1
        return token[1]

    def parse(self) -> set[str]:
        self.expression()
        if self.peek() is not None:
            raise PromQLError(f"unexpected {self.peek()[1]!r} in {self.expr!r}")
        return self.metrics

    def expression(self) -> None:
        self.unary()
        while (token := self.peek()) is not None and token[1] in BINARY:
            self.pos += 1
            self.unary()

    def unary(self) -> None:
        if self.peek() == ("op", "-"):
            self.pos += 1
        self.primary()

    def primary(self) -> None:
        token = self.peek()
        if token is None:
            raise PromQLError(f"expression ends early: {self.expr!r}")
        kind, value = token
        if kind in ("number", "string"):
            self.pos += 1
        elif value == "(":
            self.take("(")
            self.expression()
            self.take(")")
        elif kind == "name" and value in AGGREGATIONS:
            self.pos += 1
            self.grouping()
            self.arguments()
            self.grouping()
        elif value == "label_values":  # Grafana's: a selector, then a label name
            self.pos += 1
            self.take("(")
            self.expression()
            self.take(",")
            self.take(kind="name")
            self.take(")")
        elif kind == "name" and value in FUNCTIONS:
            self.pos += 1
            self.arguments()
        elif kind == "name":
            self.selector()
        else:
            raise PromQLError(f"unexpected {value!r} in {self.expr!r}")
        if (token := self.peek()) is not None and token[0] == "duration":
            self.pos += 1

    def grouping(self) -> None:
        if self.peek() in (("name", "by"), ("name", "without")):
            self.pos += 1
            self.take("(")
            self.take(kind="name")
            while self.peek() == ("op", ","):
                self.pos += 1
                self.take(kind="name")
            self.take(")")

    def arguments(self) -> None:
        self.take("(")
        self.expression()
        while self.peek() == ("op", ","):
            self.pos += 1
            self.expression()
        self.take(")")

    def selector(self) -> None:
        self.metrics.add(self.take(kind="name"))
        if self.peek() == ("op", "{"):
            self.pos += 1
            while self.peek() != ("op", "}"):
                self.take(kind="name")
                if self.take(kind="op") not in ("=", "!=", "=~", "!~"):
                    raise PromQLError(f"bad label matcher in {self.expr!r}")
                self.take(kind="string")
                if self.peek() == ("op", ","):
                    self.pos += 1
            self.take("}")


def series_of(expr: str) -> set[str]:
    """The metric names ``expr`` queries; PromQLError if it does not parse."""
    return _Parser(expr).parse()


def expressions(path: Path = DASHBOARD) -> list[tuple[str, str]]:
    """(where, expression) for every panel target and templating query."""
    dash = json.loads(path.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for var in dash.get("templating", {}).get("list", ()):
        if var.get("type") == "query":
            out.append((f"variable {var['name']!r}", var["query"]["query"]))
    return out


def dashboard_series(path: Path = DASHBOARD) -> set[str]:
    return set().union(*(series_of(expr) for _, expr in expressions(path)))


_SUFFIXES = ("_bucket", "_sum", "_count")


def missing_series(series: set[str], metrics_text: str) -> set[str]:
    """The names in ``series`` that ``metrics_text`` (a /metrics page)
    neither has samples of nor declares (a labelled series is declared by
    its ``# TYPE`` line before its first sample)."""
    present = set()
    for line in metrics_text.splitlines():
        if line.startswith("# TYPE "):
            name = line.split()[2]
            present.add(name)
            present.update(name + suffix for suffix in _SUFFIXES)
        elif line and not line.startswith("#"):
            present.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return series - present


@pytest.mark.parametrize("where, expr", expressions())
def test_every_expression_parses(where, expr):
    assert series_of(expr), f"{where} queries no series: {expr}"


def test_the_parser_refuses_what_it_does_not_know():
    for bad in ('sum(rate(x[5m])', 'rate(x{a="b"[5m])', 'frobnicate(x)', 'x{a~"b"}',
                'sum by (tier (x)'):
        with pytest.raises(PromQLError):
            series_of(bad)
    assert series_of('sum by (a) (rate(x{b=~"$v"}[$__rate_interval])) / on_y') == {"x", "on_y"}
    assert series_of("label_values(vllm:x, model_name)") == {"vllm:x"}


def test_hicache_series_are_ones_hicache_exports():
    exported = {"vllm:hicache_" + m.name + ("_total" if m.kind == "counter" else "")
                for m in METRICS}
    histograms = {"vllm:hicache_" + m.name for m in METRICS if m.kind == "histogram"}

    def base(series: str) -> str:  # a histogram is queried by its _bucket/_sum/_count
        for suffix in _SUFFIXES:
            if series.endswith(suffix) and series.removesuffix(suffix) in histograms:
                return series.removesuffix(suffix)
        return series

    ours = {base(s) for s in dashboard_series() if s.startswith("vllm:hicache_")}
    assert ours <= exported, ours - exported
    # Every series HiCache exports has a panel.
    assert exported <= ours, exported - ours


def test_panels_are_well_formed():
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["description"], panel
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}"
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]


def test_missing_series_reads_a_metrics_page():
    page = "\n".join([
        "# HELP vllm:hicache_hit_tokens_total Prompt tokens",
        "# TYPE vllm:hicache_hit_tokens_total counter",
        'vllm:num_requests_running{model_name="tiny"} 0.0',
        "# TYPE vllm:time_to_first_token_seconds histogram",
    ])
    assert missing_series({"vllm:hicache_hit_tokens_total", "vllm:num_requests_running",
                           "vllm:time_to_first_token_seconds_bucket", "vllm:nope"},
                          page) == {"vllm:nope"}
