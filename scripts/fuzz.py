"""Coverage-guided fuzzing of the parsers that take bytes from outside (harness/fuzz_targets.py),
with atheris (libFuzzer for Python), each target for a time budget, seeded from and adding to
`tests/fuzz/corpus/TARGET/` (the inputs it grows stay in `.fuzz/TARGET/`, outside git). A finding
stops its target and is written to `.fuzz/findings/TARGET-crash-<hash>`: fix it, then move the
file to `tests/fuzz/corpus/TARGET/finding-<hash>`, where the corpus test replays it.

    .venv/bin/python -m scripts.fuzz [--seconds 180] [TARGET ...]   # `make fuzz`

atheris is installed into .venv on first use (it is not a runtime dependency). Each target runs
in a process of its own (libFuzzer owns the process); the summary prints executions and the
corpus each one grew to.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "tests" / "fuzz" / "corpus"  # the seeds and past findings, read only
WORK = ROOT / ".fuzz"  # the corpus each target grows, and findings
FINDINGS = WORK / "findings"
ATHERIS = "atheris==3.0.0"
# Coverage is collected in the project's own code only (instrumenting torch would take minutes).
INSTRUMENTED = ["common", "harness", "protos"]


def fuzz_one(name: str, seconds: int) -> None:
    """Inside the child process: libFuzzer's loop over `name`'s one-input function."""
    import atheris

    with atheris.instrument_imports(include=INSTRUMENTED):
        from harness.fuzz_targets import TARGETS
    target = TARGETS[name]
    grown = WORK / name
    grown.mkdir(parents=True, exist_ok=True)
    FINDINGS.mkdir(exist_ok=True)
    argv = [sys.argv[0], str(grown), str(CORPUS / name), f"-max_total_time={seconds}", f"-timeout={max(1, int(target.seconds * 10))}",
            f"-artifact_prefix={FINDINGS}/{name}-", "-rss_limit_mb=4096", "-print_final_stats=1"]
    atheris.Setup(argv, target.run)
    atheris.Fuzz()


def _ensure_atheris() -> None:
    try:
        import atheris  # noqa: F401
    except ImportError:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", ATHERIS], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", default=[], metavar="TARGET",
                        help="fuzz targets of harness/fuzz_targets.py (default: all)")
    parser.add_argument("--seconds", type=int, default=180, help="budget per target (default %(default)s)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        fuzz_one(args.child, args.seconds)
        return
    from harness.fuzz_targets import TARGETS

    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        parser.error(f"unknown targets {', '.join(unknown)}; the targets are {', '.join(TARGETS)}")
    _ensure_atheris()
    failed = []
    print(f"{'target':<18}{'executions':>12}{'corpus':>8}   verdict")
    for name in args.targets or list(TARGETS):
        run = subprocess.run([sys.executable, "-m", "scripts.fuzz", "--child", name, "--seconds", str(args.seconds)],
                             capture_output=True, text=True, cwd=ROOT)
        runs = re.findall(r"stat::number_of_executed_units: (\d+)", run.stderr)
        verdict = "no finding" if run.returncode == 0 else "FINDING: " + _finding(run.stderr)
        if run.returncode != 0:
            failed.append(name)
        corpus = len(list((WORK / name).iterdir())) if (WORK / name).is_dir() else 0
        print(f"{name:<18}{runs[-1] if runs else '?':>12}{corpus:>8}   {verdict}", flush=True)
    if failed:
        sys.exit(f"findings in {', '.join(failed)} (inputs under {FINDINGS})")


def _finding(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "Error" in line or "Exception" in line or "artifact" in line]
    return " | ".join(lines[-3:]) or stderr.strip().splitlines()[-1]


if __name__ == "__main__":
    main()
