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


def counts(root: ET.Element) -> Counter[str]:
    """A JUnit report's tests, failed (failures and errors), skipped and passed."""
    found = Counter[str]()
    for suite in root.iter("testsuite"):
        found["tests"] += int(suite.get("tests", 0))
        found["failed"] += int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        found["skipped"] += int(suite.get("skipped", 0))
    found["passed"] = found["tests"] - found["failed"] - found["skipped"]
    return found


def main(paths: list[str]) -> None:
    totals = Counter[str]()
    for path in paths:
        root = ET.parse(path).getroot()
        run = counts(root)
        skips = Counter[str]()
        release = next((prop.get("value", "?") for prop in root.iter("property")
                        if prop.get("name") == "transformers"), "?")
        for case in root.iter("testcase"):
            skipped = case.find("skipped")
            if skipped is not None:
                skips[(skipped.get("message") or "no reason").splitlines()[0][:160]] += 1
        print(f"{Path(path).stem}: transformers {release}: {run['passed']} passed, {run['failed']} failed, "
              f"{run['skipped']} skipped")
        for reason, n in sorted(skips.items()):
            print(f"    skipped {n}x: {reason}")
        totals.update(run)
    print(f"tests: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")


if __name__ == "__main__":
    main(sys.argv[1:])
