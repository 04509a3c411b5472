// Log-probs and entropy of the chosen tokens, CUDA kernels. The math is that of
// logprobs.cpp (see its header comment):
//   m = max_j x_j,  d_j = (x_j - m) / T,  s = sum_j e^{d_j},  w = sum_j e^{d_j} d_j
//   logprob = (x_label - m) / T - log s,   entropy = log s - w / s
//   dL/dx_j = (1/T) (g ([j == label] - p_j) - h p_j (log p_j + entropy))
//
// One block per row, so a row's result never depends on the batch. Each thread
// walks the row in 16-byte vectors (8 bf16 / fp16, 4 fp32, 2 fp64 values) when
// the rows are 16-byte aligned, keeping its own (m, s, w): it rescales once per
// vector when the vector raises its max, then adds the vector's exponentials.
// The per-thread triples are merged in a fixed tree (warp shuffles, then one
// warp over the warps' results), so results are bitwise reproducible. The block
// size depends on V only. Backward: one read of the row and one write of the
// gradient, which may alias the logits (each vector is loaded before stored).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "dtypes.h"
#include "logprobs.h"

namespace fastrl {
namespace {

// Element conversions to the accumulation type (float; double for fp64 input).
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T>
__device__ __forceinline__ T from_acc(float v);
template <>
__device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <typename T>
__device__ __forceinline__ T from_acc(double v) { return v; }

// exp on the MUFU unit for fp32 (ex2.approx: about 2 ulp near 0, where the
// terms that matter live), full precision for fp64. exp(-inf) = 0, NaN stays NaN.
__device__ __forceinline__ float exp_acc(float x) { return __expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }

template <typename Acc>
__device__ __forceinline__ Acc neg_inf() { return -INFINITY; }

// A thread's (or a merged group's) running statistic: the max m of the values
// seen, and s = sum e^d = n + t, w = sum e^d d relative to it, in double (see
// accumulate): n counts the terms at the max (each exactly 1), t sums the rest.
// t is 0 while no term was summed, or NaN once a NaN was seen.
template <typename Acc>
struct Stats {
  Acc m;
  double n, t, w;
};

// log s = log n + log1p(t / n): log(n + t) would round away the tail t of a
// peaked row, about all of whose entropy it carries (softmax_stats.h). A row
// with no term at its max (all -inf, or NaN) gives log t.
template <typename Acc>
__device__ __forceinline__ double log_sum(const Stats<Acc>& st) {
  return st.n > 0 ? log(st.n) + log1p(st.t / st.n) : log(st.t);
}

// st's sums moved to the reference point m >= st.m: every term scales by
// a = e^c, c = (st.m - m) / T, so the terms at the old max join the tail
// (t' = a (n + t), n' = 0) and w' = (w + c s) a. c may be -inf (the max rose
// beyond the float range): a = 0 then leaves nothing of the old terms, tested
// so that no 0 * -inf appears. A statistic with no max has no terms to move
// (t 0 or NaN).
template <typename Acc, bool WITH_W>
__device__ __forceinline__ Stats<Acc> shift_to(const Stats<Acc>& st, Acc m, Acc inv_t) {
  if (st.m == neg_inf<Acc>() || st.m == m) return {m, st.n, st.t, st.w};
  const double c = static_cast<double>((st.m - m) * inv_t), a = exp(c), s = st.n + st.t;
  return {m, 0.0, a * s, WITH_W ? (a == 0 ? 0.0 : a * (st.w + c * s)) : st.w};
}

// Merge two partial statistics of the same row onto the larger max.
template <typename Acc, bool WITH_W>
__device__ __forceinline__ Stats<Acc> merge(Stats<Acc> a, Stats<Acc> b, Acc inv_t) {
  const Acc m = a.m > b.m ? a.m : b.m;
  a = shift_to<Acc, WITH_W>(a, m, inv_t);
  b = shift_to<Acc, WITH_W>(b, m, inv_t);
  return {m, a.n + b.n, a.t + b.t, a.w + b.w};
}

// Adds n values of the row (already widened) to a thread's running stats.
// Accuracy: the vector's terms are summed in Acc, then added to the double
// sums. The terms at the max are exactly 1 and are counted apart, so a peaked
// row's tail of tiny terms is never added to a float 1 that would drop it
// (softmax_stats.h and kernels/reduce.py explain why the entropy needs this).
// Guards test the term: d may be -inf for a finite logit whose (x - m) / T
// overflowed, where e = 0 must add 0 to w. A NaN makes s NaN for good.
template <typename Acc, bool WITH_W, int N>
__device__ __forceinline__ void accumulate(Stats<Acc>& st, const Acc (&xs)[N], Acc inv_t) {
  Acc vmax = neg_inf<Acc>();
  bool nan = false;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    vmax = xs[k] > vmax ? xs[k] : vmax;
    nan |= xs[k] != xs[k];
  }
  if (nan) st.t = NAN;
  if (vmax > st.m) st = shift_to<Acc, WITH_W>(st, vmax, inv_t);
  if (st.m == neg_inf<Acc>()) return;  // every value so far is -inf (or NaN, flagged)
  Acc tail = 0, w_vec = 0;
  int at_max = 0;
#pragma unroll
  for (int k = 0; k < N; ++k) {
    const Acc d = (xs[k] - st.m) * inv_t;
    const Acc e = exp_acc(d);
    at_max += d == Acc(0);
    tail += d == Acc(0) ? Acc(0) : e;
    if (WITH_W) w_vec += e == Acc(0) ? Acc(0) : e * d;
  }
  st.n += at_max;
  st.t += static_cast<double>(tail);
  if (WITH_W) st.w += static_cast<double>(w_vec);
}

// Merges each lane's statistic into lane 0's over the warp.
template <typename Acc, bool WITH_W>
__device__ __forceinline__ Stats<Acc> warp_reduce(Stats<Acc> st, Acc inv_t) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const Stats<Acc> o{__shfl_down_sync(0xffffffffu, st.m, off), __shfl_down_sync(0xffffffffu, st.n, off),
                       __shfl_down_sync(0xffffffffu, st.t, off), __shfl_down_sync(0xffffffffu, st.w, off)};
    st = merge<Acc, WITH_W>(st, o, inv_t);
  }
  return st;
}

