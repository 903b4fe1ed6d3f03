"""Ring attention over torch.distributed: causal attention on a sequence split over 4 ranks.

    torchrun --nproc-per-node 4 examples/torch_ring.py        # torchrun starts the ranks
    python examples/torch_ring.py [--nproc 4]                  # this script spawns them

Each rank draws the same seeded global q, k, v (a real model would produce its own
rows), keeps its zigzag slice (``shard_sequence``), runs ``ring_attention`` forward
and backward over gloo, and prints its time. Rank 0 then gathers the output and the
query gradient (``gather_sequence``) and prints the largest difference from
single-process ``ringsplash.torch.attention`` on the whole sequence (float32: expect
~1e-6). Options: --seq, --heads, --kv-heads, --head-dim, --layout, --nproc, --threads.
Needs ``pip install 'ringsplash[torch]'`` (in this repository: scripts/setup.sh puts it into .venv; run it with .venv/bin/python or .venv/bin/torchrun).
"""

import argparse
import datetime
import os
import socket
import time

import torch
import torch.distributed as dist

from ringsplash.masks import CausalMask
from ringsplash.torch import attention
from ringsplash.torch.ring import gather_sequence, ring_attention, shard_sequence


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=2048, help="global sequence length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2, help="GQA: key/value heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "contiguous", "striped"))
    p.add_argument("--nproc", type=int, default=4, help="ranks to spawn (without torchrun)")
    p.add_argument("--threads", type=int, default=0,
                   help="kernel threads per rank (0: this machine's cores / ranks)")
    return p.parse_args()


def run(args):
    rank, n = dist.get_rank(), dist.get_world_size()
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", n))
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // local_ranks)
    torch.set_num_threads(threads)

    B, S, H, Hkv, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, S, H, D, generator=gen)
    k = torch.randn(B, S, Hkv, D, generator=gen)
    v = torch.randn(B, S, Hkv, D, generator=gen)
    dout = torch.randn(B, S, H, D, generator=gen)
    mask = CausalMask((S, S))

    # This rank's rows, in the layout's order.
    q_l, k_l, v_l = (shard_sequence(x, layout=args.layout).requires_grad_() for x in (q, k, v))
    dout_l = shard_sequence(dout, layout=args.layout)

    dist.barrier()
    t0 = time.perf_counter()
    out_l = ring_attention(q_l, k_l, v_l, layout=args.layout, mask=mask, num_threads=threads)
    t1 = time.perf_counter()
    out_l.backward(dout_l)
    t2 = time.perf_counter()
    for r in range(n):  # one line per rank, in rank order
        if r == rank:
            print(f"rank {rank}/{n}: forward {1e3 * (t1 - t0):7.1f} ms, backward "
                  f"{1e3 * (t2 - t1):7.1f} ms ({threads} threads, {S // n} of {S} rows)",
                  flush=True)
        dist.barrier()

    out = gather_sequence(out_l.detach(), layout=args.layout)
    dq = gather_sequence(q_l.grad, layout=args.layout)
    if rank == 0:
        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
        t3 = time.perf_counter()
        ref = attention(qg, kg, vg, mask=mask, num_threads=threads)
        ref.backward(dout)
        t4 = time.perf_counter()
        print(f"single process ({threads} threads): forward + backward "
              f"{1e3 * (t4 - t3):.1f} ms")
        print(f"max |out - single-process out| = {(out - ref).abs().max().item():.3g}, "
              f"max |dq - single-process dq| = {(dq - qg.grad).abs().max().item():.3g} "
              f"(B={B}, S={S}, H={H}, Hkv={Hkv}, D={D}, {args.layout}, causal, "
              f"{n} ranks, gloo)", flush=True)


def worker(rank, n, port, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n))
    main(args)


def main(args):
    # A dead or stuck rank ends the others with an error after this timeout.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    args = parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        main(args)
    else:  # plain `python examples/torch_ring.py`: spawn the ranks on this machine
        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args.nproc, port, args), nprocs=args.nproc)
