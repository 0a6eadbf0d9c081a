"""The CI summary of scripts/test.sh: one line per pytest run, then one closing line over all runs.

``python scripts/test_summary.py REPORT.xml...`` reads pytest's JUnit reports. Each run's line
names its transformers release and lists every skipped test with its reason, so a release that
lacks a feature says what it left out instead of passing silently.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path


def main(paths: list[str]) -> None:
    totals = Counter[str]()
    for path in paths:
        root = ET.parse(path).getroot()
        counts = Counter[str]()
        skips = Counter[str]()
        release = "?"
        for suite in root.iter("testsuite"):
            counts["tests"] += int(suite.get("tests", 0))
            counts["failed"] += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            counts["skipped"] += int(suite.get("skipped", 0))
            for prop in suite.iter("property"):
                if prop.get("name") == "transformers":
                    release = prop.get("value", "?")
        for case in root.iter("testcase"):
            skipped = case.find("skipped")
            if skipped is not None:
                skips[(skipped.get("message") or "no reason").splitlines()[0][:160]] += 1
        passed = counts["tests"] - counts["failed"] - counts["skipped"]
        print(f"{Path(path).stem}: transformers {release}: {passed} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped")
        for reason, n in sorted(skips.items()):
            print(f"    skipped {n}x: {reason}")
        totals.update(counts)
    passed = totals["tests"] - totals["failed"] - totals["skipped"]
    print(f"tests: {passed} passed, {totals['failed']} failed, {totals['skipped']} skipped")


if __name__ == "__main__":
    main(sys.argv[1:])
