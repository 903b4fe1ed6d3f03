"""Comparisons the Python tests share: a result against the float64 reference."""

import numpy as np


def f64(x):
    """x as a float64 NumPy array (None stays None)."""
    return None if x is None else np.asarray(x).astype(np.float64)


def assert_close(name, got, want, atol, rtol=0.0):
    """|got - want| <= atol + rtol |want| where want is finite; -inf exactly where
    want has it; never NaN. ``want`` is the float64 reference."""
    got = np.asarray(got).astype(np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert not np.isnan(got).any(), f"{name}: NaN in result"
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want),
                                  err_msg=f"{name}: -inf pattern differs")
    fin = np.isfinite(want)
    err = np.abs(got[fin] - want[fin])
    bound = atol + rtol * np.abs(want[fin])
    if err.size and not np.all(err <= bound):
        i = np.argmax(err - bound)
        raise AssertionError(f"{name}: error {err[i]:.3g} > bound {bound[i]:.3g} at flat index "
                             f"{i} (max error {err.max():.3g}, atol {atol:.3g})")