template <typename Acc, bool WITH_W>
__device__ Stats<Acc> block_reduce(Stats<Acc> st, Acc inv_t) {
  __shared__ Stats<Acc> warp_stats[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warps = (blockDim.x + 31) >> 5;
  st = warp_reduce<Acc, WITH_W>(st, inv_t);
  if (lane == 0) warp_stats[warp] = st;
  __syncthreads();
  if (warp == 0) {
    st = lane < n_warps ? warp_stats[lane] : Stats<Acc>{neg_inf<Acc>(), 0.0, 0.0, 0.0};
    st = warp_reduce<Acc, WITH_W>(st, inv_t);
  }
  return st;  // valid in thread 0
}

template <typename In, int VEC>
struct alignas(sizeof(In) * VEC) Pack {
  In v[VEC];
};

template <typename Acc>
__device__ __forceinline__ Acc row_inv_temperature(const LogprobsArgs& a, int64_t row) {
  const Acc t = a.temps ? static_cast<const Acc*>(a.temps)[row] : static_cast<Acc>(a.temp_scalar);
  // A temperature that is not positive and finite poisons its row with NaN.
  return (t > Acc(0) && t < Acc(INFINITY)) ? Acc(1) / t : Acc(NAN);
}

__device__ __forceinline__ int64_t row_label(const LogprobsArgs& a, int64_t row) {
  return a.label_dtype == kInt32 ? static_cast<const int32_t*>(a.labels)[row]
                                 : static_cast<const int64_t*>(a.labels)[row];
}

template <typename In, typename Acc, int VEC, bool WITH_W>
__global__ void forward_kernel(LogprobsArgs a, Acc* logprob, Acc* entropy, Acc* stats) {
  const int64_t row = blockIdx.x;
  const In* x = static_cast<const In*>(a.logits) + a.rows.offset(row);
  const Acc inv_t = row_inv_temperature<Acc>(a, row);
  Stats<Acc> st{neg_inf<Acc>(), 0.0, 0.0, 0.0};
  const int64_t n_packs = a.vocab / VEC;
  for (int64_t i = threadIdx.x; i < n_packs; i += blockDim.x) {
    const Pack<In, VEC> p = reinterpret_cast<const Pack<In, VEC>*>(x)[i];
    Acc xs[VEC];
#pragma unroll
    for (int k = 0; k < VEC; ++k) xs[k] = to_acc(p.v[k]);
    accumulate<Acc, WITH_W>(st, xs, inv_t);
  }
  for (int64_t i = n_packs * VEC + threadIdx.x; i < a.vocab; i += blockDim.x) {
    const Acc xs[1] = {to_acc(x[i])};
    accumulate<Acc, WITH_W>(st, xs, inv_t);
  }
  st = block_reduce<Acc, WITH_W>(st, inv_t);
  if (threadIdx.x != 0) return;
  const double log_s_exact = log_sum(st);
  const Acc log_s = static_cast<Acc>(log_s_exact);
  if (stats) {
    stats[2 * row] = st.m;
    stats[2 * row + 1] = log_s;
  }
  if (entropy) entropy[row] = static_cast<Acc>(log_s_exact - st.w / (st.n + st.t));
  if (logprob) {
    const int64_t label = row_label(a, row);
    if (label == a.ignore_index) {
      logprob[row] = Acc(0);
    } else if (label < 0 || label >= a.vocab) {
      logprob[row] = Acc(NAN);  // never read outside the row
    } else {
      logprob[row] = (to_acc(x[label]) - st.m) * inv_t - log_s;
    }
  }
}

template <typename In, typename Acc, bool WITH_H>
__device__ __forceinline__ Acc grad_element(In xv, int64_t j, Acc m, Acc log_s, Acc inv_t, Acc g,
                                            int64_t label, Acc h, Acc entropy) {
  const Acc xj = to_acc(xv);
  const Acc logp = (xj - m) * inv_t - log_s;
  const Acc p = exp_acc(logp);
  Acc grad = -g * p;
  if (WITH_H) grad -= h * p * ((p == Acc(0) ? Acc(0) : logp) + entropy);  // logp may be -inf where p = 0
  if (j == label) grad += g;
  return grad * inv_t;
}

template <typename In, typename Acc, int VEC, bool WITH_H>
__global__ void backward_kernel(LogprobsArgs a, const Acc* stats, const Acc* entropy_in,
                                const Acc* grad_logprob, const Acc* grad_entropy, In* grad_out,
                                RowLayout grad_rows) {
  const int64_t row = blockIdx.x;
  const In* x = static_cast<const In*>(a.logits) + a.rows.offset(row);
  In* gx = grad_out + grad_rows.offset(row);
  const Acc inv_t = row_inv_temperature<Acc>(a, row);
  const Acc m = stats[2 * row], log_s = stats[2 * row + 1];
  Acc g = 0;
  int64_t label = -1;
  if (grad_logprob) {
    label = row_label(a, row);
    if (label == a.ignore_index) {
      label = -1;
    } else if (label < 0 || label >= a.vocab) {
      label = -1;
      g = Acc(NAN);  // the forward marked this row NaN; so does its gradient
    } else {
      g = grad_logprob[row];
    }
  }
  const Acc h = WITH_H ? grad_entropy[row] : Acc(0);
  const Acc entropy = WITH_H ? entropy_in[row] : Acc(0);
  const int64_t n_packs = a.vocab / VEC;
  for (int64_t i = threadIdx.x; i < n_packs; i += blockDim.x) {
    const Pack<In, VEC> p = reinterpret_cast<const Pack<In, VEC>*>(x)[i];
    Pack<In, VEC> out;
#pragma unroll
    for (int k = 0; k < VEC; ++k)
      out.v[k] = from_acc<In>(
          grad_element<In, Acc, WITH_H>(p.v[k], i * VEC + k, m, log_s, inv_t, g, label, h, entropy));
    reinterpret_cast<Pack<In, VEC>*>(gx)[i] = out;
  }
  for (int64_t j = n_packs * VEC + threadIdx.x; j < a.vocab; j += blockDim.x)
    gx[j] = from_acc<In>(grad_element<In, Acc, WITH_H>(x[j], j, m, log_s, inv_t, g, label, h, entropy));
}

// Threads per row from V alone (never from the batch), enough to keep about
// eight 16-byte vectors in flight per thread on long rows.
int threads_for(int64_t vocab, int vec) {
  int64_t packs = (vocab + vec - 1) / vec;
  int threads = 32;
  while (threads < 1024 && threads * 8 < packs) threads *= 2;
  return threads;
}

// Every row starts 16-byte aligned when the base pointer and both leading strides are.
bool aligned16(const void* p, const RowLayout& rows, int elem_size) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0 && (rows.outer_stride * elem_size) % 16 == 0 &&
         (rows.inner_stride * elem_size) % 16 == 0;
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

template <typename In, typename Acc>
void forward_typed(const LogprobsArgs& a, void* out_logprob, void* out_entropy, void* out_stats,
                   cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(In);
  const bool vec = aligned16(a.logits, a.rows, sizeof(In));
  const int threads = threads_for(a.vocab, vec ? kVec : 1);
  auto* lp = static_cast<Acc*>(out_logprob);
  auto* ent = static_cast<Acc*>(out_entropy);
  auto* st = static_cast<Acc*>(out_stats);
  const dim3 grid(static_cast<unsigned>(a.n_rows));
  if (ent && vec) forward_kernel<In, Acc, kVec, true><<<grid, threads, 0, stream>>>(a, lp, ent, st);
  else if (ent) forward_kernel<In, Acc, 1, true><<<grid, threads, 0, stream>>>(a, lp, ent, st);
  else if (vec) forward_kernel<In, Acc, kVec, false><<<grid, threads, 0, stream>>>(a, lp, ent, st);
  else forward_kernel<In, Acc, 1, false><<<grid, threads, 0, stream>>>(a, lp, ent, st);
  check_launch("logprobs_forward_cuda");
}

template <typename In, typename Acc>
void backward_typed(const LogprobsArgs& a, const void* stats, const void* entropy,
                    const void* grad_logprob, const void* grad_entropy, void* grad_out,
                    RowLayout grad_rows, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(In);
  const bool vec = aligned16(a.logits, a.rows, sizeof(In)) &&
                   aligned16(grad_out, grad_rows, sizeof(In));
  const int threads = threads_for(a.vocab, vec ? kVec : 1);
  const auto* st = static_cast<const Acc*>(stats);
  const auto* ent = static_cast<const Acc*>(entropy);
  const auto* glp = static_cast<const Acc*>(grad_logprob);
  const auto* gent = static_cast<const Acc*>(grad_entropy);
  auto* out = static_cast<In*>(grad_out);
  const dim3 grid(static_cast<unsigned>(a.n_rows));
  if (gent && vec)
    backward_kernel<In, Acc, kVec, true><<<grid, threads, 0, stream>>>(a, st, ent, glp, gent, out, grad_rows);
  else if (gent)
    backward_kernel<In, Acc, 1, true><<<grid, threads, 0, stream>>>(a, st, ent, glp, gent, out, grad_rows);
  else if (vec)
    backward_kernel<In, Acc, kVec, false><<<grid, threads, 0, stream>>>(a, st, ent, glp, gent, out, grad_rows);
  else
    backward_kernel<In, Acc, 1, false><<<grid, threads, 0, stream>>>(a, st, ent, glp, gent, out, grad_rows);
  check_launch("logprobs_backward_cuda");
}

}  // namespace

