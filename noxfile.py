"""Test sessions, one per torch release; run ``python3 -m nox`` (see README and docs/testing.md).

Environments are made with uv and reused between runs. torch comes from PyPI, or from a folder of
local wheels named in uv's own ``UV_FIND_LINKS`` (a CPU build, say), which uv reads from the environment.
"""

from __future__ import annotations

import os

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests", "transformers", "deepspeed", "dist"]

#: Run by ``python3 -m nox`` (the README's test command and CI): the seed report's torch (FSDP2 on CPU through the
#: suite's stand-ins, tests/helpers/cpu_standins.py), the oldest and newest buggy that run FSDP2 on CPU, one fixed.
CI = ["2.5.1", "2.7.1", "2.12.1", "2.13.0"]
#: DeepSpeed's two checkpoints (reentrant ``checkpoint``, ``non_reentrant_checkpoint``), without its compiled ops.
DEEPSPEED = "0.19.8"
#: The whole suite on each; FSDP2 runs on CPU from 2.7, and on 2.4-2.6 through the suite's stand-ins.
CPU_MATRIX = ["2.4.1", "2.5.1", "2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1",
              "2.15.0"]
#: The torches ``nox -s bench`` measures on (and the benchmarks' smoke tests run on in CI).
BENCH_TORCHES = ["2.12.1", "2.13.0"]
#: Run only by the transformers sessions (they need transformers and accelerate); the others ignore them.
TRANSFORMERS_TESTS = ["tests/test_transformers.py", "tests/test_autoapply_transformers.py"]


#: Where the generators write: the pages of docs/ (README keeps only the headline cost).
TESTING_PAGE, BENCHMARKS_PAGE = "docs/testing.md", "docs/benchmarks.md"


def _install_torch(session: nox.Session, version: str) -> None:
    session.install(f"torch=={version}")  # uv honours UV_FIND_LINKS from the environment


#: The torch that runs the tests marked ``once`` (the package's own tooling, alike on every torch); the other CI
#: torches deselect them.
ONCE = "2.12.1"
#: Grid cells each CI torch samples (tests/test_grid.py), each with a seed of its own so that together they
#: cover more of the space: the most on the buggy torch most users run.
GRID = {"2.5.1": (150, 1), "2.7.1": (150, 2), "2.12.1": (400, 0), "2.13.0": (150, 3)}
#: The benchmarks' instruction-count smoke runs (valgrind's callgrind, minutes each): the counter and the A/B
#: step's (the step guard's script) on the first bench torch only; the hook overhead's and the growth's counts
#: run in ``nox -s bench``.
INSTRUCTION_SMOKES = "instructions_smoke or test_instruction_counter"
BENCH_ONLY_SMOKES = "hook_overhead_instructions_smoke or scaling_instructions_smoke"


def _pytest(session: nox.Session, torch: str, grid: tuple[int, int], ignored: list[str], *args: str) -> None:
    env = {"FSDP_AUTOCAST_FIX_GRID": str(grid[0]), "FSDP_AUTOCAST_FIX_GRID_SEED": str(grid[1])}
    session.run("python", "-m", "pytest", "-q", *(f"--ignore={path}" for path in ignored), *args, *session.posargs,
                env=env)


