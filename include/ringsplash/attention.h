// Single-device block-sparse flash attention (SPEC §1–§2).
//
// Shapes (model layout; any strides, so [B,H,S,D] memory works as a view):
//   q     [B, Sq, H, D]       f32 | bf16 | f16
//   k     [B, Skv, Hkv, D]    same dtype as q, H % Hkv == 0 (GQA/MQA)
//   v     [B, Skv, Hkv, Dv]   same dtype as q
//   out   [B, Sq, H, Dv]      same dtype as q (or f32)
//   lse   [B, H, Sq]          f32
//   sinks [H]                 f32 (optional); finite, or -inf: no sink
//   q_segments [B, Sq], kv_segments [B, Skv]  i32 (optional, both or neither)
// Query head h reads key/value head h / (H / Hkv); K/V are never replicated.
// Accumulation is f32 whatever the input dtype.
//
// What is computed, for batch b, query head h, query row i (SPEC §2):
//   s_ij  = scale * (q_i . k_j), then cap * tanh(s_ij / cap) with a soft cap,
//           over the keys j that the mask and the segment ids allow;
//   lse_i = log(sum_j exp(s_ij) + exp(sinks[h]))   (natural log; the sink
//           term only with sinks): the log of the row's whole softmax
//           denominator, sinks included;
//   out_i = sum_j exp(s_ij - lse_i) * v_j.
// A sink is one extra logit per query head that joins every row's
// denominator but carries no value, so a head can attend "nowhere": its
// weights on the keys then sum to less than 1. sinks[h] = -inf is no sink
// for head h (exp(-inf) = 0; its dsinks is 0); a NaN or +inf sink is an
// Error. A row with no allowed key has out = 0 and lse = sinks[h], or
// lse = -inf without a sink (gradients 0 — never NaN).
// Merging partial results (attention over two key ranges by two calls:
// lse = logaddexp(lse_a, lse_b), out = exp(lse_a - lse) out_a +
// exp(lse_b - lse) out_b) counts every sink that either part was given:
// give the sinks to one part only, or to none and add them to the merged
// rows (lse' = logaddexp(lse, sinks[h]), out' = exp(lse - lse') out). The
// ring (ring.h) merges its steps itself and adds the sinks once.
// Backward: dsinks[h] = -sum_{b,i} exp(sinks[h] - lse_i) (dout_i . out_i).
//
// Memory. No output (AttentionForward: out, lse; AttentionBackward: dq, dk,
// dv, dsinks) may share a byte with an input (q, k, v, sinks, q_segments,
// kv_segments; in the backward also out, lse, dout) or with another output:
// the kernels write outputs while they still read inputs (the backward
// zeroes an f32 dq before it has read q), so such a call would be silently
// wrong. It is an Error naming both arguments ("dq: expected memory shared
// with no input or other output, got a view overlapping q (...)"), thrown
// before anything is written. Shared bytes count, not address ranges: views
// that interleave in one buffer without sharing an element pass (out beside
// q in one [B, S, 2, H, D] buffer; dq, dk, dv as slices of one packed dqkv);
// only views too intricate for the check's bounded search to decide (any
// layout whose strides nest takes a few steps) are refused without sharing
// a byte. Inputs may share memory with each other (q = k, a packed qkv, out
// passed again as dout).
//
// Threads. Any number of threads may call AttentionForward,
// AttentionBackward, ValidateAttentionInputs and ReleaseCachedThreads at
// once: each call leases a worker pool of its own (a concurrent caller gets
// another pool), Masks are immutable, and every call gives bitwise what it
// gives alone. Concurrent calls may read the same inputs; none may write
// memory another running call reads or writes (the memory rule across calls,
// which the library cannot check). A call returns only once its workers are
// done with its buffers.
//
// Errors. The argument checks (ringsplash::Error naming the argument, what
// was expected and what was given) all run before anything is written:
// after such an Error every output is untouched. A failure after them — a
// finite result too large for an f16/bf16 output (an Error naming it), or
// memory or threads running out (Error or std::bad_alloc) — can leave the
// call's outputs partly written, to be treated as garbage: out and lse of
// the forward; dq, dk and dv of the backward (dsinks is written last, only
// once they are complete).
#ifndef RINGSPLASH_ATTENTION_H_
#define RINGSPLASH_ATTENTION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "ringsplash/mask.h"
#include "ringsplash/tensor.h"

