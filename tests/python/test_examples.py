"""The examples run, and their printed differences against the float64 (or
single-process) results are within f32 rounding.

Small sizes keep this quick; the examples' own defaults are larger. Bounds:
out is a convex combination of v rows (|v| ~ 1 after the projections), so an
f32 kernel's error is ~1e-6; 1e-4 leaves room for the projections' rounding
without letting a wrong mask (differences ~1e-1) pass.
"""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(script, *args, timeout=240):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                            capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def _differences(text, pattern):
    values = [float(v) for v in re.findall(pattern, text)]
    assert values, f"no '{pattern}' in the output:\n{text}"
    return values


@pytest.mark.parametrize("layer", ["sliding", "full"])
def test_gpt_oss_example(layer):
    out = _run("gpt_oss_attention.py", "--seq", "256", "--hidden", "256", "--heads", "8",
               "--kv-heads", "2", "--iters", "1", "--layer", layer)
    diffs = _differences(out, r"max \|out - reference\| = ([0-9.e+-]+)")
    assert len(diffs) == 2 and max(diffs) < 1e-4, out  # ringsplash and SDPA (+ sink column)


def test_gemma2_example():
    out = _run("gemma2_attention.py", "--seq", "256", "--hidden", "256", "--heads", "4",
               "--kv-heads", "2", "--head-dim", "64", "--window", "64", "--iters", "1")
    assert "ringsplash" in out
    diffs = _differences(out, r"ringsplash\s.*?max \|out - reference\| = ([0-9.e+-]+)")
    assert max(diffs) < 1e-4, out


def test_torch_ring_example():
    out = _run("torch_ring.py", "--seq", "256", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "32", "--nproc", "2")
    diffs = _differences(out, r"max \|(?:out|dq) - single-process (?:out|dq)\| = ([0-9.e+-]+)")
    assert len(diffs) == 2 and max(diffs) < 1e-4, out
