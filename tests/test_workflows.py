"""The GitHub workflows: CI runs the README's test command on every push and pull request, and the
release workflow publishes only after that same CI passed on the tagged commit."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOWS = REPO / ".github" / "workflows"


def load(name: str) -> dict:
    workflow = yaml.safe_load((WORKFLOWS / name).read_text())
    workflow["on"] = workflow.get("on", workflow.pop(True, None))  # YAML 1.1 reads a bare `on` as true
    return workflow


def readme_test_command() -> str:
    block = re.search(r"\n### Run the tests\n.*?```bash[^\n]*\n(.+?)\n```", (REPO / "README.md").read_text(), re.S)
    assert block, "README.md lost its 'Run the tests' block"
    return block[1].strip()


def test_ci_runs_the_readme_test_command_on_pushes_and_pull_requests() -> None:
    ci = load("ci.yml")
    assert {"push", "pull_request", "workflow_call"} <= set(ci["on"])
    (job,) = ci["jobs"].values()
    runs = [step.get("run", "") for step in job["steps"]]
    assert readme_test_command() in runs  # verbatim, as .ci/run runs it
    installs = next(run for run in runs if "apt-get install" in run)
    assert all(package in installs.split() for package in ("chromium", "iproute2", "nginx"))


def test_the_release_builds_only_after_ci_passed() -> None:
    release = load("release.yml")
    jobs = release["jobs"]
    gate = [name for name, job in jobs.items() if job.get("uses") == "./.github/workflows/ci.yml"]
    assert len(gate) == 1
    needs = {name: job.get("needs") for name, job in jobs.items()}
    assert needs["build"] == gate[0] and needs["publish"] == "build"  # publish <- build <- the test suite
