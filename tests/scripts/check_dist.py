"""Check the built sdist and wheel: what they hold and what their metadata says (run by ``nox -s dist``).

    python tests/scripts/check_dist.py DIST_FOLDER

Run from a git checkout. The sdist must hold every tracked file but CI's own, so that the test suite, the
examples and the benchmarks run from it, and nothing else but what setuptools generates. The wheel must hold
the package, the licence and the console script, and no tests. The metadata must carry the SPDX licence, the
licence file, and a ``Requires-Python`` floor and Python classifiers that match the Python the nox sessions
run on. Prints what it checked; exits 1 listing every problem.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
#: Tracked files that only CI and git need.
NOT_SHIPPED = {".ci/run", ".gitignore"}
LICENSE = "BSD-3-Clause"


def tracked() -> set[str]:
    """The files git tracks in this checkout."""
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return set(out.splitlines())


def nox_pythons() -> list[str]:
    """Every Python version a nox session asks for, oldest first."""
    found = set(re.findall(r'python="(3\.\d+)"', (ROOT / "noxfile.py").read_text()))
    return sorted(found, key=lambda v: tuple(map(int, v.split("."))))


def check_metadata(meta: Message, problems: list[str]) -> None:
    pythons = nox_pythons()
    expected = {"License-Expression": [LICENSE], "License-File": ["LICENSE"],
                "Requires-Python": [f">={pythons[0]}"], "Description-Content-Type": ["text/markdown"]}
    for field, values in expected.items():
        if meta.get_all(field) != values:
            problems.append(f"METADATA {field}: {meta.get_all(field)}, expected {values}")
    if meta.get_all("License"):
        problems.append("METADATA has a legacy License field beside License-Expression")
    classifiers = meta.get_all("Classifier") or []
    versions = sorted(c.rsplit(" :: ", 1)[1] for c in classifiers if re.fullmatch(r".*:: 3\.\d+", c))
    if versions != pythons:
        problems.append(f"Python classifiers {versions}, but the nox sessions run {pythons}")
    if not any(c.startswith("Development Status :: ") for c in classifiers):
        problems.append("no Development Status classifier")
    if any(c.startswith("License :: ") for c in classifiers):
        problems.append("a License classifier beside the SPDX expression (PEP 639)")


def check_sdist(path: Path, problems: list[str]) -> None:
    with tarfile.open(path) as tar:
        top = path.name.removesuffix(".tar.gz") + "/"
        members = {m.name.removeprefix(top): m for m in tar.getmembers() if m.isfile()}
        handle = tar.extractfile(members["LICENSE"]) if "LICENSE" in members else None
        license_text = handle.read() if handle else b""
    shipped = tracked() - NOT_SHIPPED
    missing = sorted(shipped - members.keys())
    generated = {name for name in members.keys() - shipped
                 if name == "PKG-INFO" or name.startswith("fsdp_autocast_fix.egg-info/")}
    extra = sorted(members.keys() - shipped - generated)
    if missing:
        problems.append(f"sdist lacks tracked files: {missing}")
    if extra:
        problems.append(f"sdist holds untracked files: {extra}")
    if license_text != (ROOT / "LICENSE").read_bytes():
        problems.append("sdist LICENSE differs from the repository's")
    print(f"sdist {path.name}: {len(members)} files: every tracked file but {sorted(NOT_SHIPPED)}, "
          f"and {len(generated)} generated ({', '.join(sorted(generated)[:2])}, ...)")


def check_wheel(path: Path, problems: list[str]) -> None:
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        license_text = whl.read(f"{info}/licenses/LICENSE") if f"{info}/licenses/LICENSE" in names else b""
        entry_points = whl.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
    package = {n for n in names if not n.startswith(info + "/")}
    expected = {n for n in tracked() if n.startswith("fsdp_autocast_fix/")}
    if package != expected:
        problems.append(f"wheel package files {sorted(package ^ expected)} differ from the tracked ones")
    if license_text != (ROOT / "LICENSE").read_bytes():
        problems.append("wheel lacks the LICENSE file in its dist-info/licenses, or it differs")
    if "fsdp-autocast-fix = fsdp_autocast_fix.__main__:main" not in entry_points:
        problems.append("wheel lacks the fsdp-autocast-fix console script")
    check_metadata(meta, problems)
    classifiers = "; ".join(meta.get_all("Classifier") or [])
    print(f"wheel {path.name}: {len(package)} package files (= tracked fsdp_autocast_fix/), {info}/licenses/LICENSE; "
          f"License-Expression: {meta['License-Expression']}; Requires-Python: {meta['Requires-Python']} "
          f"(nox runs {', '.join(nox_pythons())}); classifiers: {classifiers}")


def main(folder: str) -> int:
    """Check the one sdist and the one wheel in ``folder``; 0 if all is well."""
    dist = Path(folder)
    sdists, wheels = sorted(dist.glob("*.tar.gz")), sorted(dist.glob("*.whl"))
    problems: list[str] = []
    if len(sdists) != 1 or len(wheels) != 1:
        problems.append(f"expected one sdist and one wheel in {dist}, found {[p.name for p in sdists + wheels]}")
    else:
        check_sdist(sdists[0], problems)
        check_wheel(wheels[0], problems)
    for problem in problems:
        print(f"PROBLEM: {problem}")
    print("dist check: " + ("failed" if problems else "ok"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
