"""Where the test suite's time goes, per test file: wall seconds (setup + call + teardown of its tests,
from pytest's JUnit XML) and CPU seconds (``pytest --cpu-report``, tests/cpu_times.py, where the
checkout has it) for one pytest run over the given files, plus the run's CPU seconds (user + sys of
pytest and every server, worker and rank process it started) and the load average around it. Extra
arguments go to pytest (``-n 2 --dist loadfile`` for `make test`'s two workers).

The machine is shared, so wall seconds alone mislead: read them with the load average, and compare
CPU seconds between runs. Each run is stored under its label (``before`` / ``after``) and source tree
(``--root``: another checkout of the repository, e.g. the commit before a change, extracted with
``git archive``), so a change is measured on the same files from two trees.

Prints a table and merges into benchmarks/results/test_suite_durations.json. Run:
    python benchmarks/test_suite_durations.py --label after tests/server/test_api.py ...
"""

import argparse
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "test_suite_durations.json"


def per_file_seconds(junit_xml: Path) -> tuple[dict[str, dict[str, float]], list[str]]:
    """``{file: {"seconds": total, "tests": count}}`` from a JUnit XML report, and the tests that
    failed or errored (``file::name``)."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: {"seconds": 0.0, "tests": 0})
    failed = []
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # classname is the dotted module path, plus the class for tests in a class
        module = case.get("classname", "").split(".")
        name = "/".join(part for part in module if not part[:1].isupper()) + ".py"
        files[name]["seconds"] += float(case.get("time", 0))
        files[name]["tests"] += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{name}::{case.get('name')}")
    return {name: {"seconds": round(v["seconds"], 1), "tests": int(v["tests"])} for name, v in files.items()}, failed


def run(root: Path, files: list[str], extra: list[str]) -> dict:
    """One pytest run of ``files`` in ``root``; its per-file seconds, outcome, CPU and load."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "junit.xml"
        cpu_report = Path(tmp) / "cpu.json"
        if (root / "tests" / "cpu_times.py").exists():  # per-file CPU seconds (older checkouts lack it)
            extra = [*extra, f"--cpu-report={cpu_report}"]
        load_before = os.getloadavg()
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                               f"--junitxml={report}", *extra, *files], check=False, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True)
        wall = time.monotonic() - start
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        files, failed = per_file_seconds(report) if report.exists() else ({}, [])
        cpu_files = json.loads(cpu_report.read_text())["files"] if cpu_report.exists() else {}
        for name, entry in files.items():
            entry["cpu_s"] = cpu_files.get(name)
        # pytest's closing line: "N passed, M failed ... in S s"
        summary = next((line.strip("= ") for line in reversed(done.stdout.splitlines())
                        if re.search(r"\d+ (passed|failed|errors?) ", line)), done.stderr[-500:])
        return {
            "files": files,
            "failed": failed,
            "summary": summary,
            "wall_s": round(wall, 1),
            "cpu_s": round(cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime, 1),
            "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="test files, relative to --root")
    parser.add_argument("--label", required=True, help="e.g. before / after")
    parser.add_argument("--group", default="default", help="name of this set of files")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run the tests in")
    parser.add_argument("--note", default="")
    args, extra = parser.parse_known_args()
    result = {**run(args.root, args.files, extra), "root": str(args.root), "note": args.note,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"}
    print(f"{'file':60} {'tests':>5} {'seconds':>8} {'CPU s':>8}")
    for name, entry in sorted(result["files"].items(), key=lambda kv: -kv[1]["seconds"]):
        cpu = "" if entry.get("cpu_s") is None else f"{entry['cpu_s']:8.1f}"
        print(f"{name:60} {entry['tests']:5} {entry['seconds']:8.1f} {cpu:>8}")
    print(f"{args.label}/{args.group}: {result['summary']}; wall {result['wall_s']} s, CPU {result['cpu_s']} s, "
          f"load {result['load_before']} -> {result['load_after']}")
    stored = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    stored.setdefault(args.group, {})[args.label] = result
    RESULTS.write_text(json.dumps(stored, indent=2) + "\n")


if __name__ == "__main__":
    main()
