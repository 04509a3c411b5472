// The x86-64 level the CPU kernels run at, and the dispatch to it.
//
// Each hot row kernel is written once, as an always-inlined body (name_body),
// and its entry point hands isa_dispatch a lambda that calls it:
//   isa_dispatch([&]() FASTRL_ISA_BODY { row_stats_body<In, Acc>(...); });
// The lambda is inlined into three trampolines compiled for x86-64-v4
// (AVX-512), x86-64-v3 (AVX2 + FMA) and the baseline (SSE2), and GCC
// vectorises the body's simd loops after that inlining, so each trampoline
// holds the kernel at its own vector width. (Written directly inside the
// lambda, the same body ran at half the speed: GCC's early passes then unroll
// its loops for the baseline target before the inlining.) isa_dispatch calls
// the trampoline of the level active now: the best the CPU has, unless
// set_active_isa chose a lower one (FASTRL_CPU_ISA, fastrl/_backend.py), which
// lets one machine run and test every level's code. GCC's target_clones did
// the same, but picks its clone in a resolver that nothing can override: the
// AVX2 code could not be tested on an AVX-512 machine, and once shipped
// unvectorised.
//
// Everything a body calls must be inlined into it (FASTRL_INLINE) or be plain
// code that needs no vector width: only what lands in a trampoline is compiled
// for its level. tests/test_native_isa.py checks that each trampoline holds
// vector code of its width.
#pragma once

#include <atomic>
#include <stdexcept>
#include <string>

#include "common.h"

namespace fastrl {

enum class Isa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

inline const char* isa_name(Isa isa) {
#if defined(__x86_64__) && !defined(__clang__)
  switch (isa) {
    case Isa::kAvx512: return "x86-64-v4 (AVX-512)";
    case Isa::kAvx2: return "x86-64-v3 (AVX2)";
    case Isa::kBaseline: return "x86-64 (SSE2)";
  }
#endif
  (void)isa;
  return "generic";
}

// The best level this CPU runs (x86-64-v4 needs AVX-512 F/BW/CD/DQ/VL, v3 AVX2,
// FMA, BMI1/2, F16C, LZCNT and MOVBE: GCC tests each, as its target_clones did).
inline Isa best_isa() {
#if defined(__x86_64__) && !defined(__clang__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("x86-64-v4")) return Isa::kAvx512;
  if (__builtin_cpu_supports("x86-64-v3")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

inline std::atomic<int>& active_isa_slot() {
  static std::atomic<int> slot{static_cast<int>(best_isa())};
  return slot;
}

inline Isa active_isa() { return static_cast<Isa>(active_isa_slot().load(std::memory_order_relaxed)); }

// Runs the kernels at ISA from the next call on. A level above the CPU's would
// fault on its first instruction, so it is refused.
inline void set_active_isa(Isa isa) {
  if (static_cast<int>(isa) < 0 || isa > best_isa()) {
    throw std::invalid_argument(std::string("this CPU cannot run ") + isa_name(isa) + "; its best is " +
                                isa_name(best_isa()));
  }
  active_isa_slot().store(static_cast<int>(isa), std::memory_order_relaxed);
}

// The lambda attribute that makes a kernel body inline into each trampoline.
#define FASTRL_ISA_BODY __attribute__((always_inline))

#if defined(__x86_64__) && !defined(__clang__)
template <typename Body>
__attribute__((target("arch=x86-64-v4"), noinline)) void run_avx512(const Body& body) { body(); }
template <typename Body>
__attribute__((target("arch=x86-64-v3"), noinline)) void run_avx2(const Body& body) { body(); }
template <typename Body>
__attribute__((noinline)) void run_baseline(const Body& body) { body(); }

template <typename Body>
FASTRL_INLINE void isa_dispatch(const Body& body) {
  switch (active_isa()) {
    case Isa::kAvx512: return run_avx512(body);
    case Isa::kAvx2: return run_avx2(body);
    case Isa::kBaseline: return run_baseline(body);
  }
}
#else
template <typename Body>
FASTRL_INLINE void isa_dispatch(const Body& body) { body(); }
#endif

}  // namespace fastrl