@nox.session(python="3.11")
@nox.parametrize("torch", CI, ids=CI)
def tests(session: nox.Session, torch: str) -> None:
    """The whole suite against one torch release, its own grid sample (:data:`GRID`); the benchmarks' smoke runs
    on the torches they measure on, the instruction counts on the first of them, the tests marked ``once`` on
    :data:`ONCE`."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    ignored = TRANSFORMERS_TESTS + ([] if torch in BENCH_TORCHES else ["tests/test_benchmarks_smoke.py"])
    deselect = ["-k", f"not ({INSTRUCTION_SMOKES if torch in BENCH_TORCHES[1:] else BENCH_ONLY_SMOKES})"]
    if torch != ONCE:
        deselect += ["-m", "not once"]
    _pytest(session, torch, GRID[torch], ignored, *deselect)


#: The contributor's quick check: one buggy and one fixed torch, a smaller grid sample, without the sessions'
#: slowest parts (the benchmarks' smoke runs, multi-rank launches, fresh interpreters of the tools).
QUICK = ["2.12.1", "2.13.0"]
QUICK_IGNORED = ["tests/test_benchmarks_smoke.py", "tests/test_mesh_2d.py", "tests/test_cpu_standins.py",
                 "tests/test_examples.py", "tests/test_autoapply.py", "tests/test_tools.py",
                 "tests/test_seed_two_ranks.py", "tests/test_report.py", "tests/test_training_parity.py"]


@nox.session(python="3.11")
@nox.parametrize("torch", QUICK, ids=QUICK)
def quick(session: nox.Session, torch: str) -> None:
    """``python3 -m nox -s quick``: most of the suite in minutes (see :data:`QUICK`); CI runs the whole of it."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    _pytest(session, torch, (80, 0), TRANSFORMERS_TESTS + QUICK_IGNORED)


#: transformers 4.x checkpoints each decoder layer's __call__ (hits the bug); 5.x does not.
TRANSFORMERS = [("2.12.1", "4.57.6"), ("2.12.1", "5.24.0"), ("2.13.0", "4.57.6")]
#: For the auto-apply import-order tests (``import accelerate`` first).
ACCELERATE = "1.15.0"


