"""The C++ every generated program starts with: vector math declarations, narrow float
storage (bf16, fp16) and the helpers the renderer (cpp.py) calls by name."""

PRELUDE = """#include <cmath>
#include <limits>
#include <cstdint>
#include <algorithm>
#ifdef EGC_VECTOR_MATH  // glibc's vector math library: SIMD variants of these, for `omp simd` loops
extern "C" {
__attribute__((simd("notinbranch"))) float expf(float);
__attribute__((simd("notinbranch"))) float logf(float);
__attribute__((simd("notinbranch"))) float tanhf(float);
__attribute__((simd("notinbranch"))) float erff(float);
__attribute__((simd("notinbranch"))) float cosf(float);
__attribute__((simd("notinbranch"))) float sinf(float);
// cos and sin under names g++ does not know: of one argument (a rotary embedding's angle) it
// merges cosf and sinf into one scalar sincosf, which has no SIMD variant (9.3 ns an element
// against 0.5 for either alone); the assembler names keep libmvec's variants (_ZGVdN8v_cosf)
__attribute__((const, simd("notinbranch"))) float egc_cosf(float) __asm__("cosf");
__attribute__((const, simd("notinbranch"))) float egc_sinf(float) __asm__("sinf");
__attribute__((simd("notinbranch"))) float powf(float, float);
#if __GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 35)  // (added to libmvec in glibc 2.35; scalar
__attribute__((simd("notinbranch"))) float log1pf(float);       // calls before: log1p 19x and expm1 5x
__attribute__((simd("notinbranch"))) float expm1f(float);       // slower than torch's)
#endif
}
#else
static inline float egc_cosf(float x) { return cosf(x); }
static inline float egc_sinf(float x) { return sinf(x); }
#endif
#include <cstring>
#include <type_traits>
// bfloat16 storage: the top half of a float, rounded to nearest even (NaN stays NaN).  Stores
// write the bits (egc_bf16_bits): a struct assigned in an `omp simd` loop became a per-lane
// array of temporaries that g++ left scalar (a float -> bf16 cast of 2M floats: 1.6 ms, torch 0.1)
static inline uint16_t egc_bf16_bits(float f) {
  const uint32_t u = __builtin_bit_cast(uint32_t, f);
  return (f != f) ? uint16_t(0x7fc0) : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
struct egc_bf16 {
  uint16_t bits;
  egc_bf16() = default;
  egc_bf16(float f) : bits(egc_bf16_bits(f)) {}
  operator float() const { return __builtin_bit_cast(float, uint32_t(bits) << 16); }
};
// float16 storage, read and written as bits through F16C's vcvtph2ps/vcvtps2ph (exact; rounded to
// nearest even).  g++ 12 has no vector form of a _Float16 <-> float conversion without AVX512-FP16 and
// left every fp16 loop scalar (a relu of 2M halves: 6.0 ms, torch 0.12), so these are declared SIMD
// functions whose 8-lane variants (the x86 vector ABI's AVX2 names) are written here with
// intrinsics.  The bits travel as int32 lanes: g++ vectorises no call with a 16-bit argument.
// (Defined under other C++ names, so that g++ cannot inline the scalar bodies and then not vectorise.)
#if defined(__F16C__) && defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
extern "C" {
#pragma omp declare simd simdlen(8) notinbranch
__attribute__((const, nothrow)) float egc_h2f(int32_t h);
#pragma omp declare simd simdlen(8) notinbranch
__attribute__((const, nothrow)) int32_t egc_f2h(float f);
}
float egc_h2f_1(int32_t h) asm("egc_h2f");
int32_t egc_f2h_1(float f) asm("egc_f2h");
__m256 egc_h2f_8(__m256i h) asm("_ZGVdN8v_egc_h2f");
__m256i egc_f2h_8(__m256 f) asm("_ZGVdN8v_egc_f2h");
__attribute__((visibility("hidden"))) float egc_h2f_1(int32_t h) { return _cvtsh_ss(static_cast<uint16_t>(h)); }
__attribute__((visibility("hidden"))) int32_t egc_f2h_1(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
__attribute__((visibility("hidden"))) __m256 egc_h2f_8(__m256i h) {  // 8 int32 lanes of bits -> 8 floats
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08);
  return _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
}
__attribute__((visibility("hidden"))) __m256i egc_f2h_8(__m256 f) {
  return _mm256_cvtepu16_epi32(_mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT));
}
#else  // (the compiler's own conversions: scalar loops without F16C, vector ones with AVX512-FP16)
static inline float egc_h2f(int32_t h) { return static_cast<float>(__builtin_bit_cast(_Float16, static_cast<uint16_t>(h))); }
static inline int32_t egc_f2h(float f) { return __builtin_bit_cast(uint16_t, static_cast<_Float16>(f)); }
#endif
static inline uint16_t egc_f16_bits(float f) { return static_cast<uint16_t>(egc_f2h(f)); }
// a cast inside a kernel: rounded to the dtype, computed on in float where the dtype is narrow
template <class T> struct egc_compute { using type = T; };
template <> struct egc_compute<_Float16> { using type = float; };
template <> struct egc_compute<egc_bf16> { using type = float; };
template <class T, class S> static inline typename egc_compute<T>::type egc_cast(S x) {
  if constexpr (std::is_integral<T>::value) {
    return static_cast<T>(x);  // integers exactly (a float truncates toward zero, as in torch)
  } else if constexpr (std::is_same<T, _Float16>::value) {
    return egc_h2f(egc_f2h(static_cast<float>(x)));
  } else {
    return static_cast<typename egc_compute<T>::type>(static_cast<T>(static_cast<float>(x)));
  }
}
// where(c, a, b) with both values computed (as torch computes both): written as `c ? a : b`, g++
// reads a's loads only where c holds, a masked load that it leaves unvectorised without AVX-512
// (a causal mask's softmax ran scalar: 1.33 ms for 262k elements)
template <class C, class A, class B>
static inline typename std::common_type<A, B>::type egc_where(C c, A a, B b) { return c ? a : b; }
// ...and where c is the same for a whole row (ViT's cat of its class token and its patches, read
// under a layer norm), g++ still sinks the loads into a branch and the row's loops run scalar.
// For floats the choice is then made on the bits (a mask of all ones or all zeros), which leaves
// nothing to sink: 123 -> 58 us for that kernel on 2 cores.  (Not for every where: a per-element
// mask's blend is one instruction, the bits three: +10% on a [1024, 1024] where.)
template <class C, class A, class B>
static inline typename std::common_type<A, B>::type egc_where_row(C c, A a, B b) {
  using T = typename std::common_type<A, B>::type;
  if constexpr (std::is_same<T, float>::value) {
    const float x = a, y = b;
    uint32_t ux, uy;
    std::memcpy(&ux, &x, 4);
    std::memcpy(&uy, &y, 4);
    const uint32_t m = -static_cast<uint32_t>(c != 0), u = (ux & m) | (uy & ~m);
    float out;
    std::memcpy(&out, &u, 4);
    return out;
  } else {
    return c ? a : b;
  }
}
// relu by value: `std::max(in0[i], 0.0f)` returns a reference to the load or to the constant, and
// g++ selected between their addresses, a branch per element (a relu of an input alone ran 34x
// slower than torch's: 10.3 against 0.30 ms for 4M floats; std::max(x, 0) keeps a NaN)
static inline float egc_relu(float x) { return std::max(x, 0.0f); }
static inline float egc_maximum(float a, float b) { return (a != a || a > b) ? a : ((b != b) ? b : std::max(a, b)); }
// exp without glibc's slow path: its vector expf runs scalar code for arguments below -87 (a
// mask's -inf, finfo.min: 10x slower).  Those take exp(x + 87) * exp(-87) (exact to the
// denormal result's own rounding; 0 below -104, as expf's is).  The shift and factor are
// chosen by bit masks: g++ turns expf of a select into a select of two expf calls (or of
// expf(x) and a constant, the slow call again); the floor is a variable so that it cannot
// fold expf(-104) either
float egc_exp_floor = -105.0f;  // exp(-105 + 87) * exp(-87) rounds to 0, as exp(x) does from -103.97 down
static inline float egc_exp(float x) {
  const float t = std::max(x, egc_exp_floor);  // (-inf -> the floor; NaN stays NaN)
  const int32_t tail = -static_cast<int32_t>(t < -87.0f);  // all ones below -87
  const int32_t shift_bits = tail & 0x42AE0000, factor_bits = (tail & 0x00B33687) | (~tail & 0x3F800000);
  float shift, factor;  // 87.0f or 0.0f; exp(-87) or 1.0f
  std::memcpy(&shift, &shift_bits, 4);
  std::memcpy(&factor, &factor_bits, 4);
  return expf(t + shift) * factor;
}
// exp(x) for x in [-87, 0] (a softmax's x - max(x) where the row's least is within 87 of its max:
// cpp._bounded_exps), inline where glibc's vector expf is a call per 8 lanes with the loop's registers
// saved around it (2/3 of a softmax kernel's time on 2 cores).  Cody-Waite reduction by ln 2, the
// rounding to an integer by adding and taking away 1.5 * 2^23 (ties to even), Cephes' degree-5
// polynomial, 1 added last: within 1.01 ulp of exp over every float in [-87.34, 0] (14 of 1.1e9
// above 1 ulp; torch's own CPU exp, Sleef's, is within 1).  2^n is built in the exponent's bits
// (n >= -126 here: a normal float).  Without FMA, expf.
#ifdef __FMA__
static inline float egc_exp_bounded(float x) {
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500E-4f;
  p = std::fma(p, r, 1.3981999507E-3f);
  p = std::fma(p, r, 8.3334519073E-3f);
  p = std::fma(p, r, 4.1665795894E-2f);
  p = std::fma(p, r, 1.6666665459E-1f);
  p = std::fma(p, r, 5.0000001201E-1f);
  p = 1.0f + std::fma(p, r * r, r);
  return p * __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
}
#else
static inline float egc_exp_bounded(float x) { return expf(x); }
#endif
// a gather's row: one out of range is never read (row 0 instead), and sets the kernel's error flag
static inline int64_t egc_row(int64_t i, int64_t rows, int32_t* err) {
  if (i < 0 || i >= rows) { __atomic_store_n(err, 1, __ATOMIC_RELAXED); return 0; }
  return i;
}
"""
