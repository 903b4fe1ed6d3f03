"""ringsplash.torch.ring_attention over torch.distributed (gloo), in spawned rings.

Rings of 2 and 4 processes (this file run as a script, ``--worker``, one
process per rank; gloo on 127.0.0.1 only). Importing torch and starting a
process group costs seconds, so each ring size is ONE group of processes that
runs every case in a loop and writes a JSON report per rank; the tests below
read those reports (one pytest test per case).

Cases, for each ring size: every layout (contiguous, zigzag, striped) x
{causal with GQA and a gradient through lse, a two-sided sliding window
(LocalMask), chunked causal, causal & segment ids whose documents cross shard
boundaries, full & segment ids with query rows that have no keys (out 0,
lse -inf, zero gradients), sinks with a causal window, MQA, Dv != D and a
gradient through lse, soft cap, a NumpyMask with fully masked rows}, plus one
bfloat16 case. Every rank draws the same seeded GLOBAL tensors; it runs the
ring on its shard (``shard_sequence``) and checks its out / lse / dq / dk / dv
and the full dsinks of ``loss = sum(out * w) [+ sum(lse * wl)]`` against

  (a) single-process ``ringsplash.torch.attention`` on the global tensors, and
  (b) a float64 dense attention written here in plain torch ops (masks read
      from ``ringsplash.reference.dense_mask``, independent of the C++
      kernels), differentiated by torch.autograd (which also checks dlse);

``gather_sequence(out)`` must equal (a)'s whole output.

Tolerances (f32), the error model of test_jax_ring.py / test_numpy_api.py:
out 2e-5 * max|v|, lse 2e-5 * max(1, max|lse|), dq/dk/dv 1e-4 * max|reference
gradient|, dsinks 1e-4 * sum_{b,i} exp(sink - lse) (|D| + |dlse|). Against (b)
these bound the kernel's own f32 error (f32 products and sums over <= 128
keys, ~1e-6 relative). Against (a) the ring adds only its f32 log-sum-exp merge
of N <= 4 partial results (a few roundings, ~N * 2^-24 relative) and the f32
sums of N partial dq/dk/dv -- far below the bounds. A wrong global position, a
mask term dropped across shards, segment ids not travelling with their slice
or dK/dV sent to the wrong rank moves results by O(1e-2) or more; a dsinks
summed N times is off by a factor N. bfloat16: results are rounded to bf16
(2^-8 relative) in both the ring and the single-process call, and the kernel
rounds P to bf16 for P.V: out 1.5e-2 * max|v|, gradients 3e-2 * max|grad|.

Failure handling, checked in the same groups: a call whose mask (or scale)
differs on one rank, and one where a single rank passes bad sinks, raise
ringsplash.InvalidArgumentError on EVERY rank (and the group stays usable:
the value cases run after them); finally one rank ``os._exit``s in the middle
of the backward ring and every surviving rank must report a RuntimeError within
its timeout. The survivors stay alive until all of them have reported, so a
rank whose neighbours are alive but stuck is caught by ``timeout=``, not by a
closed connection.
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))

WORLD_SIZES = (2, 4)
LAYOUTS = ("contiguous", "zigzag", "striped")
KILL_TIMEOUT = 4.0      # seconds: ring_attention(timeout=...) of the kill case
GROUP_DEADLINE = 240.0  # seconds: a whole group of workers, hard limit


# --------------------------------------------------------------------------
# Cases (plain data: the parent only needs their names).

def _value_cases():
    cases = []
    for layout in LAYOUTS:
        base = dict(layout=layout, B=2, S=64, H=4, Hkv=2, D=16, Dv=16, dtype="float32")
        cases += [
            dict(base, name=f"causal_gqa_lse-{layout}", mask=("causal",), lse_grad=True),
            dict(base, name=f"window-{layout}", S=128, Hkv=4, mask=("local", 12, 4)),
            dict(base, name=f"chunked-{layout}", S=128, mask=("chunked", 24)),
            dict(base, name=f"segments_causal-{layout}", S=128, mask=("causal",),
                 segments="crossing", lse_grad=True),
            dict(base, name=f"segments_empty_rows-{layout}", mask=("full",),
                 segments="empty_rows"),
            dict(base, name=f"sinks-{layout}", Hkv=1, Dv=24, mask=("local", 16, 0),
                 sinks=True, lse_grad=True),
            dict(base, name=f"softcap-{layout}", mask=("causal",), softcap=2.0, amp=2.0),
            dict(base, name=f"numpy_mask-{layout}", mask=("numpy",), sinks=True),
        ]
    cases.append(dict(name="bf16_causal_gqa-zigzag", layout="zigzag", B=2, S=64, H=4, Hkv=2,
                      D=16, Dv=16, dtype="bfloat16", mask=("causal",), sinks=True))
    for i, c in enumerate(cases):
        c["seed"] = 1000 + i
    return cases


ERROR_CASES = ("mismatch_mask", "mismatch_scale", "bad_sinks_on_rank_0")
VALUE_CASES = [c["name"] for c in _value_cases()]


# --------------------------------------------------------------------------
# The worker (one process per rank).

def _worker(rank, n, outdir):  # pragma: no cover - runs in the spawned processes
    import datetime

    import numpy as np
    import torch
    import torch.distributed as dist

    import ringsplash
    import ringsplash.torch as rt
    from ringsplash import masks as M
    from ringsplash import reference as R
    from ringsplash.torch import _ops
    from ringsplash.torch.ring import gather_sequence, ring_attention, shard_sequence

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=n,
                            timeout=datetime.timedelta(seconds=60))
    report = {}
    path = os.path.join(outdir, f"rank{rank}.json")

    def record(name, **entry):
        report[name] = entry
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)

    # -- building one case ---------------------------------------------------

    def make_mask(spec, S, gen):
        kind = spec[0]
        if kind == "causal":
            return M.CausalMask((S, S))
        if kind == "full":
            return M.FullMask((S, S))
        if kind == "local":
            return M.LocalMask((S, S), window_size=(spec[1], spec[2]))
        if kind == "chunked":
            return M.ChunkedCausalMask((S, S), spec[1])
        if kind == "numpy":
            a = torch.rand(S, S, generator=gen).numpy() < 0.3
            a[5] = False
            a[S - 3] = False  # fully masked rows (no sink on them: out 0, lse -inf)
            return M.NumpyMask(a)
        raise AssertionError(spec)

    def make_segments(kind, B, S):
        pos = torch.arange(S)
        if kind == "crossing":  # document boundaries that cut through every layout's shards
            q = torch.stack([(pos >= 21).int() + (pos >= 70).int(),
                             (pos >= 9).int() + (pos >= 50).int() + (pos >= 101).int()])
            return q, q.clone()
        # empty_rows: the keys' documents, but query rows 10..17 and 40..43 of batch 0
        # belong to documents no key has.
        kv = (pos >= S // 3).int().expand(B, S).clone()
        q = kv.clone()
        q[0, 10:18] = 7
        q[0, 40:44] = 8
        return q, kv

    def dense_reference(q, k, v, sinks, allowed, scale, cap):
        """float64 attention in plain torch ops (differentiable), SPEC §2."""
        group = q.shape[2] // k.shape[2]
        kh = k.repeat_interleave(group, dim=2)
        vh = v.repeat_interleave(group, dim=2)
        s = scale * torch.einsum("bqhd,bkhd->bhqk", q, kh)
        if cap is not None:
            s = cap * torch.tanh(s / cap)
        ninf = torch.tensor(float("-inf"), dtype=s.dtype)
        mx = torch.where(allowed, s, ninf).amax(-1)
        if sinks is not None:
            mx = torch.maximum(mx, sinks[None, :, None])
        mx = mx.detach()
        mx0 = torch.where(torch.isfinite(mx), mx, torch.zeros_like(mx))
        e = torch.where(allowed, torch.exp(s - mx0[..., None]), torch.zeros_like(s))
        total = e.sum(-1)
        if sinks is not None:
            total = total + torch.exp(sinks[None, :, None] - mx0)
        nonempty = total > 0
        safe = torch.where(nonempty, total, torch.ones_like(total))
        lse = torch.where(nonempty, mx0 + torch.log(safe), ninf)
        p = e / safe[..., None]
        return torch.einsum("bhqk,bkhd->bqhd", p, vh), lse

    def close(name, got, want, tol, failures):
        got = got.detach().to(torch.float64)
        want = want.detach().to(torch.float64)
        if got.shape != want.shape:
            failures.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
            return 0.0
        inf_g, inf_w = torch.isinf(got), torch.isinf(want)
        if not torch.equal(inf_g, inf_w) or not torch.equal(got[inf_g], want[inf_w]):
            failures.append(f"{name}: infinities differ")
            return float("inf")
        if torch.isnan(got).any():
            failures.append(f"{name}: NaN")
            return float("nan")
        fin = ~inf_w
        err = (got[fin] - want[fin]).abs().max().item() if fin.any() else 0.0
        if err > tol:
            failures.append(f"{name}: max error {err:.3g} > tolerance {tol:.3g}")
        return err

    def run_value_case(c):
        gen = torch.Generator().manual_seed(c["seed"])
        B, S, H, Hkv, D, Dv = c["B"], c["S"], c["H"], c["Hkv"], c["D"], c["Dv"]
        layout, amp = c["layout"], c.get("amp", 1.0)
        dtype = getattr(torch, c["dtype"])
        q = (amp * torch.randn(B, S, H, D, generator=gen)).to(dtype)
        k = (amp * torch.randn(B, S, Hkv, D, generator=gen)).to(dtype)
        v = torch.randn(B, S, Hkv, Dv, generator=gen).to(dtype)
        w = torch.randn(B, S, H, Dv, generator=gen)
        wl = torch.randn(B, H, S, generator=gen) if c.get("lse_grad") else None
        sinks = torch.randn(H, generator=gen) if c.get("sinks") else None
        mask = make_mask(c["mask"], S, gen)
        qs = ks = None
        if c.get("segments"):
            qs, ks = make_segments(c["segments"], B, S)
        cap = c.get("softcap")
        kw = dict(mask=mask, logits_soft_cap=cap, q_segment_ids=qs, kv_segment_ids=ks,
                  return_lse=True, block_sizes=(16, 16), num_threads=1)

        def loss_of(out, lse, w, wl):
            loss = (out.float() * w).sum()
            return loss if wl is None else loss + (lse * wl).sum()

        # (a) single process, whole sequence.
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        s_a = None if sinks is None else sinks.clone().requires_grad_()
        out_a, lse_a = rt.attention(*leaves, sinks=s_a, **kw)
        loss_of(out_a, lse_a, w, wl).backward()
        grads_a = [x.grad for x in leaves] + [None if s_a is None else s_a.grad]

        # (b) float64 dense reference.
        allowed = torch.from_numpy(R.dense_mask(mask, np.arange(S), np.arange(S)))[None]
        if qs is not None:
            allowed = allowed & (qs[:, None, :, None] == ks[:, None, None, :])
        leaves64 = [x.to(torch.float64).requires_grad_() for x in (q, k, v)]
        s_b = None if sinks is None else sinks.to(torch.float64).requires_grad_()
        out_b, lse_b = dense_reference(*leaves64, s_b, allowed, 1.0 / D ** 0.5, cap)
        loss_of(out_b, lse_b, w.double(), None if wl is None else wl.double()).backward()
        grads_b = [x.grad for x in leaves64] + [None if s_b is None else s_b.grad]

        # The ring, on this rank's shard.
        loc = [shard_sequence(x, layout=layout).requires_grad_() for x in (q, k, v)]
        s_r = None if sinks is None else sinks.clone().requires_grad_()
        kw_r = dict(kw)
        if qs is not None:
            kw_r["q_segment_ids"] = shard_sequence(qs, layout=layout)
            kw_r["kv_segment_ids"] = shard_sequence(ks, layout=layout)
        out_r, lse_r = ring_attention(*loc, layout=layout, sinks=s_r, timeout=60, **kw_r)
        loss_of(out_r, lse_r, shard_sequence(w, layout=layout),
                None if wl is None else shard_sequence(wl, layout=layout, dim=2)).backward()
        grads_r = [x.grad for x in loc] + [None if s_r is None else s_r.grad]
        gathered = gather_sequence(out_r.detach(), layout=layout)

        bf16 = dtype == torch.bfloat16
        vmax = v.abs().max().item()
        tol_out = (1.5e-2 if bf16 else 2e-5) * vmax
        tol_lse = 2e-5 * max(1.0, lse_b[torch.isfinite(lse_b)].abs().max().item())
        if bf16:
            tol_lse *= 50
        failures, errors = [], {}

        def shard(x, dim=1):
            return shard_sequence(x, layout=layout, dim=dim)

        for ref_name, out_ref, lse_ref, grads_ref in (("single", out_a, lse_a, grads_a),
                                                      ("f64", out_b, lse_b, grads_b)):
            errors[f"out/{ref_name}"] = close(f"out vs {ref_name}", out_r, shard(out_ref),
                                              tol_out, failures)
            errors[f"lse/{ref_name}"] = close(f"lse vs {ref_name}", lse_r, shard(lse_ref, 2),
                                              tol_lse, failures)
            for gname, g_r, g_ref in zip(("dq", "dk", "dv"), grads_r[:3], grads_ref[:3]):
                tol = (3e-2 if bf16 else 1e-4) * max(g_ref.abs().max().item(), 1e-30)
                errors[f"{gname}/{ref_name}"] = close(f"{gname} vs {ref_name}", g_r,
                                                      shard(g_ref), tol, failures)
            if sinks is not None:
                # scale of dsinks: sum over rows of exp(sink - lse) (|D| + |dlse|), in f64
                lse64 = lse_b.detach()
                fin = torch.isfinite(lse64)
                psink = torch.where(fin, torch.exp(s_b.detach()[None, :, None]
                                                   - torch.where(fin, lse64, 0.0)), 0.0)
                d_abs = (w.double() * out_b.detach()).sum(-1).abs().transpose(1, 2)
                if wl is not None:
                    d_abs = d_abs + wl.double().abs()
                tol = (3e-2 if bf16 else 1e-4) * (psink * d_abs).sum().item()
                errors[f"dsinks/{ref_name}"] = close(f"dsinks vs {ref_name}", grads_r[3],
                                                     grads_ref[3], tol, failures)
        errors["gather_sequence"] = close("gather_sequence(out) vs single", gathered, out_a,
                                          tol_out, failures)
        return failures, errors

    # -- error cases: every rank must raise --------------------------------------

    def run_error_case(name):
        S = 64
        gen = torch.Generator().manual_seed(7)
        q = torch.randn(1, S, 2, 16, generator=gen)
        loc = [shard_sequence(q) for _ in range(3)]
        kw = dict(mask=M.CausalMask((S, S)), block_sizes=(16, 16), num_threads=1, timeout=30)
        if name == "mismatch_mask" and rank == n - 1:
            kw["mask"] = M.LocalMask((S, S), window_size=(8, 0))
        if name == "mismatch_scale" and rank == 1:
            kw["scale"] = 0.3
        if name == "bad_sinks_on_rank_0":
            kw["sinks"] = torch.zeros(3 if rank == 0 else 2)
        try:
            ring_attention(*loc, **kw)
        except ringsplash.InvalidArgumentError as e:
            return dict(raised="InvalidArgumentError", message=str(e))
        except Exception as e:
            return dict(raised=type(e).__name__, message=str(e))
        return dict(raised=None, message="")

    # -- the killed rank ----------------------------------------------------------

    def run_kill_case():
        victim = 1
        S = 128
        gen = torch.Generator().manual_seed(11)
        x = torch.randn(1, S, 2, 16, generator=gen)
        loc = [shard_sequence(x).requires_grad_() for _ in range(3)]
        if rank == victim:

            def dying_step(*args, **kwargs):
                # In the middle of the backward ring: the slice has been sent on, the
                # dK/dV accumulators every other rank waits for have not.
                os._exit(17)

            _ops.backward_step = dying_step
        t0 = time.monotonic()
        try:
            out = ring_attention(*loc, mask=M.CausalMask((S, S)), block_sizes=(16, 16),
                                 num_threads=1, timeout=KILL_TIMEOUT)
            out.sum().backward()
        except Exception as e:
            return dict(raised=type(e).__name__, message=str(e)[:2000],
                        seconds=time.monotonic() - t0)
        return dict(raised=None, message="", seconds=time.monotonic() - t0)

    def run_helper_case():
        # shard_sequence / gather_sequence round trip along dim 2, and gather's gradient:
        # every rank's copy depends on this rank's rows, so the gradient is the sum.
        gen = torch.Generator().manual_seed(5)
        x = torch.randn(2, 3, 64, 5, generator=gen)
        wg = torch.randn(2, 3, 64, 5, generator=gen)
        failures = []
        for layout in LAYOUTS:
            loc = shard_sequence(x, layout=layout, dim=2).requires_grad_()
            y = gather_sequence(loc, layout=layout, dim=-2)
            (y * wg).sum().backward()
            if not torch.equal(y.detach(), x):
                failures.append(f"{layout}: gather(shard(x)) != x")
            if not torch.allclose(loc.grad, n * shard_sequence(wg, layout=layout, dim=2)):
                failures.append(f"{layout}: gather_sequence gradient")
        return dict(ok=not failures, failures=failures)

    # -- the loop -------------------------------------------------------------------

    for name in ERROR_CASES:
        record(name, **run_error_case(name))
    record("shard_gather", **run_helper_case())
    for c in _value_cases():
        t0 = time.monotonic()
        try:
            failures, errors = run_value_case(c)
        except Exception as e:  # reported; the other ranks may then fail or time out
            import traceback
            failures, errors = [f"raised {type(e).__name__}: {e}\n{traceback.format_exc()}"], {}
        record(c["name"], ok=not failures, failures=failures, errors=errors,
               seconds=time.monotonic() - t0)
    record("kill", **run_kill_case())
    # Stay alive (and connected) until every survivor has reported, so that ranks
    # whose neighbours are alive but stuck must rely on the timeout.
    release = os.path.join(outdir, "release")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.05)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# --------------------------------------------------------------------------
# The parent: one group of processes per ring size.

def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _run_group(n, outdir):
    env = dict(os.environ)
    # The workers import the ringsplash this process imported (the installed
    # package in CI, the source tree where PYTHONPATH points there).
    spec = importlib.util.find_spec("ringsplash")
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(spec.origin)))
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root] + [p for p in [env.get("PYTHONPATH")] if p])
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               OMP_NUM_THREADS="1", RINGSPLASH_NUM_THREADS="1", WORLD_SIZE=str(n))
    if os.path.exists("/sys/class/net/lo"):  # Linux: gloo's own sockets on loopback too
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.pop("TORCH_DISTRIBUTED_DEBUG", None)
    procs, logs = [], []
    t0 = time.monotonic()
    for r in range(n):
        log = open(os.path.join(outdir, f"rank{r}.log"), "w")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", str(r), str(n), outdir],
            env=dict(env, RANK=str(r)), stdout=log, stderr=subprocess.STDOUT, cwd=REPO))
    survivors = [r for r in range(n) if r != 1]
    released = False
    while time.monotonic() - t0 < GROUP_DEADLINE:
        if not released:
            reports = [_read(os.path.join(outdir, f"rank{r}.json")) for r in survivors]
            if all("kill" in rep for rep in reports):
                open(os.path.join(outdir, "release"), "w").close()
                released = True
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()
    for log in logs:
        log.close()
    reports = [_read(os.path.join(outdir, f"rank{r}.json")) for r in range(n)]
    logs = []
    for r in range(n):
        with open(os.path.join(outdir, f"rank{r}.log")) as f:
            logs.append(f.read()[-3000:])
    return dict(reports=reports, logs=logs, seconds=time.monotonic() - t0,
                returncodes=[p.returncode for p in procs])


_GROUPS = {}


@pytest.fixture(scope="module")
def group():
    if importlib.util.find_spec("torch") is None:
        pytest.skip("PyTorch is not installed")
    tmp = tempfile.TemporaryDirectory(prefix="ringsplash_torch_ring_")

    def get(n):
        if n not in _GROUPS:
            outdir = os.path.join(tmp.name, f"n{n}")
            os.makedirs(outdir)
            _GROUPS[n] = _run_group(n, outdir)
        return _GROUPS[n]

    yield get
    _GROUPS.clear()
    tmp.cleanup()


def _entries(g, name):
    """Every rank's report of case ``name``; fails with the workers' logs if one is missing."""
    missing = [r for r, rep in enumerate(g["reports"]) if name not in rep]
    if missing:
        pytest.fail(f"ranks {missing} did not report case {name!r}; return codes "
                    f"{g['returncodes']}; logs:\n" + "\n---\n".join(
                        g["logs"][r] for r in missing))
    return [rep[name] for rep in g["reports"]]


@pytest.mark.parametrize("name", VALUE_CASES)
@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_matches_single_process(group, n, name):
    entries = _entries(group(n), name)
    bad = {r: e["failures"] for r, e in enumerate(entries) if not e["ok"]}
    assert not bad, f"ring of {n}, case {name}: {bad}"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_shard_and_gather_sequence(group, n):
    entries = _entries(group(n), "shard_gather")
    bad = {r: e["failures"] for r, e in enumerate(entries) if not e["ok"]}
    assert not bad, bad


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_mismatched_mask_raises_on_every_rank(group, n):
    for r, e in enumerate(_entries(group(n), "mismatch_mask")):
        assert e["raised"] == "InvalidArgumentError", (r, e)
        assert "mask differs" in e["message"], (r, e["message"])
        assert "CausalMask" in e["message"] and "LocalMask" in e["message"], e["message"]


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_mismatched_scale_raises_on_every_rank(group, n):
    for r, e in enumerate(_entries(group(n), "mismatch_scale")):
        assert e["raised"] == "InvalidArgumentError", (r, e)
        assert "scale differs" in e["message"], (r, e["message"])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_bad_argument_on_one_rank_raises_on_every_rank(group, n):
    for r, e in enumerate(_entries(group(n), "bad_sinks_on_rank_0")):
        assert e["raised"] == "InvalidArgumentError", (r, e)
        assert "sinks" in e["message"], (r, e["message"])
        if r != 0:
            assert "rank 0" in e["message"], (r, e["message"])


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_killed_rank_errors_every_other_rank(group, n):
    g = group(n)
    assert g["seconds"] < GROUP_DEADLINE, "the group had to be killed (a hang)"
    assert g["returncodes"][1] == 17, g["returncodes"]  # the victim died where planned
    for r in range(n):
        if r == 1:
            continue
        e = g["reports"][r].get("kill")
        assert e is not None, f"rank {r} never reported:\n{g['logs'][r]}"
        assert e["raised"] == "RuntimeError", (r, e)
        assert "ring_attention: rank" in e["message"], (r, e["message"])
        # a closed connection fails at once; a stuck live neighbour after KILL_TIMEOUT
        assert e["seconds"] < KILL_TIMEOUT + 10, (r, e["seconds"])


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
