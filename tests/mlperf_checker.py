"""MLPerf's own compliance checker (HPC ruleset 3.0.0) over one log, as a submitter runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def checker_failures(log: Path, cwd: Path) -> tuple[list[str], str]:
    """The checker's failed checks and errors on `log`, and everything it printed."""
    done = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage",
                           "hpc", "--ruleset", "3.0.0", str(log)], capture_output=True, text=True,
                          cwd=cwd)  # it writes compliance_checker.log where it runs
    text = done.stdout + done.stderr
    return [line for line in text.splitlines() if "Failed" in line or "ERROR" in line
            and "FAILED" not in line], text
