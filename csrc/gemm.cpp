// The float32-output bf16 GEMM (gemm.h).
//
// Layout, in the usual blocked-GEMM way: B (the output columns) is packed once
// into panels of kNR columns, pair-major: panel j holds, for each pair p of k,
// the kNR 32-bit words (B(n, 2p) low half, B(n, 2p + 1) high half), so one pair
// step of the micro-kernel loads two zmm of it. Threads split the output rows
// into blocks of kMC; a thread packs its block's A, kKC pairs of k at a time, as
// micro-panels of kMR rows, pair-major, so the micro-kernel reads one 32-bit
// word per row per pair and broadcasts it. The micro-kernel keeps a kMR x kNR
// float32 tile in 24 zmm accumulators: per pair, 2 loads of B, kMR broadcasts
// of A and 2 kMR vdpbf16ps (each two bf16 products added to 16 float32 lanes).
// A kKC slice of a B panel (16 KiB) stays in L1 while the thread walks its
// block's micro-panels (48 KiB, L2) against it.
//
// Where C's columns are not contiguous (the forward's logits come out as
// C[vocab entry, token] written to logits[token, vocab entry]), a thread sums
// its block into a scratch tile and writes it out once at the end.
#include "gemm.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <stdexcept>

#include "common.h"
#include "isa.h"

#if defined(__x86_64__) && !defined(__clang__)
#define FASTRL_HAVE_BF16_GEMM 1
#include <immintrin.h>
#endif

