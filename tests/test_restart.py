"""A killed rank costs a restart, not the run: examples/train.py under ``torchrun --max-restarts 1``.

Three launches of ``python -m torch.distributed.run --standalone --nproc-per-node 2
--max-restarts 1`` (tp=2 over gloo, the tiny Llama, 24 steps, an async sharded checkpoint
every 4): an uninterrupted run, a run whose rank 1 is SIGKILLed in the middle of step 10,
and one whose rank 1 is SIGKILLed in the middle of the async save of step 16 (its files
written, the directory not yet published). The kills come from the example's own fault
injection, ``TPCOMPILE_TEST_KILL_AT``, which fires on torchrun's first attempt only.

Each killed run must show a second attempt (torchrun's restart count 1) that resumed
from the checkpoint before the kill (step 8, resp. step 12: the save that was cut short
never became ``latest``), log every step's loss equal to the uninterrupted run's (rel 1e-5,
the final one included), and export the same weights.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from test_examples import SCRIPT, STEP_RE

REL = 1e-5
STEPS, SAVE_EVERY = 24, 4
RESTART_LINE = "torchrun restart 1 of at most 1"
RESUMED_RE = re.compile(r"^resumed from (\S+) at step (\d+)$", re.MULTILINE)


@dataclass
class Run:
    """What one torchrun launch logged, split at the restart."""

    attempts: list[dict[int, float]]  # the losses rank 0 logged in each attempt
    stdout: str
    stderr: str
    root: Path

    @property
    def losses(self) -> dict[int, float]:
        """Each step's loss as last logged (a restart recomputes the steps after its checkpoint)."""
        return {step: loss for attempt in self.attempts for step, loss in attempt.items()}


def _torchrun(root: Path, kill: str | None = None) -> Run:
    """examples/train.py on 2 CPU processes under torchrun with one restart allowed."""
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--max-restarts", "1", str(SCRIPT), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
           "--batch", "4", "--seq", "32", "--ckpt-dir", str(root / "ckpt"), "--out-dir", str(root / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TPCOMPILE_TEST_KILL_AT", None)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # the recipe as documented: the shared store
    if kill:
        env["TPCOMPILE_TEST_KILL_AT"] = kill
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    attempts = [{int(s): float(v) for s, v in STEP_RE.findall(part)}
                for part in proc.stdout.split(RESTART_LINE)]
    return Run(attempts, proc.stdout, proc.stderr, root)


def _weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted((root / "out").glob("*.safetensors"))
    assert files, f"no export in {root / 'out'}"
    return {k: v for f in files for k, v in load_file(str(f)).items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    run = _torchrun(tmp_path_factory.mktemp("uninterrupted"))
    assert len(run.attempts) == 1 and sorted(run.attempts[0]) == list(range(1, STEPS + 1))
    assert run.attempts[0][STEPS] < run.attempts[0][1]  # it trains
    return run


def _check_restarted(run: Run, want: Run, *, killed: str, resumed_at: int, last_before: int) -> None:
    """One SIGKILL, one restart from ``step-<resumed_at>``, the uninterrupted run's losses
    and weights; the first attempt logged steps 1..``last_before`` (at least)."""
    assert f"SIGKILL rank 1 {killed}" in run.stdout, run.stdout[-3000:]
    assert re.search(r"exitcode\s*:?\s*-9", run.stderr), run.stderr[-3000:]  # torchrun saw the SIGKILL
    assert len(run.attempts) == 2, f"expected exactly one restart:\n{run.stdout[-3000:]}"
    first, second = run.attempts
    assert list(first) == list(range(1, len(first) + 1)) and len(first) >= last_before, sorted(first)
    resumed = RESUMED_RE.findall(run.stdout.split(RESTART_LINE)[1])
    assert [(Path(p).name, int(s)) for p, s in resumed] == [(f"step-{resumed_at:08d}", resumed_at)], resumed
    assert list(second) == list(range(resumed_at + 1, STEPS + 1))  # nothing before it is recomputed
    for attempt in run.attempts:
        for step, loss in attempt.items():
            assert loss == pytest.approx(want.losses[step], rel=REL), (step, loss, want.losses[step])
    assert run.losses[STEPS] == pytest.approx(want.losses[STEPS], rel=REL)
    assert (run.root / "ckpt" / "latest").read_text().strip() == f"step-{STEPS:08d}"
    got, other = _weights(run.root), _weights(want.root)
    assert sorted(got) == sorted(other)
    for k, v in got.items():
        torch.testing.assert_close(v, other[k], rtol=0, atol=1e-6, msg=k)


@pytest.mark.slow
def test_rank_killed_mid_step_costs_one_restart(tmp_path: Path, uninterrupted: Run) -> None:
    run = _torchrun(tmp_path, kill="step:10")
    # step 10 was cut after its backward: the first attempt logged 1..9, the restart
    # resumed from the step-8 checkpoint and recomputed 9 and 10 exactly
    _check_restarted(run, uninterrupted, killed="in the middle of step 10", resumed_at=8, last_before=9)
    assert sorted(run.attempts[0]) == list(range(1, 10))


@pytest.mark.slow
def test_rank_killed_mid_async_save_resumes_from_the_previous_checkpoint(tmp_path: Path,
                                                                        uninterrupted: Run) -> None:
    run = _torchrun(tmp_path, kill="save:16")
    # training went on while step 16's save was in flight; the save never published, so
    # the restart resumed from step 12
    _check_restarted(run, uninterrupted, killed="in the middle of the async save of step 16",
                     resumed_at=12, last_before=16)
    partial = [p for p in (tmp_path / "ckpt").iterdir() if p.name.startswith(".step-00000016.partial-")]
    assert len(partial) == 1, sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert any(partial[0].iterdir())  # the kill came after the files were written