void logprobs_forward_cuda(const LogprobsArgs& a, void* out_logprob, void* out_entropy,
                           void* out_stats, std::uintptr_t stream_handle) {
  if (a.n_rows == 0) return;
  if (a.n_rows > 0x7fffffff) throw std::invalid_argument("logprobs_forward_cuda: more than 2^31-1 rows");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  switch (a.dtype) {
    case kFloat32: return forward_typed<float, float>(a, out_logprob, out_entropy, out_stats, stream);
    case kFloat16: return forward_typed<__half, float>(a, out_logprob, out_entropy, out_stats, stream);
    case kBFloat16: return forward_typed<__nv_bfloat16, float>(a, out_logprob, out_entropy, out_stats, stream);
    case kFloat64: return forward_typed<double, double>(a, out_logprob, out_entropy, out_stats, stream);
    default: throw std::invalid_argument("logprobs_forward_cuda: unsupported dtype code " + std::to_string(a.dtype));
  }
}

void logprobs_backward_cuda(const LogprobsArgs& a, const void* stats, const void* entropy,
                            const void* grad_logprob, const void* grad_entropy, void* grad_out,
                            RowLayout grad_rows, std::uintptr_t stream_handle) {
  if (a.n_rows == 0) return;
  if (a.n_rows > 0x7fffffff) throw std::invalid_argument("logprobs_backward_cuda: more than 2^31-1 rows");
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
#define FASTRL_BWD(IN, ACC) \
  backward_typed<IN, ACC>(a, stats, entropy, grad_logprob, grad_entropy, grad_out, grad_rows, stream)
  switch (a.dtype) {
    case kFloat32: return FASTRL_BWD(float, float);
    case kFloat16: return FASTRL_BWD(__half, float);
    case kBFloat16: return FASTRL_BWD(__nv_bfloat16, float);
    case kFloat64: return FASTRL_BWD(double, double);
    default: throw std::invalid_argument("logprobs_backward_cuda: unsupported dtype code " + std::to_string(a.dtype));
  }
#undef FASTRL_BWD
}

}  // namespace fastrl