namespace fastrl {
namespace {

constexpr int kMR = 12;        // rows of A in a micro-tile: one broadcast each
constexpr int kNR = 32;        // columns of B in a micro-tile: two zmm of float32
constexpr int64_t kMC = 96;    // rows of C a thread's block holds (a multiple of kMR)
constexpr int64_t kKC = 128;   // pairs of k per block: a B panel's slice is 16 KiB

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
std::unique_ptr<T[], FreeDeleter> aligned_buffer(int64_t count) {
  const size_t bytes = (static_cast<size_t>(count) * sizeof(T) + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, bytes == 0 ? 64 : bytes);
  if (p == nullptr) throw std::bad_alloc();
  return std::unique_ptr<T[], FreeDeleter>(static_cast<T*>(p));
}

// The bf16 bits of x rounded to nearest even; a NaN stays a NaN (quietened).
FASTRL_INLINE uint32_t bf16_bits(float x) {
  const uint32_t u = float_to_bits(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
FASTRL_INLINE uint32_t bits_of(const uint16_t* p, int64_t i) { return p[i]; }
FASTRL_INLINE uint32_t bits_of(const float* p, int64_t i) { return bf16_bits(p[i]); }

// out[(p - p0) * width + r] = (X(r, 2p) | X(r, 2p + 1) << 16) for r < rows and
// pairs p in [p0, p1), X(r, k) = x[r * row_stride + k * k_stride] as bf16 bits;
// zero for r >= rows and for k >= k_len (an odd k's last pair).
template <typename T>
void pack_pairs(const T* x, int64_t row_stride, int64_t k_stride, int64_t rows, int64_t k_len, int64_t p0,
                int64_t p1, int width, uint32_t* out) {
  if (k_stride == 1 && row_stride != 1) {
    // k contiguous (a row of the weight, of the hidden states): walk each row.
    for (int64_t r = 0; r < rows; ++r) {
      const T* xr = x + r * row_stride;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t k0 = 2 * p;
        const uint32_t high = k0 + 1 < k_len ? bits_of(xr, k0 + 1) : 0u;
        out[(p - p0) * width + r] = bits_of(xr, k0) | (high << 16);
      }
    }
  } else {
    // rows contiguous (a block of the gradient, read along its columns).
    for (int64_t p = p0; p < p1; ++p) {
      const T* x0 = x + 2 * p * k_stride;
      uint32_t* dst = out + (p - p0) * width;
      if (2 * p + 1 < k_len) {
        const T* x1 = x0 + k_stride;
#pragma omp simd
        for (int64_t r = 0; r < rows; ++r) dst[r] = bits_of(x0, r * row_stride) | (bits_of(x1, r * row_stride) << 16);
      } else {
        for (int64_t r = 0; r < rows; ++r) dst[r] = bits_of(x0, r * row_stride);
      }
    }
  }
  if (rows < width) {
    for (int64_t p = p0; p < p1; ++p) std::fill(out + (p - p0) * width + rows, out + (p - p0 + 1) * width, 0u);
  }
}

void pack_operand(const GemmOperand& x, int64_t r0, int64_t rows, int64_t k_len, int64_t p0, int64_t p1, int width,
                  uint32_t* out) {
  if (x.dtype == kBFloat16) {
    pack_pairs(static_cast<const uint16_t*>(x.data) + r0 * x.row_stride, x.row_stride, x.k_stride, rows, k_len, p0, p1,
               width, out);
  } else {
    pack_pairs(static_cast<const float*>(x.data) + r0 * x.row_stride, x.row_stride, x.k_stride, rows, k_len, p0, p1,
               width, out);
  }
}

#ifdef FASTRL_HAVE_BF16_GEMM
#define FASTRL_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

// c[i * ldc + j] (+)= sum over `pairs` pairs of a_panel[p * kMR + i] . b_panel[p * kNR + j]
// for i < rows, j < cols.
FASTRL_BF16_TARGET void micro_kernel(const uint32_t* a_panel, const uint32_t* b_panel, int64_t pairs, float* c,
                                     int64_t ldc, int rows, int cols, bool add) {
  __m512 acc[kMR][2];
  for (int i = 0; i < kMR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b_panel + p * kNR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b_panel + p * kNR + 16);
    const uint32_t* a = a_panel + p * kMR;
    for (int i = 0; i < kMR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  const __mmask16 low = cols >= 16 ? 0xffff : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 high = cols >= 32 ? 0xffff : cols > 16 ? static_cast<__mmask16>((1u << (cols - 16)) - 1) : 0;
  for (int i = 0; i < kMR; ++i) {
    if (i >= rows) break;
    float* ci = c + i * ldc;
    __m512 v0 = acc[i][0], v1 = acc[i][1];
    if (add) {
      v0 = _mm512_add_ps(_mm512_maskz_loadu_ps(low, ci), v0);
      v1 = _mm512_add_ps(_mm512_maskz_loadu_ps(high, ci + 16), v1);
    }
    _mm512_mask_storeu_ps(ci, low, v0);
    _mm512_mask_storeu_ps(ci + 16, high, v1);
  }
}
#endif

}  // namespace

bool gemm_bf16_supported() {
#ifdef FASTRL_HAVE_BF16_GEMM
  // Off below the AVX-512 level (FASTRL_CPU_ISA), so a forced level runs what
  // such a CPU would.
  if (active_isa() != Isa::kAvx512) return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
#else
  return false;
#endif
}

void gemm_bf16(const GemmOperand& a, const GemmOperand& b, float* c, int64_t c_row, int64_t c_col, int64_t m,
               int64_t n, int64_t k, bool accumulate) {
  if (!gemm_bf16_supported()) throw std::runtime_error("fastrl: gemm_bf16 needs a CPU with AVX512-BF16");
#ifdef FASTRL_HAVE_BF16_GEMM
  if (m <= 0 || n <= 0) return;
  if (k <= 0) {  // an empty sum
    if (!accumulate) {
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) c[i * c_row + j * c_col] = 0.0f;
    }
    return;
  }
  const int64_t pairs = (k + 1) / 2;
  const int64_t n_panels = (n + kNR - 1) / kNR;
  auto b_packed = aligned_buffer<uint32_t>(n_panels * pairs * kNR);
#pragma omp parallel for schedule(static)
  for (int64_t j = 0; j < n_panels; ++j) {
    pack_operand(b, j * kNR, std::min<int64_t>(kNR, n - j * kNR), k, 0, pairs, kNR, b_packed.get() + j * pairs * kNR);
  }
  // Columns of C one apart: tiles go straight to C. Otherwise through a scratch block.
  const bool direct = c_col == 1;
  const int64_t scratch_ld = n_panels * kNR;
  const int64_t m_blocks = (m + kMC - 1) / kMC;
#pragma omp parallel
  {
    auto a_packed = aligned_buffer<uint32_t>(kMC * kKC);
    auto scratch = aligned_buffer<float>(direct ? 1 : kMC * scratch_ld);
#pragma omp for schedule(dynamic, 1)
    for (int64_t block = 0; block < m_blocks; ++block) {
      const int64_t m0 = block * kMC;
      const int64_t block_rows = std::min(kMC, m - m0);
      const int64_t micro_panels = (block_rows + kMR - 1) / kMR;
      if (!direct && accumulate) {  // C's old values first, so the sums run in the direct path's order
        for (int64_t j = 0; j < n; ++j) {
          const float* cj = c + m0 * c_row + j * c_col;
          for (int64_t i = 0; i < block_rows; ++i) scratch[i * scratch_ld + j] = cj[i * c_row];
        }
      }
      for (int64_t p0 = 0; p0 < pairs; p0 += kKC) {
        const int64_t p1 = std::min(p0 + kKC, pairs);
        for (int64_t u = 0; u < micro_panels; ++u) {
          pack_operand(a, m0 + u * kMR, std::min<int64_t>(kMR, block_rows - u * kMR), k, p0, p1, kMR,
                       a_packed.get() + u * kKC * kMR);
        }
        for (int64_t j = 0; j < n_panels; ++j) {
          const int cols = static_cast<int>(std::min<int64_t>(kNR, n - j * kNR));
          const uint32_t* b_slice = b_packed.get() + (j * pairs + p0) * kNR;
          for (int64_t u = 0; u < micro_panels; ++u) {
            const int rows = static_cast<int>(std::min<int64_t>(kMR, block_rows - u * kMR));
            if (direct) {
              micro_kernel(a_packed.get() + u * kKC * kMR, b_slice, p1 - p0, c + (m0 + u * kMR) * c_row + j * kNR,
                           c_row, rows, cols, accumulate || p0 > 0);
            } else {
              micro_kernel(a_packed.get() + u * kKC * kMR, b_slice, p1 - p0,
                           scratch.get() + u * kMR * scratch_ld + j * kNR, scratch_ld, rows, cols,
                           accumulate || p0 > 0);
            }
          }
        }
      }
      if (!direct) {  // C's rows one apart here (the logits' vocabulary entries): write along them
        for (int64_t j = 0; j < n; ++j) {
          float* cj = c + m0 * c_row + j * c_col;
          const float* sj = scratch.get() + j;
          for (int64_t i = 0; i < block_rows; ++i) cj[i * c_row] = sj[i * scratch_ld];
        }
      }
    }
  }
#endif
}

}  // namespace fastrl
