"""Deployment files name real commands of the project and real files of the repository."""

from __future__ import annotations

import configparser
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _cli_help(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skillswarm.cli", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_systemd_unit_runs_a_real_command():
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "deploy" / "skillswarm-node.service")
    argv = shlex.split(unit["Service"]["ExecStart"])
    assert Path(argv[0]).name == "skillswarm"
    assert argv[1:3] == ["node", "run"]
    assert _cli_help(argv[1:3]).returncode == 0
    assert unit["Service"]["KillSignal"] == "SIGTERM"


def test_coordinator_image_copies_real_paths_and_runs_a_real_command():
    import json

    lines = (ROOT / "deploy" / "coordinator.Dockerfile").read_text().splitlines()
    for line in lines:
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), source
    (cmd,) = [json.loads(line[4:]) for line in lines if line.startswith("CMD ")]
    assert cmd[:3] == ["skillswarm", "coordinator", "serve"]
    assert _cli_help(cmd[1:3]).returncode == 0