@nox.session(python="3.11")
@nox.parametrize("torch,transformers", TRANSFORMERS, ids=[f"{t}-{h}" for t, h in TRANSFORMERS])
def transformers(session: nox.Session, torch: str, transformers: str) -> None:
    """A tiny Hugging Face Llama trained with gradient checkpointing, stock and patched."""
    _install_torch(session, torch)
    session.install("-e", ".[test]", f"transformers=={transformers}", f"accelerate=={ACCELERATE}")
    session.run("python", "-m", "pytest", "-q", *TRANSFORMERS_TESTS, *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("torch", ["2.12.1", "2.13.0"], ids=["2.12.1", "2.13.0"])
def deepspeed(session: nox.Session, torch: str) -> None:
    """DeepSpeed's checkpoints: the named cases, ``preserve_autocast`` around them, and the sampled grid cells."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    session.install(f"deepspeed=={DEEPSPEED}", env={"DS_BUILD_OPS": "0"})
    session.run("python", "-m", "pytest", "-q", "tests/test_regressions.py", "tests/test_grid.py", "-k", "deepspeed",
                *session.posargs, env={"DS_ACCELERATOR": "cpu"})


@nox.session(python="3.11")
@nox.parametrize("torch", CI, ids=CI)
def grid(session: nox.Session, torch: str) -> None:
    """A seeded sample of the generated scenario space (tests/helpers/grid.py) on one torch: 1,500 cells by default.

    ``python3 -m nox -s "grid(2.12.1)" -- --sample 3000 --seed 1`` runs another (the whole product, millions
    of cells, is ``-- --all``). Writes
    ``grid/torch-<version>.json``; ``python3 -m nox -s grid-report`` puts the counts into docs/testing.md.
    """
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    os.makedirs("grid", exist_ok=True)
    what = list(session.posargs) or ["--sample", "1500"]
    session.run("python", "tests/scripts/grid_report.py", *what, "--json", f"grid/torch-{torch}.json", env=STANDINS_ENV)


@nox.session(python="3.11", name="grid-report")
def grid_report(session: nox.Session) -> None:
    """The scenario-space tables of docs/testing.md, from ``grid/torch-*.json`` (tests/helpers/grid.py, read for its
    dimensions, imports torch)."""
    import glob
    import re

    paths = sorted(glob.glob("grid/torch-*.json"))
    if not paths:
        session.error("no grid/torch-*.json: run the grid sessions first")
    _install_torch(session, "2.13.0")
    session.install("-e", ".[test]")
    tables = session.run("python", "-W", "ignore", "tests/scripts/grid_report.py", "--markdown", *paths, silent=True)
    block = f"<!-- grid:start -->\n{tables.strip()}\n<!-- grid:end -->"
    page = open(TESTING_PAGE).read()
    page = re.sub(r"<!-- grid:start -->.*?<!-- grid:end -->", lambda _: block, page, flags=re.S)
    open(TESTING_PAGE, "w").write(page)
    print(block)


#: The part of the suite run from the unpacked sdist: its helpers, the examples, the auto-apply in a fresh
#: interpreter, and the path check over every file the sdist holds.
DIST_TESTS = ["tests/test_hygiene.py", "tests/test_examples.py", "tests/test_autoapply.py",
              "-k", "test_hygiene or seed_fixed or fsdp_autocast_fix or unsupported"]


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """Build the sdist and the wheel and check them; then run part of the suite from the unpacked sdist, and
    leave both in ``dist/`` (README's install line).

    Fails on a build warning of deprecated configuration, on what ``tests/scripts/check_dist.py`` finds in the
    artefacts' contents and metadata, and on ``twine check --strict``. The suite runs against the installed
    wheel (pytest's own script, so the sdist's source folder is not on the path) and torch 2.13.0.
    """
    import glob
    import shutil
    import tarfile

    out = os.path.join(session.create_tmp(), "dist")
    shutil.rmtree(out, ignore_errors=True)
    log = session.run("uv", "build", "--out-dir", out, external=True, silent=True) or ""
    if "deprecat" in log.lower():
        session.error(f"the build warns of deprecated configuration:\n{log}")
    session.run("python", "tests/scripts/check_dist.py", out)
    session.install("twine")
    session.run("twine", "check", "--strict", *sorted(glob.glob(os.path.join(out, "*"))))

    (sdist,), (wheel,) = glob.glob(os.path.join(out, "*.tar.gz")), glob.glob(os.path.join(out, "*.whl"))
    with tarfile.open(sdist) as tar:
        tar.extractall(out, filter="data")
    _install_torch(session, "2.13.0")
    session.install("--reinstall-package", "fsdp-autocast-fix", f"{wheel}[test]")
    with session.chdir(sdist.removesuffix(".tar.gz")):
        # -P: no current folder on the path, as under pytest's script: the wheel is what gets imported.
        session.run("python", "-P", "-c", "import fsdp_autocast_fix as f; assert 'site-packages' in f.__file__")
        session.run("pytest", "-q", *DIST_TESTS)
    os.makedirs("dist", exist_ok=True)  # what README's install line takes
    for artefact in (sdist, wheel):
        shutil.copy2(artefact, "dist")


#: For scripts run outside pytest: the suite's CPU stand-ins where this torch needs them (tests/helpers/standins_site).
STANDINS_ENV = {"FSDP_AUTOCAST_FIX_TEST_CPU_STANDINS": "1", "PYTHONPATH": "tests/helpers/standins_site"}


@nox.session(python="3.11", name="matrix-run")
@nox.parametrize("torch", CPU_MATRIX, ids=CPU_MATRIX)
def matrix_run(session: nox.Session, torch: str) -> None:
    """One torch of the version matrix: the suite with a JUnit report, plus the measured scenario table."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    os.makedirs(".matrix", exist_ok=True)
    session.run("python", "-m", "pytest", "-q", f"--junitxml=.matrix/torch-{torch}.xml",
                *(f"--ignore={path}" for path in TRANSFORMERS_TESTS), success_codes=[0, 1])
    session.run("python", "tests/helpers/scenarios.py", "--json", f".matrix/torch-{torch}.json", env=STANDINS_ENV)


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """The whole version matrix, then ``matrix/results.json`` and the tables of docs/versions.md from it."""
    session.run("rm", "-rf", ".matrix", external=True)
    for torch in CPU_MATRIX:
        session.notify(f"matrix-run({torch})")
    session.notify("matrix-report")


@nox.session(python=False, name="matrix-report")
def matrix_report(session: nox.Session) -> None:
    """Fold ``.matrix/`` into ``matrix/results.json`` and docs' tables (fails if any run failed)."""
    session.run("python3", "tests/scripts/matrix_report.py")


@nox.session(python="3.11")
def doctor(session: nox.Session) -> None:
    """Install the project beside torch 2.12.1 (has the bug) and show the failure and the fix: the doctor's
    probe, stock and patched (it exits 1: the patch is needed there, and not active in its own process)."""
    _install_torch(session, "2.12.1")
    session.install(".")
    session.run("python", "-W", "ignore", "-m", "fsdp_autocast_fix", "doctor", success_codes=[0, 1])


@nox.session(python="3.11")
@nox.parametrize("torch", CI, ids=CI)
def table(session: nox.Session, torch: str) -> None:
    """Print the scenario table (stock / apply / late apply / patched_fully_shard) for one torch."""
    _install_torch(session, torch)
    session.install("-e", ".[test]")
    session.run("python", "tests/helpers/scenarios.py")


@nox.session(python=False)
def bench(session: nox.Session) -> None:
    """All benchmarks on this machine; writes benchmarks/results/, docs/benchmarks.md and README's headline.

    The headline is the in-process A/B step (patched against stock on the same torch build, model and ranks)
    on torch 2.12.1 and 2.13.0; then the hook overhead and the cost growth (each timed, and counted in
    instructions under valgrind's callgrind, which needs valgrind and a C compiler), the value check and the
    per-variant step table.
    Uses the environments of ``tests(2.12.1)`` and ``tests(2.13.0)``.
    """
    import datetime
    import platform
    import re

    session.run("python3", "-m", "nox", "-s", "tests(2.12.1)", "tests(2.13.0)", "--install-only", external=True)
    buggy, fixed = ".nox/tests-2-12-1/bin/python", ".nox/tests-2-13-0/bin/python"
    out = "benchmarks/results"
    os.makedirs(out, exist_ok=True)
    steps = session.posargs[0] if session.posargs else "10"

    def run(python: str, script: str, *args: str) -> str:
        return session.run(python, "-W", "ignore", f"benchmarks/{script}", *args, silent=True, external=True)

    tables = [
        ("A/B training step, torch 2.12.1: patched and stock alternated in one process (`benchmarks/ab_step.py`)",
         run(buggy, "ab_step.py", "--json", f"{out}/ab_step-2.12.1.json")),
        ("A/B training step, torch 2.13.0", run(fixed, "ab_step.py", "--json", f"{out}/ab_step-2.13.0.json")),
        ("A/B training step in instructions, torch 2.12.1 (`benchmarks/ab_step.py --instructions`, valgrind's "
         "callgrind, both ranks' rounds)",
         run(buggy, "ab_step.py", "--instructions", "--json", f"{out}/ab_step_instructions-2.12.1.json")),
        ("A/B training step in instructions, torch 2.13.0",
         run(fixed, "ab_step.py", "--instructions", "--json", f"{out}/ab_step_instructions-2.13.0.json")),
        ("Hook overhead, torch 2.12.1 (`benchmarks/hook_overhead.py`)",
         run(buggy, "hook_overhead.py", "--json", f"{out}/hook_overhead-2.12.1.json")),
        ("Hook overhead, torch 2.13.0", run(fixed, "hook_overhead.py", "--json", f"{out}/hook_overhead-2.13.0.json")),
        ("Hook overhead in instructions per call, torch 2.12.1 (`benchmarks/hook_overhead.py --instructions`, "
         "valgrind's callgrind)",
         run(buggy, "hook_overhead.py", "--instructions", "--json", f"{out}/hook_overhead_instructions-2.12.1.json")),
        ("Hook overhead in instructions per call, torch 2.13.0",
         run(fixed, "hook_overhead.py", "--instructions", "--json", f"{out}/hook_overhead_instructions-2.13.0.json")),
        ("Cost growth, torch 2.12.1: layers, micro-batches in flight, eval inputs alive (`benchmarks/scaling.py`)",
         run(buggy, "scaling.py", "--json", f"{out}/scaling-2.12.1.json")),
        ("Cost growth, torch 2.13.0", run(fixed, "scaling.py", "--json", f"{out}/scaling-2.13.0.json")),
        ("Cost growth in instructions, torch 2.12.1 (`benchmarks/scaling.py --instructions`, valgrind's callgrind)",
         run(buggy, "scaling.py", "--instructions", "--json", f"{out}/scaling_instructions-2.12.1.json")),
        ("Cost growth in instructions, torch 2.13.0",
         run(fixed, "scaling.py", "--instructions", "--json", f"{out}/scaling_instructions-2.13.0.json")),
        ("Value-level recompute check, torch 2.12.1 (`benchmarks/value_check.py`)",
         run(buggy, "value_check.py", "--json", f"{out}/value_check-2.12.1.json")),
        ("Peak memory of a checkpointed step, torch 2.12.1 (`benchmarks/memory.py`: torch's allocation record)",
         run(buggy, "memory.py", "--json", f"{out}/memory-2.12.1.json")),
        ("Peak memory, torch 2.13.0", run(fixed, "memory.py", "--json", f"{out}/memory-2.13.0.json")),
        ("Training step, torch 2.12.1 (`benchmarks/step.py`)",
         run(buggy, "step.py", "--steps", steps, "--json", f"{out}/step-2.12.1.json")),
        ("Training step, torch 2.13.0 stock", run(fixed, "step.py", "--variants", "de", "--steps", steps,
                                                  "--json", f"{out}/step-2.13.0.json")),
    ]
    session.run("python3", "-m", "nox", "-s", "chart", external=True)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    header = (f"Measured {datetime.date.today().isoformat()} with `python3 -m nox -s bench` on {os.cpu_count()} "
              f"CPU cores ({cpu}), gloo, 2 ranks for the step benchmarks (8 layers, hidden 256, sequence 128, "
              f"batch 2; the A/B: 180 rounds of one step per variant after 3 warm-up rounds, counted: 4; "
              f"`step.py`: {steps} "
              f"steps after 3 warm-up, each variant in its own processes).")
    body = "\n\n".join(f"**{title}**\n\n{text.strip()}" for title, text in tables)
    body += "\n\n![benchmarks](../benchmarks/results/benchmarks.png)"
    block = f"<!-- bench:start -->\n{header}\n\n{body}\n<!-- bench:end -->"
    with open(f"{out}/latest.md", "w") as f:
        f.write(block + "\n")
    page = open(BENCHMARKS_PAGE).read()
    page = re.sub(r"<!-- bench:start -->.*?<!-- bench:end -->", lambda _: block, page, flags=re.S)
    open(BENCHMARKS_PAGE, "w").write(page)
    readme = open("README.md").read()
    readme = re.sub(r"<!-- headline:start -->.*?<!-- headline:end -->", lambda _: _headline(out), readme, flags=re.S)
    open("README.md", "w").write(readme)
    print(block)


def _headline(results: str) -> str:
    """README's one-line cost summary, from the A/B step results."""
    import json

    parts = []
    for torch in ("2.12.1", "2.13.0"):
        r = json.load(open(f"{results}/ab_step-{torch}.json"))
        parts.append(f"torch {torch}: patched / stock {r['patched_over_stock']:.3f}, reentrant workaround / stock "
                     f"{r['reentrant_over_stock']:.3f}")
    counted = []
    for torch in ("2.12.1", "2.13.0"):
        r = json.load(open(f"{results}/ab_step_instructions-{torch}.json"))
        counted.append(f"{(r['patched_over_stock'] - 1) * 100:+.3f} % on {torch}")
    return ("<!-- headline:start -->\n**Cost**, training step time measured side by side in one process (same torch "
            "build, model and ranks; `benchmarks/ab_step.py`, see [Benchmarks](docs/benchmarks.md)): " +
            "; ".join(parts) + ". Counted in instructions (`--instructions`), the patch adds " +
            " and ".join(counted) + " to a step.\n<!-- headline:end -->")


@nox.session(python="3.11")
def chart(session: nox.Session) -> None:
    """benchmarks/results/benchmarks.png from the latest results (matplotlib, the ``plot`` extra)."""
    session.install("matplotlib")  # the plot extra; the chart needs no torch
    session.run("python", "benchmarks/chart.py")