namespace ringsplash {

// Tile sizes of the flash loop. Tuning knobs only: results do not change
// beyond float rounding. Each must be a positive multiple of 16. 128 x 128
// is the fastest on every case of docs/PERFORMANCE.md
// (docs/perf/DESIGN_MEASUREMENTS.md: tile sizes; against 64 x 128 it halves
// the K/V traffic per FLOP); smaller tiles waste less at the edges of very
// narrow masks. A size above the rows it tiles (rounded up to 16) acts as
// exactly that: one block of those rows. Per-thread scratch grows with the
// block actually used, so a block of many thousand rows costs memory (tens
// of MiB per thread at D = 128), never more than the rows need.
struct BlockSizes {
  int64_t q = 128;
  int64_t kv = 128;
};

// Limits the API checks (an Error beyond them): the largest head dim D and Dv
// the kernels take, and the most threads a call may ask for (each a real
// thread with its own scratch: far more than any machine's cores is a
// mistake, e.g. a byte count, not a request).
inline constexpr int64_t kMaxHeadDim = 256;
inline constexpr int kMaxThreads = 1024;

// Micro-kernel implementations. kAuto picks the fastest this CPU supports; the
// environment variable RINGSPLASH_KERNEL=portable|avx2|avx512|avx512_bf16|amx
// overrides kAuto (tests use the option directly). Forcing an unsupported path
// is an Error. kAvx2 (AVX2 + FMA, 8-lane f32) is for CPUs without AVX-512.
// kAvx512Bf16 runs bf16 inputs' products on vdpbf16ps: the forward's K Q^T
// and P V (P rounded to bf16, as FlashAttention does on GPUs: |out error| <=
// 2^-8 max|v|), all five of the backward's products (P and dS rounded to bf16
// for dV, dK and dQ; with bf16 dout); f32 inputs run as on kAvx512, which
// also keeps bf16 inputs' P and dS in f32 where that rounding matters.
// kAmx is kAvx512Bf16 with those products on AMX tiles (Intel Sapphire
// Rapids and later). Linux's tile permission is requested when bf16 work
// first reaches them (a process-wide, lasting change: see
// docs/perf/PATHS.md); if refused, those products run on vdpbf16ps.
enum class KernelPath { kAuto, kPortable, kAvx2, kAvx512, kAvx512Bf16, kAmx };
const char* KernelPathName(KernelPath path);
KernelPath ParseKernelPath(const std::string& text);
// Paths usable on this machine (never includes kAuto; always includes kPortable).
std::vector<KernelPath> SupportedKernelPaths();
// What kAuto resolves to here (after the environment override).
KernelPath ResolveKernelPath(KernelPath requested);

struct AttentionOptions {
  Mask mask;                     // default Full
  std::optional<float> scale;    // default 1/sqrt(D)
  std::optional<float> softcap;  // cap > 0: s = cap * tanh(s / cap)
  BlockSizes block_sizes;
  // 0: all hardware threads; at most 1024. Worker threads are kept between
  // calls (a pool per thread count and concurrent caller), each with a few MiB
  // of scratch in fixed budgets chosen for a 2 MiB L2 (packed q blocks, ~1.25
  // MiB of kv tile copies and 2 MiB of backward q tiles it used last), so
  // repeated calls allocate nothing per tile; ReleaseCachedThreads() ends them.
  int num_threads = 0;
  KernelPath kernel_path = KernelPath::kAuto;
};

// Inputs of one attention call. Positions are the GLOBAL token positions of
// the rows held (masks are evaluated on them); empty means 0..S-1.
struct AttentionInputs {
  TensorView q, k, v;
  TensorView sinks;        // optional
  TensorView q_segments;   // optional
  TensorView kv_segments;  // optional
  std::vector<int64_t> q_positions;
  std::vector<int64_t> kv_positions;
};

// Counters of the block-sparse loop, summed over batch, heads and threads.
// A block is one (bq x bkv) tile for one (batch, query head).
struct KernelStats {
  // Tiles as the kernels ran them: a forward over short query blocks with
  // GQA/MQA stacks each kv group's query heads into the rows of one head, so
  // its tiles (and their counts) are those of the stacked rows.
  int64_t computed_blocks = 0;  // tiles whose FLOPs were spent
  int64_t full_blocks = 0;      // ... of which needed no element mask
  int64_t partial_blocks = 0;   // ... of which needed an element mask
  int64_t skipped_blocks = 0;   // tiles ruled out by mask or segments
  double flops = 0;             // FLOPs spent on computed tiles (matmuls only)
  void Add(const KernelStats& o) {
    computed_blocks += o.computed_blocks;
    full_blocks += o.full_blocks;
    partial_blocks += o.partial_blocks;
    skipped_blocks += o.skipped_blocks;
    flops += o.flops;
  }
};

// Forward: writes out and lse (see the top of this file for what they hold,
// the memory rule and errors). Throws Error on any invalid argument. The
// kernels accumulate in f32 (bf16 inputs on the avx512_bf16 and amx paths
// round P, and in the backward dS, to bf16 for their products: KernelPath);
// a contiguous f32 out, or a bf16 out whose rows have unit stride and whose
// dims nest (e.g. [B, S, H, D] or [B, H, S, D] views), with or without
// sinks, is written directly, other outputs through an f32 copy of out.
void AttentionForward(const AttentionInputs& in, const AttentionOptions& opt, TensorView out,
                      TensorView lse, KernelStats* stats = nullptr);

// Backward, given the forward's out and lse and the upstream gradient dout
// (shape of out). Writes dq, dk, dv (shapes of q, k, v; f32 or the input
// dtype) and, when sinks are given, dsinks [H] f32; none of them may share
// memory with an input (out, lse and dout included) or with each other.
void AttentionBackward(const AttentionInputs& in, const AttentionOptions& opt, TensorView out,
                       TensorView lse, TensorView dout, TensorView dq, TensorView dk, TensorView dv,
                       TensorView dsinks, KernelStats* stats = nullptr);

// Ends the worker threads AttentionForward/Backward keep between calls, and
// with them their scratch (a few MiB each); the next call starts new ones.
// Also frees the large buffers (per-call copies of K and V, the backward's
// packed queries: up to 1 GiB in all) that calls keep for the next call of
// the same shapes.
// Workers of calls running meanwhile are not touched (their pools are kept
// when those calls end). The calling thread is worker 0 of its own calls and
// keeps its scratch until it exits. Ring calls start their workers per call.
void ReleaseCachedThreads();

// Validates inputs and options as both entry points do (exposed for the ring
// and the CLI so every layer reports the same messages). Returns nothing; throws.
void ValidateAttentionInputs(const AttentionInputs& in, const AttentionOptions& opt);

}  // namespace ringsplash

#endif  // RINGSPLASH_ATTENTION_H_
