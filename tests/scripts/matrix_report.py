"""Fold the matrix runs (``.matrix/torch-*.json`` and ``.xml``) into ``matrix/results.json`` and docs' tables:
the version matrix in docs/versions.md, the scenario table in docs/testing.md.

Run by ``python3 -m nox -s matrix`` after the per-version sessions; needs no torch.
"""

from __future__ import annotations

import datetime
import json
import pathlib
import re
import sys
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
RAW = ROOT / ".matrix"
RESULTS = ROOT / "matrix" / "results.json"
VERSIONS_PAGE = ROOT / "docs" / "versions.md"
TESTING_PAGE = ROOT / "docs" / "testing.md"
START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
SCEN_START, SCEN_END = "<!-- scenarios:start -->", "<!-- scenarios:end -->"
SCENARIO_TORCHES = ("2.12.1", "2.13.0")
COMMAND = "python3 -m nox -s matrix"


def _version_key(v: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", v)[:3])


def _junit(path: pathlib.Path) -> dict[str, int]:
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return counts


def _row(requested: str) -> dict[str, object]:
    row: dict[str, object] = {"requested": requested, "tests": _junit(RAW / f"torch-{requested}.xml")}
    data = json.loads((RAW / f"torch-{requested}.json").read_text())
    cells = data["scenarios"]
    controls = sum((c["stock"] != "bitwise equal") == (c["broken_stock_expected"] == "True") for c in cells.values())
    fixed = sum(all(c[m] == "bitwise equal" for m in ("apply", "late_apply", "patched_fully_shard"))
                for c in cells.values())
    base = tuple(int(p) for p in re.findall(r"\d+", requested)[:2])
    row.update(torch=data["torch"], needs_cast_replay=data["needs_cast_replay"], scenarios=cells,
               positive_controls_as_expected=f"{controls}/{len(cells)}", scenarios_fixed=f"{fixed}/{len(cells)}",
               suite="full, CPU stand-ins" if base < (2, 7) else "full")
    return row


def _replace(text: str, start: str, end: str, block: str) -> str:
    if start in text:
        return re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, text, flags=re.S)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def _scenario_table(rows: list[dict[str, object]]) -> str:
    """Every scenario on one buggy and one fixed torch: stock and the three ways of patching."""
    lines = [SCEN_START]
    for wanted in SCENARIO_TORCHES:
        row = next((r for r in rows if r["requested"] == wanted and "scenarios" in r), None)
        if row is None:
            continue
        lines += ["", f"torch {row['torch']} (needs cast replay: {row['needs_cast_replay']}):", "",
                  "| scenario | stock | apply | late apply | patched_fully_shard |", "|---|---|---|---|---|"]
        for name, c in row["scenarios"].items():  # type: ignore[union-attr]
            lines.append(f"| {name} | {c['stock']} | {c['apply']} | {c['late_apply']} | {c['patched_fully_shard']} |")
    lines.append(SCEN_END)
    return "\n".join(lines)


def main() -> int:
    """Write the results file and the docs' tables; exit non-zero if any run had failures."""
    versions = sorted({p.name[len("torch-"):-len(".xml")] for p in RAW.glob("torch-*.xml")}, key=_version_key)
    today = datetime.date.today().isoformat()
    rows = {v: {**_row(v), "measured": today} for v in versions}
    if RESULTS.exists():  # releases not run this time keep their last results, with their date
        old = json.loads(RESULTS.read_text())
        for r in old["runs"]:
            rows.setdefault(r["requested"], {**r, "measured": r.get("measured", old["date"])})
    rows = dict(sorted(rows.items(), key=lambda item: _version_key(item[0])))
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"date": today, "command": COMMAND, "runs": list(rows.values())}, indent=1) + "\n")
    lines = [START, f"Generated {today} from `matrix/results.json` (`{COMMAND}`, or `matrix-run(<torch>)` for "
             "some releases, then `matrix-report`; CPU, gloo):", "",
             "| torch | measured | needs cast replay | positive controls as expected | scenarios fixed (3 ways, "
             "bitwise) | tests passed | failed | skipped | suite |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows.values():
        t = r["tests"]
        lines.append(f"| {r['torch']} | {r['measured']} | {r['needs_cast_replay']} | "
                     f"{r['positive_controls_as_expected']} | {r['scenarios_fixed']} | {t['passed']}/{t['tests']} | "
                     f"{t['failures'] + t['errors']} | {t['skipped']} | {r['suite']} |")
    lines.append(END)
    VERSIONS_PAGE.write_text(_replace(VERSIONS_PAGE.read_text(), START, END, "\n".join(lines)))
    TESTING_PAGE.write_text(_replace(TESTING_PAGE.read_text(), SCEN_START, SCEN_END,
                                     _scenario_table(list(rows.values()))))
    block = "\n".join(lines)
    bad = [r["torch"] for r in rows.values() if r["tests"]["failures"] or r["tests"]["errors"]]
    print(block)
    if bad:
        print(f"failures on: {bad}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
