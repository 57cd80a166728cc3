"""metrics.jsonl on resume: the torn-line repair is killed mid-write and loses nothing.

The repair runs in a child process whose file-size limit (RLIMIT_FSIZE) is below the size of
the repaired file, with SIGXFSZ at its default action: the kernel kills it at that byte of
its write, a real kill at a known point (Python itself ignores SIGXFSZ).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

from rlflow.train.metrics import METRICS_FILE, read_metrics

REPAIR = """
import resource, signal, sys
from pathlib import Path
from rlflow.train.metrics import MetricsLog

limit = int(sys.argv[2])
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # the kernel's default: end the process
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
log = MetricsLog(Path(sys.argv[1]), enabled=True, tensorboard=False, progress_bar=False, total_steps=200)
log.truncate_after(150)  # the resume: from the checkpoint of step 150
"""


def test_a_resume_killed_while_it_repairs_metrics_loses_no_step(tmp_path):
    lines = [json.dumps({"step": s, "train/reward": s / 200}) for s in range(1, 201)]
    path = tmp_path / METRICS_FILE
    path.write_text("\n".join(lines) + '\n{"step": 201, "train/rew')  # torn by the crash
    kept = sum(len(line) + 1 for line in lines[:150])
    root = Path(__file__).resolve().parents[2]
    killed = subprocess.run(
        [sys.executable, "-c", REPAIR, str(tmp_path), str(kept // 2)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert killed.returncode == -signal.SIGXFSZ, killed.stderr  # killed mid-write
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 201))
    repaired = subprocess.run(
        [sys.executable, "-c", REPAIR, str(tmp_path), str(10 * kept)],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert repaired.returncode == 0, repaired.stderr
    assert "removed a torn last line" in repaired.stderr
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, 151))
