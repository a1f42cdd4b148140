"""Writes gpu-report.md from what scripts/gpu_check.sh left in its work folder.

Inputs (all in WORK): env.txt (device and software lines), <suite>.xml and
<suite>.rc for the suites gpu_tests and kernel_tests (pytest junit XML and exit
status), timeline.jsonl (one record per overlap test, written by tests/gpu),
bench.log and bench.rc (benchmarks/gpu_transfer.py). The report is Markdown:
the machine, a verdict per suite, pass/fail per test, the fraction of load
time hidden behind compute per overlap run, and the benchmark's table of
bandwidth ratios. Exit status: 0 all passed on a GPU, 1 something failed,
2 no CUDA device (nothing about the GPU was proven).

    python scripts/gpu_report.py WORK REPORT.md
"""

from __future__ import annotations

import datetime
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

SUITES = ("gpu_tests", "kernel_tests")
EXIT_NO_CUDA = 2


@dataclass
class Suite:
    name: str
    rc: int
    counts: dict[str, int] = field(default_factory=dict)
    # (test id, outcome) in the order pytest ran them
    cases: list[tuple[str, str]] = field(default_factory=list)

    @property
    def passed(self) -> int:
        c = self.counts
        return c["tests"] - c["failures"] - c["errors"] - c["skipped"]


def read_suite(work: Path, name: str) -> Suite:
    rc_file = work / f"{name}.rc"
    suite = Suite(name, int(rc_file.read_text()) if rc_file.exists() else -1,
                  {"tests": 0, "failures": 0, "errors": 0, "skipped": 0})
    try:
        root = ET.parse(work / f"{name}.xml").getroot()
    except (OSError, ET.ParseError):
        return suite
    for node in root.iter("testsuite"):
        for key in suite.counts:
            suite.counts[key] += int(node.get(key, 0))
    for case in root.iter("testcase"):
        outcome = "pass"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "FAIL", "error": "ERROR", "skipped": "skip"}[tag]
        suite.cases.append((f"{case.get('classname')}::{case.get('name')}", outcome))
    return suite


def verdict(suite: Suite, has_cuda: bool) -> tuple[bool, str]:
    if suite.rc == 5:
        return False, "FAIL (no tests collected)"
    if suite.rc != 0:
        return False, "FAIL"
    if suite.name == "gpu_tests" and suite.passed == 0:
        if has_cuda:
            return False, "FAIL (every test was skipped on a CUDA machine)"
        return True, "skipped cleanly (no CUDA device)"
    return True, "PASS"


def overlap_rows(work: Path) -> list[str]:
    """Fraction of load time hidden: what overlapping saved against loading
    every layer and then computing, over the time the loads take alone."""
    path = work / "timeline.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        load_ms = r["layer_load_ms"] * len(r["loaded"])
        hidden = max(0.0, min(1.0, (r["serial_ms"] - r["step_ms"]) / load_ms)) if load_ms else 0
        rows.append(f"| {r['io_backend']} | {r['mem_layout']} | "
                    f"{r.get('compute_fraction', 0.5):.1f} | {len(r['loaded'])} | "
                    f"{r['layer_mib']:.0f} | {r['layer_load_ms']:.3f} | {r['step_ms']:.3f} | "
                    f"{r['serial_ms']:.3f} | {hidden:.0%} |")
    return rows


def bench_section(work: Path, has_cuda: bool) -> tuple[bool, list[str]]:
    rc_file = work / "bench.rc"
    if not rc_file.exists():
        return True, ["benchmarks/gpu_transfer.py not present: not run."]
    rc = int(rc_file.read_text())
    if rc == EXIT_NO_CUDA and not has_cuda:
        return True, ["Not run: no CUDA device."]
    log = (work / "bench.log").read_text().splitlines() if (work / "bench.log").exists() else []
    table = [line for line in log if line.startswith("| ")]
    head = [line for line in log if line.startswith(("device:", "page "))]
    status = "PASS" if rc == 0 else f"FAIL (exit {rc})"
    return rc == 0, [f"`benchmarks/gpu_transfer.py`: {status}", "", *head, "", *table]


def render(work: Path) -> tuple[int, str]:
    env = (work / "env.txt").read_text().rstrip().splitlines()
    has_cuda = not any(line.startswith("device:   none") for line in env)
    now = datetime.datetime.now().isoformat(timespec="seconds")
    out = ["# gpu_check report", "", f"Run {now}.", "", *(f"- {line}" for line in env), ""]
    ok = True
    out += ["## Suites", "", "| suite | verdict | passed | failed | errors | skipped |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    suites = [read_suite(work, name) for name in SUITES]
    for suite in suites:
        good, text = verdict(suite, has_cuda)
        ok &= good
        c = suite.counts
        out.append(f"| {suite.name} | {text} | {suite.passed} | {c['failures']} | "
                   f"{c['errors']} | {c['skipped']} |")
    out += ["", "## Fraction of load time hidden behind compute", ""]
    rows = overlap_rows(work)
    out += (["Compute per layer as a fraction of one layer's load; with L layers at most "
             "(L-1)/L of the load can hide. Target: >= 80% at 1.0.", "",
             "| io_backend | mem_layout | compute/load | layers | MiB/layer | load ms/layer | "
             "step ms | load-then-compute ms | hidden |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", *rows]
            if rows else ["No overlap run (needs a CUDA device)."])
    good, bench = bench_section(work, has_cuda)
    ok &= good
    out += ["", "## Bandwidth against one contiguous pinned copy", "", *bench]
    for suite in suites:
        out += ["", f"## Tests: {suite.name}", "", "| test | outcome |", "| --- | --- |"]
        out += [f"| `{test}` | {outcome} |" for test, outcome in suite.cases]
    overall = ("PASS" if has_cuda else "NO GPU: suites ran, GPU tests skipped") if ok else "FAIL"
    out[4:4] = [f"**Overall: {overall}**", ""]
    rc = (0 if has_cuda else EXIT_NO_CUDA) if ok else 1
    return rc, "\n".join(out) + "\n"


def main() -> int:
    work, report = Path(sys.argv[1]), Path(sys.argv[2])
    rc, text = render(work)
    report.write_text(text)
    summary = text.split("## Tests:")[0].rstrip()
    print(summary)
    print(f"\n(per-test outcomes in {report})")
    return rc


if __name__ == "__main__":
    sys.exit(main())
