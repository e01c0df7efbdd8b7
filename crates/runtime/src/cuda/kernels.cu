// The device kernels of the CUDA backend, compiled at run time by NVRTC (no host headers: only
// built-ins). Each `extern "C" __global__` function implements one plan kernel, or one piece of one,
// with exactly the arithmetic of the CPU reference in `src/runtime/cpu/kernels.rs`. Matrix products are
// not here: they go through cuBLAS.
//
// Conventions: element counts and strides are 64-bit; elementwise kernels use grid-stride loops; row
// reductions use one block per row (block size a multiple of 32, at most 1024) with a warp-shuffle tree,
// accumulating in float32 like the CPU (float64 where the CPU uses f64). Copies move 32-bit words, so
// they serve f32 and i32 tensors alike (and 16-bit words for bf16 tensors).
//
// bf16 storage: a kernel whose body is a template over its element types has an f32 entry point (the
// plain name) and a bf16 one (`_bf16`): bf16 operands are read widened to f32 (`ld`), everything is
// computed in f32 exactly as in the f32 kernel, and a bf16 result is rounded once to nearest even when
// stored (`st`), as the CPU backend does. Statistics (row sums, max, cross-entropy stats) stay f32.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;

#define NEG_INF __int_as_float(0xff800000)

// ---- bf16 storage ---------------------------------------------------------------------------------

// A bf16 element: the top 16 bits of an f32 (no cuda_bf16.h: the PTX targets compute_70 and only
// converts, so the conversions are written out, bit-identical to the host's `half::bf16`).
struct bf16 {
    unsigned short bits;
};

// The f32 value of a bf16 (exact).
__device__ __forceinline__ float widen_bf16(bf16 h) { return __uint_as_float((u32)h.bits << 16); }

// The bf16 nearest to v, ties to even; NaN stays a quiet NaN, values past the range become infinite.
__device__ __forceinline__ bf16 round_bf16(float v) {
    const u32 x = __float_as_uint(v);
    bf16 h;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        h.bits = (unsigned short)((x >> 16) | 0x0040u);
    } else {
        const u32 up = (x & 0x8000u) != 0 && (x & 0x17fffu) != 0 ? 1u : 0u;
        h.bits = (unsigned short)((x >> 16) + up);
    }
    return h;
}

// Element i of a tensor as f32, and the store of an f32 result (rounded once into bf16 storage).
__device__ __forceinline__ float ld(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16* p, u64 i) { return widen_bf16(p[i]); }
__device__ __forceinline__ void st(float* p, u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16* p, u64 i, float v) { p[i] = round_bf16(v); }

// sqrt(2 / pi), 1 / sqrt(2 pi) and the cubic coefficient, folded in f32 exactly as the CPU's constants.
#define FRAC_2_SQRT_PI 1.12837916709551257390f
#define FRAC_1_SQRT_2 0.70710678118654752440f
#define SQRT_2_OVER_PI (FRAC_2_SQRT_PI * FRAC_1_SQRT_2)
#define INV_SQRT_2PI (0.5f * FRAC_2_SQRT_PI * FRAC_1_SQRT_2)
#define GELU_CUBIC 0.044715f

// Every element index i in [0, n) handled by this thread.
#define GRID_STRIDE(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Every row r in [0, rows) handled by this block.
#define BLOCK_ROWS(r, rows) for (u64 r = blockIdx.x; r < (rows); r += gridDim.x)

// Every column c in [0, width) of the current row handled by this thread.
#define ROW_COLUMNS(c, width) for (u64 c = threadIdx.x; c < (width); c += blockDim.x)

// ---- reductions -----------------------------------------------------------------------------------

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The sum of `v` over the block, returned to every thread. The first barrier protects `part` from the
// previous call's readers.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = (blockDim.x + 31u) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_sum(lane < warps ? part[lane] : 0.0f);
}

__device__ double block_sum_f64(double v) {
    __shared__ double part[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = (blockDim.x + 31u) >> 5;
    v = warp_sum_f64(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_sum_f64(lane < warps ? part[lane] : 0.0);
}

// The max of `v` over the block (NaN-ignoring like f32::max), returned to every thread.
__device__ float block_max(float v) {
    __shared__ float part[32];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = (blockDim.x + 31u) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) part[warp] = v;
    __syncthreads();
    return warp_max(lane < warps ? part[lane] : NEG_INF);
}

// Column sums of a [rows, width] matrix given by value(r, c), for blocks of (32, 8) threads on a grid of
// (ceil(width / 32), chunks): each block sums a strided subset of the rows of 32 columns, and adds its
// partial sums into `out` (zeroed by the host) unless it is the only chunk, when it stores them.
template <class F>
__device__ void column_sum(float* out, u64 rows, u64 width, F value) {
    __shared__ float part[8][33];
    const u64 c = (u64)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (c < width) {
        for (u64 r = (u64)blockIdx.y * 8 + threadIdx.y; r < rows; r += (u64)gridDim.y * 8) acc += value(r, c);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < width) {
        float s = 0.0f;
        for (int k = 0; k < 8; ++k) s += part[k][threadIdx.x];
        if (gridDim.y == 1) {
            out[c] = s;
        } else {
            atomicAdd(&out[c], s);
        }
    }
}

// Records that item `index` is invalid: the flag keeps the complement of the smallest such index
// (the host zeroes it first, so 0 means none).
__device__ __forceinline__ void flag_invalid(u64* flag, u64 index) { atomicMax(flag, ~index); }

// ---- elementwise ----------------------------------------------------------------------------------

template <class T>
__device__ void bias_add_t(T* y, const T* x, const T* b, u64 n, u64 width) {
    GRID_STRIDE(i, n) st(y, i, ld(x, i) + ld(b, i % width));
}

extern "C" __global__ void bias_add(float* y, const float* x, const float* b, u64 n, u64 width) {
    bias_add_t(y, x, b, n, width);
}

extern "C" __global__ void bias_add_bf16(bf16* y, const bf16* x, const bf16* b, u64 n, u64 width) {
    bias_add_t(y, x, b, n, width);
}

template <class T>
__device__ void add_t(T* y, const T* a, const T* b, u64 n) {
    GRID_STRIDE(i, n) st(y, i, ld(a, i) + ld(b, i));
}

extern "C" __global__ void add(float* y, const float* a, const float* b, u64 n) { add_t(y, a, b, n); }

extern "C" __global__ void add_bf16(bf16* y, const bf16* a, const bf16* b, u64 n) { add_t(y, a, b, n); }

template <class T>
__device__ void multiply_t(T* y, const T* a, const T* b, u64 n) {
    GRID_STRIDE(i, n) st(y, i, ld(a, i) * ld(b, i));
}

extern "C" __global__ void multiply(float* y, const float* a, const float* b, u64 n) { multiply_t(y, a, b, n); }

extern "C" __global__ void multiply_bf16(bf16* y, const bf16* a, const bf16* b, u64 n) { multiply_t(y, a, b, n); }

template <class T>
__device__ void scale_t(T* y, const T* x, float factor, u64 n) {
    GRID_STRIDE(i, n) st(y, i, ld(x, i) * factor);
}

extern "C" __global__ void scale(float* y, const float* x, float factor, u64 n) { scale_t(y, x, factor, n); }

// Keeps the stream busy for `cycles` SM clock cycles. A profile launches it before an instruction's
// first event, so that the GPU is still busy while the host queues the instruction's launches and the
// events around them time the GPU's work alone, not the host's queuing.
extern "C" __global__ void hold_stream(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {
    }
}

extern "C" __global__ void scale_bf16(bf16* y, const bf16* x, float factor, u64 n) { scale_t(y, x, factor, n); }

// Casts between f32 and bf16 storage (the Cast kernel, and the widening of operands for kernels
// without a bf16 entry point).
extern "C" __global__ void cast_f32_to_bf16(bf16* y, const float* x, u64 n) {
    GRID_STRIDE(i, n) y[i] = round_bf16(x[i]);
}

extern "C" __global__ void cast_bf16_to_f32(float* y, const bf16* x, u64 n) {
    GRID_STRIDE(i, n) y[i] = widen_bf16(x[i]);
}

// sigmoid(2u) for u = sqrt(2/pi) (x + 0.044715 x^3), i.e. 0.5 (1 + tanh u).
__device__ __forceinline__ float gelu_gate(float x) {
    return 1.0f / (1.0f + expf(-2.0f * SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)));
}

// y = f(x) element by element, for the unary activations below.
template <class T, class F>
__device__ void map_t(T* y, const T* x, u64 n, F f) {
    GRID_STRIDE(i, n) st(y, i, f(ld(x, i)));
}

// dx = f(dy, x) element by element, for the activation gradients below.
template <class T, class F>
__device__ void map2_t(T* dx, const T* dy, const T* x, u64 n, F f) {
    GRID_STRIDE(i, n) st(dx, i, f(ld(dy, i), ld(x, i)));
}

struct GeluTanh {
    __device__ float operator()(float v) const { return v * gelu_gate(v); }
};

struct GeluErf {
    __device__ float operator()(float v) const { return 0.5f * v * (1.0f + erff(v * FRAC_1_SQRT_2)); }
};

struct Silu {
    __device__ float operator()(float v) const { return v / (1.0f + expf(-v)); }
};

struct SiluGrad {
    __device__ float operator()(float d, float v) const {
        const float s = 1.0f / (1.0f + expf(-v));
        return d * (s + v * s * (1.0f - s));
    }
};

struct GeluTanhGrad {
    __device__ float operator()(float d, float v) const {
        const float s = gelu_gate(v);
        return d * (s + 2.0f * v * s * (1.0f - s) * SQRT_2_OVER_PI * (1.0f + 3.0f * GELU_CUBIC * v * v));
    }
};

struct GeluErfGrad {
    __device__ float operator()(float d, float v) const {
        const float cdf = 0.5f * (1.0f + erff(v * FRAC_1_SQRT_2));
        return d * (cdf + v * INV_SQRT_2PI * expf(-0.5f * v * v));
    }
};

extern "C" __global__ void gelu_tanh(float* y, const float* x, u64 n) { map_t(y, x, n, GeluTanh()); }

extern "C" __global__ void gelu_tanh_bf16(bf16* y, const bf16* x, u64 n) { map_t(y, x, n, GeluTanh()); }

extern "C" __global__ void gelu_erf(float* y, const float* x, u64 n) { map_t(y, x, n, GeluErf()); }

extern "C" __global__ void gelu_erf_bf16(bf16* y, const bf16* x, u64 n) { map_t(y, x, n, GeluErf()); }

extern "C" __global__ void silu(float* y, const float* x, u64 n) { map_t(y, x, n, Silu()); }

extern "C" __global__ void silu_bf16(bf16* y, const bf16* x, u64 n) { map_t(y, x, n, Silu()); }

extern "C" __global__ void silu_grad(float* dx, const float* dy, const float* x, u64 n) {
    map2_t(dx, dy, x, n, SiluGrad());
}

extern "C" __global__ void silu_grad_bf16(bf16* dx, const bf16* dy, const bf16* x, u64 n) {
    map2_t(dx, dy, x, n, SiluGrad());
}

// Rotary position embedding (Hugging Face Llama's rotate_half) of x [rows, width = heads * d], row r
// at position r mod seq: pair i of each head turns by sign * pos * inv_freq(i), sign 1 forward and -1
// for the backward. Each step of the angle is rounded to float32 as Hugging Face computes it, from a
// double-precision result, as the CPU does (src/runtime/rotary.rs).
template <class T>
__device__ void rotary_t(T* y, const T* x, u64 rows, u64 seq, u64 width, u64 d, double theta, float sign) {
    const u64 half = d / 2, per_row = width / 2;
    GRID_STRIDE(t, rows * per_row) {
        const u64 row = t / per_row, k = t % per_row, h = k / half, i = k % half;
        const float exponent = (float)(2 * i) / (float)d;
        const float power = (float)pow((double)(float)theta, (double)exponent);
        const float inv_freq = 1.0f / power;
        const double angle = (double)((float)(row % seq) * inv_freq);
        const float c = (float)cos(angle), s = sign * (float)sin(angle);
        const u64 at = row * width + h * d + i;
        const float x1 = ld(x, at), x2 = ld(x, at + half);
        st(y, at, x1 * c - x2 * s);
        st(y, at + half, x2 * c + x1 * s);
    }
}

extern "C" __global__ void rotary(float* y, const float* x, u64 rows, u64 seq, u64 width, u64 d, double theta,
                                  float sign) {
    rotary_t(y, x, rows, seq, width, d, theta, sign);
}

// bf16 operands, each pair computed in float32 and rounded once: the same bits as the f32 kernel on the
// widened operands followed by a rounding cast.
extern "C" __global__ void rotary_bf16(bf16* y, const bf16* x, u64 rows, u64 seq, u64 width, u64 d, double theta,
                                       float sign) {
    rotary_t(y, x, rows, seq, width, d, theta, sign);
}

extern "C" __global__ void gelu_tanh_grad(float* dx, const float* dy, const float* x, u64 n) {
    map2_t(dx, dy, x, n, GeluTanhGrad());
}

extern "C" __global__ void gelu_tanh_grad_bf16(bf16* dx, const bf16* dy, const bf16* x, u64 n) {
    map2_t(dx, dy, x, n, GeluTanhGrad());
}

extern "C" __global__ void gelu_erf_grad(float* dx, const float* dy, const float* x, u64 n) {
    map2_t(dx, dy, x, n, GeluErfGrad());
}

extern "C" __global__ void gelu_erf_grad_bf16(bf16* dx, const bf16* dy, const bf16* x, u64 n) {
    map2_t(dx, dy, x, n, GeluErfGrad());
}

// ---- bf16 elementwise, eight elements a thread ----------------------------------------------------
// Where every operand starts 16-byte aligned and n is a multiple of 8 (the host checks both), the bf16
// elementwise kernels move eight elements as one 16-byte word (the `_bf16x8` entry points): one wide
// access where the scalar kernels make eight 2-byte ones. Each element's arithmetic is the scalar
// kernel's, so the results are bit-identical.

struct alignas(16) Words16 {
    u32 w[4];
};

struct alignas(16) Floats4 {
    float f[4];
};

// Elements 8 chunk .. 8 chunk + 7 of a tensor as f32 (bf16 element 2k is the low half of word k).
__device__ __forceinline__ void load8(const bf16* p, u64 chunk, float v[8]) {
    const Words16 words = reinterpret_cast<const Words16*>(p)[chunk];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(words.w[k] << 16);
        v[2 * k + 1] = __uint_as_float(words.w[k] & 0xffff0000u);
    }
}

__device__ __forceinline__ void load8(const float* p, u64 chunk, float v[8]) {
    const Floats4 lo = reinterpret_cast<const Floats4*>(p)[2 * chunk];
    const Floats4 hi = reinterpret_cast<const Floats4*>(p)[2 * chunk + 1];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[k] = lo.f[k];
        v[4 + k] = hi.f[k];
    }
}

// Stores eight f32 results into elements 8 chunk .. 8 chunk + 7 (each rounded once into bf16 storage).
__device__ __forceinline__ void store8(bf16* p, u64 chunk, const float v[8]) {
    Words16 words;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        words.w[k] = (u32)round_bf16(v[2 * k]).bits | ((u32)round_bf16(v[2 * k + 1]).bits << 16);
    }
    reinterpret_cast<Words16*>(p)[chunk] = words;
}

__device__ __forceinline__ void store8(float* p, u64 chunk, const float v[8]) {
    Floats4 lo, hi;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo.f[k] = v[k];
        hi.f[k] = v[4 + k];
    }
    reinterpret_cast<Floats4*>(p)[2 * chunk] = lo;
    reinterpret_cast<Floats4*>(p)[2 * chunk + 1] = hi;
}

// y = f(x), eight elements a thread.
template <class Y, class X, class F>
__device__ void map8_t(Y* y, const X* x, u64 n, F f) {
    GRID_STRIDE(c, n / 8) {
        float v[8];
        load8(x, c, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = f(v[k]);
        store8(y, c, v);
    }
}

// y = f(a, b), eight elements a thread.
template <class F>
__device__ void map2_8_t(bf16* y, const bf16* a, const bf16* b, u64 n, F f) {
    GRID_STRIDE(c, n / 8) {
        float u[8], v[8];
        load8(a, c, u);
        load8(b, c, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) u[k] = f(u[k], v[k]);
        store8(y, c, u);
    }
}

struct Same {
    __device__ float operator()(float v) const { return v; }
};

struct Scaled {
    float factor;
    __device__ float operator()(float v) const { return v * factor; }
};

struct Sum {
    __device__ float operator()(float a, float b) const { return a + b; }
};

struct Product {
    __device__ float operator()(float a, float b) const { return a * b; }
};

extern "C" __global__ void add_bf16x8(bf16* y, const bf16* a, const bf16* b, u64 n) { map2_8_t(y, a, b, n, Sum()); }

extern "C" __global__ void multiply_bf16x8(bf16* y, const bf16* a, const bf16* b, u64 n) {
    map2_8_t(y, a, b, n, Product());
}

extern "C" __global__ void scale_bf16x8(bf16* y, const bf16* x, float factor, u64 n) {
    map8_t(y, x, n, Scaled{factor});
}

extern "C" __global__ void gelu_tanh_bf16x8(bf16* y, const bf16* x, u64 n) { map8_t(y, x, n, GeluTanh()); }

extern "C" __global__ void gelu_erf_bf16x8(bf16* y, const bf16* x, u64 n) { map8_t(y, x, n, GeluErf()); }

extern "C" __global__ void silu_bf16x8(bf16* y, const bf16* x, u64 n) { map8_t(y, x, n, Silu()); }

extern "C" __global__ void silu_grad_bf16x8(bf16* dx, const bf16* dy, const bf16* x, u64 n) {
    map2_8_t(dx, dy, x, n, SiluGrad());
}

extern "C" __global__ void gelu_tanh_grad_bf16x8(bf16* dx, const bf16* dy, const bf16* x, u64 n) {
    map2_8_t(dx, dy, x, n, GeluTanhGrad());
}

extern "C" __global__ void gelu_erf_grad_bf16x8(bf16* dx, const bf16* dy, const bf16* x, u64 n) {
    map2_8_t(dx, dy, x, n, GeluErfGrad());
}

extern "C" __global__ void cast_f32_to_bf16x8(bf16* y, const float* x, u64 n) { map8_t(y, x, n, Same()); }

extern "C" __global__ void cast_bf16_to_f32x8(float* y, const bf16* x, u64 n) { map8_t(y, x, n, Same()); }

// y = x + b[column], with width a multiple of 8 (so eight elements never straddle a row): the bias's
// eight columns are one 16-byte load too. The column is found in 32-bit arithmetic where it fits.
extern "C" __global__ void bias_add_bf16x8(bf16* y, const bf16* x, const bf16* b, u64 n, u64 width) {
    const u64 chunks_per_row = width / 8;
    const bool narrow = n / 8 <= 0xffffffffull;
    GRID_STRIDE(c, n / 8) {
        const u64 column = narrow ? (u64)((u32)c % (u32)chunks_per_row) : c % chunks_per_row;
        float u[8], v[8];
        load8(x, c, u);
        load8(b, column, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) u[k] = u[k] + v[k];
        store8(y, c, u);
    }
}

// Copies x, replacing entries above the diagonal of each trailing [rows, cols] matrix by `fill`.
template <class T>
__device__ void causal_mask_t(T* y, const T* x, u64 n, u64 rows, u64 cols, float fill) {
    GRID_STRIDE(i, n) {
        const u64 c = i % cols, r = (i / cols) % rows;
        st(y, i, c <= r ? ld(x, i) : fill);
    }
}

extern "C" __global__ void causal_mask(float* y, const float* x, u64 n, u64 rows, u64 cols, float fill) {
    causal_mask_t(y, x, n, rows, cols, fill);
}

extern "C" __global__ void causal_mask_bf16(bf16* y, const bf16* x, u64 n, u64 rows, u64 cols, float fill) {
    causal_mask_t(y, x, n, rows, cols, fill);
}

// SplitMix64's finaliser of the state advanced by the golden gamma (as the CPU's `splitmix64`).
__device__ __forceinline__ u64 splitmix64(u64 z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Keeps element i when the top 53 bits of its hash, as a number, are >= threshold = p 2^53; `base` is the
// host's splitmix64(seed ^ splitmix64(key ^ C)) and `logical` the logical index of each local element.
template <class T>
__device__ void dropout_t(T* y, const T* x, const u64* logical, u64 n, u64 base, double threshold, float scale) {
    GRID_STRIDE(i, n) {
        const u64 h = splitmix64(base + logical[i] * 0x9E3779B97F4A7C15ull);
        st(y, i, (double)(h >> 11) >= threshold ? ld(x, i) * scale : 0.0f);
    }
}

extern "C" __global__ void dropout(float* y, const float* x, const u64* logical, u64 n, u64 base, double threshold,
                                   float scale) {
    dropout_t(y, x, logical, n, base, threshold, scale);
}

extern "C" __global__ void dropout_bf16(bf16* y, const bf16* x, const u64* logical, u64 n, u64 base,
                                        double threshold, float scale) {
    dropout_t(y, x, logical, n, base, threshold, scale);
}

extern "C" __global__ void fill_bits(u32* y, u32 bits, u64 n) {
    GRID_STRIDE(i, n) y[i] = bits;
}

// Zeroes `batches` [rows, cols] blocks whose rows are `ld` apart and which start `stride` apart.
template <class T>
__device__ void zero_blocks_t(T* y, u64 batches, u64 rows, u64 cols, u64 ld, u64 stride) {
    const u64 n = batches * rows * cols;
    GRID_STRIDE(i, n) {
        const u64 c = i % cols, r = (i / cols) % rows, t = i / (cols * rows);
        st(y, t * stride + r * ld + c, 0.0f);
    }
}

extern "C" __global__ void zero_blocks(float* y, u64 batches, u64 rows, u64 cols, u64 ld, u64 stride) {
    zero_blocks_t(y, batches, rows, cols, ld, stride);
}

extern "C" __global__ void zero_blocks_bf16(bf16* y, u64 batches, u64 rows, u64 cols, u64 ld, u64 stride) {
    zero_blocks_t(y, batches, rows, cols, ld, stride);
}

// ---- data movement (32-bit words; 16-bit words for bf16) -----------------------------------------

typedef unsigned short u16;

// `count` runs of `len` words from src[src_offset + t src_stride ..] to dst[dst_offset + t dst_stride ..].
template <class W>
__device__ void copy_runs_t(W* dst, const W* src, u64 count, u64 len, u64 src_stride, u64 src_offset,
                            u64 dst_stride, u64 dst_offset) {
    const u64 n = count * len;
    GRID_STRIDE(i, n) {
        const u64 t = i / len, k = i % len;
        dst[dst_offset + t * dst_stride + k] = src[src_offset + t * src_stride + k];
    }
}

extern "C" __global__ void copy_runs(u32* dst, const u32* src, u64 count, u64 len, u64 src_stride, u64 src_offset,
                                     u64 dst_stride, u64 dst_offset) {
    copy_runs_t(dst, src, count, len, src_stride, src_offset, dst_stride, dst_offset);
}

extern "C" __global__ void copy_runs_u16(u16* dst, const u16* src, u64 count, u64 len, u64 src_stride,
                                         u64 src_offset, u64 dst_stride, u64 dst_offset) {
    copy_runs_t(dst, src, count, len, src_stride, src_offset, dst_stride, dst_offset);
}

// Swaps dimensions p and q of [a, p, b, q, c]: dst is [a, q, b, p, c].
template <class W>
__device__ void transpose_t(W* dst, const W* src, u64 a, u64 p, u64 b, u64 q, u64 c) {
    const u64 n = a * p * b * q * c;
    GRID_STRIDE(d, n) {
        u64 t = d / c;
        const u64 ic = d % c, ip = t % p;
        t /= p;
        const u64 ib = t % b;
        t /= b;
        const u64 iq = t % q, ia = t / q;
        dst[d] = src[(((ia * p + ip) * b + ib) * q + iq) * c + ic];
    }
}

extern "C" __global__ void transpose(u32* dst, const u32* src, u64 a, u64 p, u64 b, u64 q, u64 c) {
    transpose_t(dst, src, a, p, b, q, c);
}

extern "C" __global__ void transpose_u16(u16* dst, const u16* src, u64 a, u64 p, u64 b, u64 q, u64 c) {
    transpose_t(dst, src, a, p, b, q, c);
}

// ---- softmax --------------------------------------------------------------------------------------

// Max-subtracted softmax of the first `live` entries of a row in place (`row` may alias `src`); the
// entries from `live` to `width` become `rest`.
__device__ void softmax_row(float* row, const float* src, u64 live, u64 width, float rest) {
    float m = NEG_INF;
    ROW_COLUMNS(c, live) m = fmaxf(m, src[c]);
    m = block_max(m);
    float s = 0.0f;
    ROW_COLUMNS(c, live) {
        const float e = expf(src[c] - m);
        row[c] = e;
        s += e;
    }
    const float inv = 1.0f / block_sum(s);
    ROW_COLUMNS(c, live) row[c] *= inv;
    for (u64 c = live + threadIdx.x; c < width; c += blockDim.x) row[c] = rest;
}

extern "C" __global__ void softmax(float* y, const float* x, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) softmax_row(y + r * width, x + r * width, width, width, 0.0f);
}

// The softmax of a row into a separate row of any storage: the exponentials are recomputed rather than
// stored, so that a bf16 result is rounded once (the f32 kernel stores them, which gives the same values).
template <class T>
__device__ void softmax_row_t(T* row, const T* src, u64 width) {
    float m = NEG_INF;
    ROW_COLUMNS(c, width) m = fmaxf(m, ld(src, c));
    m = block_max(m);
    float s = 0.0f;
    ROW_COLUMNS(c, width) s += expf(ld(src, c) - m);
    const float inv = 1.0f / block_sum(s);
    ROW_COLUMNS(c, width) st(row, c, expf(ld(src, c) - m) * inv);
}

extern "C" __global__ void softmax_bf16(bf16* y, const bf16* x, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) softmax_row_t(y + r * width, x + r * width, width);
}

template <class T>
__device__ void softmax_grad_t(T* dx, const T* dy, const T* y, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) {
        const T *dyr = dy + r * width, *yr = y + r * width;
        float dot = 0.0f;
        ROW_COLUMNS(c, width) dot += ld(dyr, c) * ld(yr, c);
        dot = block_sum(dot);
        ROW_COLUMNS(c, width) st(dx, r * width + c, ld(yr, c) * (ld(dyr, c) - dot));
    }
}

extern "C" __global__ void softmax_grad(float* dx, const float* dy, const float* y, u64 rows, u64 width) {
    softmax_grad_t(dx, dy, y, rows, width);
}

extern "C" __global__ void softmax_grad_bf16(bf16* dx, const bf16* dy, const bf16* y, u64 rows, u64 width) {
    softmax_grad_t(dx, dy, y, rows, width);
}

// The attention probabilities in place on scores [.., sq, sk]: row q keeps min(q + 1, sk) live columns
// when causal, and masked entries become 0.
extern "C" __global__ void attention_softmax(float* s, u64 rows, u64 sq, u64 sk, int causal) {
    BLOCK_ROWS(r, rows) {
        const u64 q = r % sq;
        const u64 live = causal ? (q + 1 < sk ? q + 1 : sk) : sk;
        softmax_row(s + r * sk, s + r * sk, live, sk, 0.0f);
    }
}

// dS = P (dP - rowsum(dP P)) in place on dP.
extern "C" __global__ void attention_softmax_grad(float* d, const float* p, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) {
        float* dr = d + r * width;
        const float* pr = p + r * width;
        float dot = 0.0f;
        ROW_COLUMNS(c, width) dot += dr[c] * pr[c];
        dot = block_sum(dot);
        ROW_COLUMNS(c, width) dr[c] = pr[c] * (dr[c] - dot);
    }
}

// ---- embeddings -----------------------------------------------------------------------------------

// The table row of `id` on a device whose rows start at `base`, if it holds it.
__device__ __forceinline__ bool local_row(int id, i64 base, u64 rows, u64* row) {
    const i64 r = (i64)id - base;
    if (r < 0 || (u64)r >= rows) return false;
    *row = (u64)r;
    return true;
}

template <class T>
__device__ void embedding_lookup_t(T* y, const int* ids, const T* table, u64 count, u64 rows, u64 width, i64 base,
                                   u64* invalid) {
    const u64 n = count * width;
    GRID_STRIDE(i, n) {
        const u64 t = i / width, c = i % width;
        u64 r;
        if (local_row(ids[t], base, rows, &r)) {
            st(y, i, ld(table, r * width + c));
        } else {
            st(y, i, 0.0f);
            if (c == 0) flag_invalid(invalid, t);
        }
    }
}

extern "C" __global__ void embedding_lookup(float* y, const int* ids, const float* table, u64 count, u64 rows,
                                            u64 width, i64 base, u64* invalid) {
    embedding_lookup_t(y, ids, table, count, rows, width, base, invalid);
}

extern "C" __global__ void embedding_lookup_bf16(bf16* y, const int* ids, const bf16* table, u64 count, u64 rows,
                                                 u64 width, i64 base, u64* invalid) {
    embedding_lookup_t(y, ids, table, count, rows, width, base, invalid);
}

// Scatter-add of dy rows into g (zeroed by the host; f32 always: a bf16 gradient is summed in an f32
// scratch and rounded once).
template <class T>
__device__ void embedding_grad_t(float* g, const int* ids, const T* dy, u64 count, u64 rows, u64 width, i64 base,
                                 i64 padding, u64* invalid) {
    const u64 n = count * width;
    GRID_STRIDE(i, n) {
        const u64 t = i / width, c = i % width;
        u64 r;
        if ((i64)ids[t] == padding) {
            continue;
        }
        if (local_row(ids[t], base, rows, &r)) {
            atomicAdd(&g[r * width + c], ld(dy, i));
        } else if (c == 0) {
            flag_invalid(invalid, t);
        }
    }
}

extern "C" __global__ void embedding_grad(float* g, const int* ids, const float* dy, u64 count, u64 rows, u64 width,
                                          i64 base, i64 padding, u64* invalid) {
    embedding_grad_t(g, ids, dy, count, rows, width, base, padding, invalid);
}

extern "C" __global__ void embedding_grad_bf16(float* g, const int* ids, const bf16* dy, u64 count, u64 rows,
                                               u64 width, i64 base, i64 padding, u64* invalid) {
    embedding_grad_t(g, ids, dy, count, rows, width, base, padding, invalid);
}

// out[.., p, :] = table[p, :]: every `block` = seq * width elements repeat the table's first block.
template <class T>
__device__ void position_lookup_t(T* y, const T* table, u64 n, u64 block) {
    GRID_STRIDE(i, n) st(y, i, ld(table, i % block));
}

extern "C" __global__ void position_lookup(float* y, const float* table, u64 n, u64 block) {
    position_lookup_t(y, table, n, block);
}

extern "C" __global__ void position_lookup_bf16(bf16* y, const bf16* table, u64 n, u64 block) {
    position_lookup_t(y, table, n, block);
}

// g[k] = sum over the blocks of dy of dy[t * block + k] (g f32, zeroed by the host, rows past seq stay 0).
template <class T>
__device__ void position_grad_t(float* g, const T* dy, u64 blocks, u64 block) {
    column_sum(g, blocks, block, [=](u64 t, u64 k) { return ld(dy, t * block + k); });
}

extern "C" __global__ void position_grad(float* g, const float* dy, u64 blocks, u64 block) {
    position_grad_t(g, dy, blocks, block);
}

extern "C" __global__ void position_grad_bf16(float* g, const bf16* dy, u64 blocks, u64 block) {
    position_grad_t(g, dy, blocks, block);
}

// ---- layer norm -----------------------------------------------------------------------------------

// (mean, 1 / sqrt(var + eps)) of a row from its all-reduced sums, in f64 as the CPU.
__device__ __forceinline__ void mean_rstd(float sum, float sqsum, u64 n, double eps, float* mean, float* rstd) {
    const double dn = (double)n;
    *mean = (float)((double)sum / dn);
    *rstd = (float)(1.0 / sqrt((double)sqsum / dn + eps));
}

template <class T>
__device__ void row_sum_t(float* y, const T* x, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) {
        float s = 0.0f;
        ROW_COLUMNS(c, width) s += ld(x, r * width + c);
        s = block_sum(s);
        if (threadIdx.x == 0) y[r] = s;
    }
}

extern "C" __global__ void row_sum(float* y, const float* x, u64 rows, u64 width) { row_sum_t(y, x, rows, width); }

extern "C" __global__ void row_sum_bf16(float* y, const bf16* x, u64 rows, u64 width) {
    row_sum_t(y, x, rows, width);
}

template <class T>
__device__ void row_centered_square_sum_t(float* y, const T* x, const float* sum, u64 rows, u64 width, u64 n) {
    BLOCK_ROWS(r, rows) {
        const float mean = (float)((double)sum[r] / (double)n);
        float s = 0.0f;
        ROW_COLUMNS(c, width) {
            const float d = ld(x, r * width + c) - mean;
            s += d * d;
        }
        s = block_sum(s);
        if (threadIdx.x == 0) y[r] = s;
    }
}

extern "C" __global__ void row_centered_square_sum(float* y, const float* x, const float* sum, u64 rows, u64 width,
                                                   u64 n) {
    row_centered_square_sum_t(y, x, sum, rows, width, n);
}

extern "C" __global__ void row_centered_square_sum_bf16(float* y, const bf16* x, const float* sum, u64 rows,
                                                        u64 width, u64 n) {
    row_centered_square_sum_t(y, x, sum, rows, width, n);
}

template <class T>
__device__ void layer_norm_apply_t(T* y, const T* x, const float* sum, const float* sqsum, const T* gamma,
                                   const T* beta, u64 rows, u64 width, u64 n, double eps) {
    BLOCK_ROWS(r, rows) {
        float mean, rstd;
        mean_rstd(sum[r], sqsum[r], n, eps, &mean, &rstd);
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            st(y, i, (ld(x, i) - mean) * rstd * ld(gamma, c) + ld(beta, c));
        }
    }
}

extern "C" __global__ void layer_norm_apply(float* y, const float* x, const float* sum, const float* sqsum,
                                            const float* gamma, const float* beta, u64 rows, u64 width, u64 n,
                                            double eps) {
    layer_norm_apply_t(y, x, sum, sqsum, gamma, beta, rows, width, n, eps);
}

extern "C" __global__ void layer_norm_apply_bf16(bf16* y, const bf16* x, const float* sum, const float* sqsum,
                                                 const bf16* gamma, const bf16* beta, u64 rows, u64 width, u64 n,
                                                 double eps) {
    layer_norm_apply_t(y, x, sum, sqsum, gamma, beta, rows, width, n, eps);
}

// [rows, 2] (f32): the local sums of dy gamma and dy gamma xhat.
template <class T>
__device__ void layer_norm_grad_sums_t(float* y, const T* dy, const T* x, const T* gamma, const float* sum,
                                       const float* sqsum, u64 rows, u64 width, u64 n, double eps) {
    BLOCK_ROWS(r, rows) {
        float mean, rstd;
        mean_rstd(sum[r], sqsum[r], n, eps, &mean, &rstd);
        float a = 0.0f, b = 0.0f;
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            const float s = ld(dy, i) * ld(gamma, c);
            a += s;
            b += s * (ld(x, i) - mean) * rstd;
        }
        a = block_sum(a);
        b = block_sum(b);
        if (threadIdx.x == 0) {
            y[2 * r] = a;
            y[2 * r + 1] = b;
        }
    }
}

extern "C" __global__ void layer_norm_grad_sums(float* y, const float* dy, const float* x, const float* gamma,
                                                const float* sum, const float* sqsum, u64 rows, u64 width, u64 n,
                                                double eps) {
    layer_norm_grad_sums_t(y, dy, x, gamma, sum, sqsum, rows, width, n, eps);
}

extern "C" __global__ void layer_norm_grad_sums_bf16(float* y, const bf16* dy, const bf16* x, const bf16* gamma,
                                                     const float* sum, const float* sqsum, u64 rows, u64 width, u64 n,
                                                     double eps) {
    layer_norm_grad_sums_t(y, dy, x, gamma, sum, sqsum, rows, width, n, eps);
}

template <class T>
__device__ void layer_norm_grad_input_t(T* dx, const T* dy, const T* x, const T* gamma, const float* sum,
                                        const float* sqsum, const float* sums, u64 rows, u64 width, u64 n,
                                        double eps) {
    const float inv_n = (float)(1.0 / (double)n);
    BLOCK_ROWS(r, rows) {
        float mean, rstd;
        mean_rstd(sum[r], sqsum[r], n, eps, &mean, &rstd);
        const float a = sums[2 * r] * inv_n, b = sums[2 * r + 1] * inv_n;
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            const float xhat = (ld(x, i) - mean) * rstd;
            st(dx, i, rstd * (ld(dy, i) * ld(gamma, c) - a - xhat * b));
        }
    }
}

extern "C" __global__ void layer_norm_grad_input(float* dx, const float* dy, const float* x, const float* gamma,
                                                 const float* sum, const float* sqsum, const float* sums, u64 rows,
                                                 u64 width, u64 n, double eps) {
    layer_norm_grad_input_t(dx, dy, x, gamma, sum, sqsum, sums, rows, width, n, eps);
}

extern "C" __global__ void layer_norm_grad_input_bf16(bf16* dx, const bf16* dy, const bf16* x, const bf16* gamma,
                                                      const float* sum, const float* sqsum, const float* sums,
                                                      u64 rows, u64 width, u64 n, double eps) {
    layer_norm_grad_input_t(dx, dy, x, gamma, sum, sqsum, sums, rows, width, n, eps);
}

// [rows, 2] (mean, rstd) of each row, for the column reductions below.
extern "C" __global__ void layer_norm_stats(float* stats, const float* sum, const float* sqsum, u64 rows, u64 n,
                                            double eps) {
    GRID_STRIDE(r, rows) mean_rstd(sum[r], sqsum[r], n, eps, &stats[2 * r], &stats[2 * r + 1]);
}

// [width] (f32): the sum over rows of dy xhat, from the rows' (mean, rstd).
template <class T>
__device__ void layer_norm_grad_weight_t(float* g, const T* dy, const T* x, const float* stats, u64 rows,
                                         u64 width) {
    column_sum(g, rows, width, [=](u64 r, u64 c) {
        const u64 i = r * width + c;
        return ld(dy, i) * (ld(x, i) - stats[2 * r]) * stats[2 * r + 1];
    });
}

extern "C" __global__ void layer_norm_grad_weight(float* g, const float* dy, const float* x, const float* stats,
                                                  u64 rows, u64 width) {
    layer_norm_grad_weight_t(g, dy, x, stats, rows, width);
}

extern "C" __global__ void layer_norm_grad_weight_bf16(float* g, const bf16* dy, const bf16* x, const float* stats,
                                                       u64 rows, u64 width) {
    layer_norm_grad_weight_t(g, dy, x, stats, rows, width);
}

// ---- layer norm on bf16 rows of whole 16-byte words (width a multiple of 8, 16-byte aligned) --------
// One warp a row (eight rows a block of 256 threads), each lane eight columns at a time: all of a GPT-2
// step's rows are in flight at once, where one block a row left most of them waiting for a block slot.
// The arithmetic per element is the kernels' above; sums run in another order (lanes, then a warp tree).

// Every row r in [0, rows) handled by this warp.
#define WARP_ROWS(r, rows)                                                                    \
    for (u64 r = (u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); r < (rows); \
         r += (u64)gridDim.x * (blockDim.x >> 5))

// Every eight-column word c in [0, words) of the current row handled by this lane.
#define LANE_WORDS(c, words) for (u64 c = threadIdx.x & 31u; c < (words); c += 32)

extern "C" __global__ void row_sum_bf16x8(float* y, const bf16* x, u64 rows, u64 width) {
    const u64 words = width / 8;
    WARP_ROWS(r, rows) {
        float s = 0.0f;
        LANE_WORDS(c, words) {
            float v[8];
            load8(x, r * words + c, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) s += v[k];
        }
        s = warp_sum(s);
        if ((threadIdx.x & 31u) == 0) y[r] = s;
    }
}

extern "C" __global__ void row_centered_square_sum_bf16x8(float* y, const bf16* x, const float* sum, u64 rows,
                                                          u64 width, u64 n) {
    const u64 words = width / 8;
    WARP_ROWS(r, rows) {
        const float mean = (float)((double)sum[r] / (double)n);
        float s = 0.0f;
        LANE_WORDS(c, words) {
            float v[8];
            load8(x, r * words + c, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float d = v[k] - mean;
                s += d * d;
            }
        }
        s = warp_sum(s);
        if ((threadIdx.x & 31u) == 0) y[r] = s;
    }
}

extern "C" __global__ void layer_norm_apply_bf16x8(bf16* y, const bf16* x, const float* sum, const float* sqsum,
                                                   const bf16* gamma, const bf16* beta, u64 rows, u64 width, u64 n,
                                                   double eps) {
    const u64 words = width / 8;
    WARP_ROWS(r, rows) {
        float mean, rstd;
        mean_rstd(sum[r], sqsum[r], n, eps, &mean, &rstd);
        LANE_WORDS(c, words) {
            float v[8], g[8], b[8];
            load8(x, r * words + c, v);
            load8(gamma, c, g);
            load8(beta, c, b);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = (v[k] - mean) * rstd * g[k] + b[k];
            store8(y, r * words + c, v);
        }
    }
}

extern "C" __global__ void layer_norm_grad_sums_bf16x8(float* y, const bf16* dy, const bf16* x, const bf16* gamma,
                                                       const float* sum, const float* sqsum, u64 rows, u64 width,
                                                       u64 n, double eps) {
    const u64 words = width / 8;
    WARP_ROWS(r, rows) {
        float mean, rstd;
        mean_rstd(sum[r], sqsum[r], n, eps, &mean, &rstd);
        float a = 0.0f, b = 0.0f;
        LANE_WORDS(c, words) {
            float d[8], v[8], g[8];
            load8(dy, r * words + c, d);
            load8(x, r * words + c, v);
            load8(gamma, c, g);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float s = d[k] * g[k];
                a += s;
                b += s * (v[k] - mean) * rstd;
            }
        }
        a = warp_sum(a);
        b = warp_sum(b);
        if ((threadIdx.x & 31u) == 0) {
            y[2 * r] = a;
            y[2 * r + 1] = b;
        }
    }
}

extern "C" __global__ void layer_norm_grad_input_bf16x8(bf16* dx, const bf16* dy, const bf16* x, const bf16* gamma,
                                                        const float* sum, const float* sqsum, const float* sums,
                                                        u64 rows, u64 width, u64 n, double eps) {
    const u64 words = width / 8;
    const float inv_n = (float)(1.0 / (double)n);
    WARP_ROWS(r, rows) {
        float mean, rstd;
        mean_rstd(sum[r], sqsum[r], n, eps, &mean, &rstd);
        const float a = sums[2 * r] * inv_n, b = sums[2 * r + 1] * inv_n;
        LANE_WORDS(c, words) {
            float d[8], v[8], g[8];
            load8(dy, r * words + c, d);
            load8(x, r * words + c, v);
            load8(gamma, c, g);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float xhat = (v[k] - mean) * rstd;
                v[k] = rstd * (d[k] * g[k] - a - xhat * b);
            }
            store8(dx, r * words + c, v);
        }
    }
}

// [width] (f32): the column sums of x.
template <class T>
__device__ void sum_to_last_t(float* g, const T* x, u64 rows, u64 width) {
    column_sum(g, rows, width, [=](u64 r, u64 c) { return ld(x, r * width + c); });
}

// ---- RMSNorm --------------------------------------------------------------------------------------

// 1 / sqrt(sqsum / n + eps) of a row from its all-reduced sum of squares, in f64 as the CPU.
__device__ __forceinline__ float inverse_rms(float sqsum, u64 n, double eps) {
    return (float)(1.0 / sqrt((double)sqsum / (double)n + eps));
}

// The RMSNorm kernels take f32 or bf16 rows (x, dy, the weight and the normalised output); the row
// statistics and sums stay f32. A bf16 entry point computes in float32 as the f32 one does, on the
// exactly widened elements, and rounds its bf16 output once: the same bits as the f32 kernel on widened
// operands followed by a rounding cast, without the widened copies.
template <class T>
__device__ void row_square_sum_t(float* y, const T* x, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) {
        float s = 0.0f;
        ROW_COLUMNS(c, width) {
            const float v = ld(x, r * width + c);
            s += v * v;
        }
        s = block_sum(s);
        if (threadIdx.x == 0) y[r] = s;
    }
}

extern "C" __global__ void row_square_sum(float* y, const float* x, u64 rows, u64 width) {
    row_square_sum_t(y, x, rows, width);
}

extern "C" __global__ void row_square_sum_bf16(float* y, const bf16* x, u64 rows, u64 width) {
    row_square_sum_t(y, x, rows, width);
}

template <class T>
__device__ void rms_norm_apply_t(T* y, const T* x, const float* sqsum, const T* weight, u64 rows, u64 width, u64 n,
                                 double eps) {
    BLOCK_ROWS(r, rows) {
        const float inv = inverse_rms(sqsum[r], n, eps);
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            st(y, i, ld(x, i) * inv * ld(weight, c));
        }
    }
}

extern "C" __global__ void rms_norm_apply(float* y, const float* x, const float* sqsum, const float* weight, u64 rows,
                                          u64 width, u64 n, double eps) {
    rms_norm_apply_t(y, x, sqsum, weight, rows, width, n, eps);
}

extern "C" __global__ void rms_norm_apply_bf16(bf16* y, const bf16* x, const float* sqsum, const bf16* weight,
                                               u64 rows, u64 width, u64 n, double eps) {
    rms_norm_apply_t(y, x, sqsum, weight, rows, width, n, eps);
}

// [rows]: the local sum of dy weight x of each row.
template <class T>
__device__ void rms_norm_grad_sum_t(float* y, const T* dy, const T* x, const T* weight, u64 rows, u64 width) {
    BLOCK_ROWS(r, rows) {
        float s = 0.0f;
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            s += ld(dy, i) * ld(weight, c) * ld(x, i);
        }
        s = block_sum(s);
        if (threadIdx.x == 0) y[r] = s;
    }
}

extern "C" __global__ void rms_norm_grad_sum(float* y, const float* dy, const float* x, const float* weight, u64 rows,
                                             u64 width) {
    rms_norm_grad_sum_t(y, dy, x, weight, rows, width);
}

extern "C" __global__ void rms_norm_grad_sum_bf16(float* y, const bf16* dy, const bf16* x, const bf16* weight,
                                                  u64 rows, u64 width) {
    rms_norm_grad_sum_t(y, dy, x, weight, rows, width);
}

template <class T>
__device__ void rms_norm_grad_input_t(T* dx, const T* dy, const T* x, const T* weight, const float* sqsum,
                                      const float* sums, u64 rows, u64 width, u64 n, double eps) {
    BLOCK_ROWS(r, rows) {
        const float inv = inverse_rms(sqsum[r], n, eps);
        const double r64 = (double)inv;
        const float coefficient = (float)(r64 * r64 * r64 * (double)sums[r] / (double)n);
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            st(dx, i, inv * ld(weight, c) * ld(dy, i) - coefficient * ld(x, i));
        }
    }
}

extern "C" __global__ void rms_norm_grad_input(float* dx, const float* dy, const float* x, const float* weight,
                                               const float* sqsum, const float* sums, u64 rows, u64 width, u64 n,
                                               double eps) {
    rms_norm_grad_input_t(dx, dy, x, weight, sqsum, sums, rows, width, n, eps);
}

extern "C" __global__ void rms_norm_grad_input_bf16(bf16* dx, const bf16* dy, const bf16* x, const bf16* weight,
                                                    const float* sqsum, const float* sums, u64 rows, u64 width, u64 n,
                                                    double eps) {
    rms_norm_grad_input_t(dx, dy, x, weight, sqsum, sums, rows, width, n, eps);
}

// [rows]: 1 / rms of each row, for the column reduction below.
extern "C" __global__ void rms_norm_stats(float* stats, const float* sqsum, u64 rows, u64 n, double eps) {
    GRID_STRIDE(r, rows) stats[r] = inverse_rms(sqsum[r], n, eps);
}

// [width] (f32): the sum over rows of dy x / rms.
template <class T>
__device__ void rms_norm_grad_weight_t(float* g, const T* dy, const T* x, const float* stats, u64 rows, u64 width) {
    column_sum(g, rows, width, [=](u64 r, u64 c) {
        const u64 i = r * width + c;
        return ld(dy, i) * ld(x, i) * stats[r];
    });
}

extern "C" __global__ void rms_norm_grad_weight(float* g, const float* dy, const float* x, const float* stats, u64 rows,
                                                u64 width) {
    rms_norm_grad_weight_t(g, dy, x, stats, rows, width);
}

extern "C" __global__ void rms_norm_grad_weight_bf16(float* g, const bf16* dy, const bf16* x, const float* stats,
                                                     u64 rows, u64 width) {
    rms_norm_grad_weight_t(g, dy, x, stats, rows, width);
}

extern "C" __global__ void sum_to_last(float* g, const float* x, u64 rows, u64 width) {
    sum_to_last_t(g, x, rows, width);
}

extern "C" __global__ void sum_to_last_bf16(float* g, const bf16* x, u64 rows, u64 width) {
    sum_to_last_t(g, x, rows, width);
}

// The column sums of a bf16 [rows, width] matrix into a bf16 [width], in two passes and without atomics
// (the bias gradients of bf16 plans; width a multiple of 8 and x 16-byte aligned, which the host checks).
// Pass one: blocks of (32, 8) threads sum `span` rows of 256 columns, eight columns a thread (one 16-byte
// load a row), into part[chunk, width] (f32). Pass two adds the chunks of each column in a fixed order
// and rounds once. The same shape gives the same bits on every run.
template <class F>
__device__ void column_partials_t(float* part, u64 rows, u64 width, u64 span, F words_of_row) {
    __shared__ float lanes[8][256];
    const u64 chunks_per_row = width / 8, group = (u64)blockIdx.x * 32 + threadIdx.x;
    float acc[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
    if (group < chunks_per_row) {
        const u64 first = (u64)blockIdx.y * span, end = first + span < rows ? first + span : rows;
        for (u64 r = first + threadIdx.y; r < end; r += 8) {
            float v[8];
            words_of_row(r, r * chunks_per_row + group, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[k] += v[k];
        }
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) lanes[threadIdx.y][threadIdx.x * 8 + k] = acc[k];
    __syncthreads();
    const u32 t = threadIdx.y * 32 + threadIdx.x;
    const u64 column = (u64)blockIdx.x * 256 + t;
    if (column < width) {
        float s = 0.0f;
        for (int j = 0; j < 8; ++j) s += lanes[j][t];
        part[(u64)blockIdx.y * width + column] = s;
    }
}

extern "C" __global__ void column_partials_bf16x8(float* part, const bf16* x, u64 rows, u64 width, u64 span) {
    column_partials_t(part, rows, width, span, [=](u64, u64 word, float v[8]) { load8(x, word, v); });
}

// The LayerNorm weight gradient's column partials: dy xhat from the rows' (mean, rstd), as
// layer_norm_grad_weight computes each term.
extern "C" __global__ void layer_norm_weight_partials_bf16x8(float* part, const bf16* dy, const bf16* x,
                                                             const float* stats, u64 rows, u64 width, u64 span) {
    column_partials_t(part, rows, width, span, [=](u64 r, u64 word, float v[8]) {
        float d[8];
        load8(dy, word, d);
        load8(x, word, v);
        const float mean = stats[2 * r], rstd = stats[2 * r + 1];
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = d[k] * (v[k] - mean) * rstd;
    });
}

// Pass two: blocks of (32, 8) threads over 32 columns; thread row j adds chunks j, j + 8, ...; the eight
// row sums are added in order.
extern "C" __global__ void column_totals_bf16(bf16* y, const float* part, u64 chunks, u64 width) {
    __shared__ float lanes[8][33];
    const u64 column = (u64)blockIdx.x * 32 + threadIdx.x;
    float s = 0.0f;
    if (column < width) {
        for (u64 k = threadIdx.y; k < chunks; k += 8) s += part[k * width + column];
    }
    lanes[threadIdx.y][threadIdx.x] = s;
    __syncthreads();
    if (threadIdx.y == 0 && column < width) {
        float total = 0.0f;
        for (int j = 0; j < 8; ++j) total += lanes[j][threadIdx.x];
        y[column] = round_bf16(total);
    }
}

// ---- cross-entropy --------------------------------------------------------------------------------
// `live` local columns are real vocabulary; global column = offset + local column; targets must lie
// in [0, valid) (else the row is flagged) or be IGNORE_INDEX (the row is ignored).

#define IGNORE_INDEX (-100)

// The local column of target `t` if this device holds it, else `width` (also for an ignored target);
// flags row r if t is invalid.
__device__ __forceinline__ u64 target_column(int t, u64 r, u64 offset, u64 valid, u64 width, u64* invalid) {
    if (t == IGNORE_INDEX) return width;
    if (t < 0 || (u64)t >= valid) {
        if (threadIdx.x == 0) flag_invalid(invalid, r);
        return width;
    }
    const u64 column = (u64)t;
    return column >= offset && column - offset < width ? column - offset : width;
}

template <class T>
__device__ void cross_entropy_max_t(float* y, const T* logits, u64 rows, u64 width, u64 live) {
    BLOCK_ROWS(r, rows) {
        float m = NEG_INF;
        ROW_COLUMNS(c, live) m = fmaxf(m, ld(logits, r * width + c));
        m = block_max(m);
        if (threadIdx.x == 0) y[r] = m;
    }
}

extern "C" __global__ void cross_entropy_max(float* y, const float* logits, u64 rows, u64 width, u64 live) {
    cross_entropy_max_t(y, logits, rows, width, live);
}

extern "C" __global__ void cross_entropy_max_bf16(float* y, const bf16* logits, u64 rows, u64 width, u64 live) {
    cross_entropy_max_t(y, logits, rows, width, live);
}

// [rows, 2] (f32): the target logit if local (else 0), and the sum of exp(logit - max) over live columns.
template <class T>
__device__ void cross_entropy_stats_t(float* y, const T* logits, const int* targets, const float* max, u64 rows,
                                      u64 width, u64 live, u64 offset, u64 valid, u64* invalid) {
    BLOCK_ROWS(r, rows) {
        const T* row = logits + r * width;
        const u64 target = target_column(targets[r], r, offset, valid, width, invalid);
        const float m = max[r];
        float s = 0.0f;
        ROW_COLUMNS(c, live) s += expf(ld(row, c) - m);
        s = block_sum(s);
        if (threadIdx.x == 0) {
            y[2 * r] = target < width ? ld(row, target) : 0.0f;
            y[2 * r + 1] = s;
        }
    }
}

extern "C" __global__ void cross_entropy_stats(float* y, const float* logits, const int* targets, const float* max,
                                               u64 rows, u64 width, u64 live, u64 offset, u64 valid, u64* invalid) {
    cross_entropy_stats_t(y, logits, targets, max, rows, width, live, offset, valid, invalid);
}

extern "C" __global__ void cross_entropy_stats_bf16(float* y, const bf16* logits, const int* targets,
                                                    const float* max, u64 rows, u64 width, u64 live, u64 offset,
                                                    u64 valid, u64* invalid) {
    cross_entropy_stats_t(y, logits, targets, max, rows, width, live, offset, valid, invalid);
}

// One number: how many targets are not IGNORE_INDEX. One block.
extern "C" __global__ void cross_entropy_count(float* y, const int* targets, u64 rows) {
    double total = 0.0;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) total += targets[r] != IGNORE_INDEX ? 1.0 : 0.0;
    total = block_sum_f64(total);
    if (threadIdx.x == 0) y[0] = (float)total;
}

// A scalar: the sum over the rows not ignored of (max + ln(sumexp) - target logit), in f64, divided by
// max(count, 1). One block.
extern "C" __global__ void cross_entropy_loss(float* y, const float* max, const float* stats, const int* targets,
                                              const float* count, u64 rows) {
    double total = 0.0;
    for (u64 r = threadIdx.x; r < rows; r += blockDim.x) {
        if (targets[r] != IGNORE_INDEX) {
            total += (double)max[r] + log((double)stats[2 * r + 1]) - (double)stats[2 * r];
        }
    }
    total = block_sum_f64(total);
    if (threadIdx.x == 0) y[0] = (float)(total / fmax((double)count[0], 1.0));
}

// The gradient norm's sum of squares over many tensors in three launches, whatever their number.
// spans[3 t], spans[3 t + 1], spans[3 t + 2] are tensor t's address, length and first block; blocks are
// numbered across the tensors in order, each covering `per_block` elements of one tensor.
// square_sum_spans: block b sums the squares of its elements in f64 into partial[b].
extern "C" __global__ void square_sum_spans(double* partial, const u64* spans, u64 tensors, u64 per_block) {
    const u64 b = blockIdx.x;
    u64 lo = 0, hi = tensors;
    while (hi - lo > 1) {
        const u64 mid = (lo + hi) / 2;
        if (spans[3 * mid + 2] <= b) lo = mid; else hi = mid;
    }
    const float* x = (const float*)spans[3 * lo];
    const u64 n = spans[3 * lo + 1], begin = (b - spans[3 * lo + 2]) * per_block;
    const u64 end = begin + per_block < n ? begin + per_block : n;
    double total = 0.0;
    for (u64 k = begin + threadIdx.x; k < end; k += blockDim.x) total += (double)x[k] * (double)x[k];
    total = block_sum_f64(total);
    if (threadIdx.x == 0) partial[b] = total;
}

// square_sum_tensors: block t adds tensor t's partials (in block order) into total[t].
extern "C" __global__ void square_sum_tensors(double* total, const double* partial, const u64* spans, u64 tensors,
                                              u64 blocks) {
    const u64 t = blockIdx.x;
    const u64 first = spans[3 * t + 2], last = t + 1 < tensors ? spans[3 * (t + 1) + 2] : blocks;
    double sum = 0.0;
    for (u64 k = first + threadIdx.x; k < last; k += blockDim.x) sum += partial[k];
    sum = block_sum_f64(sum);
    if (threadIdx.x == 0) total[t] = sum;
}

// square_sum_fold: y[0] += each tensor's total in tensor order, rounding to f32 after each as the CPU
// adds one gradient at a time (one thread).
extern "C" __global__ void square_sum_fold(float* y, const double* total, u64 tensors) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    float acc = y[0];
    for (u64 t = 0; t < tensors; ++t) acc = (float)((double)acc + total[t]);
    y[0] = acc;
}

// dlogits = (softmax - onehot) dloss / max(count, 1) on live columns, 0 on padding and ignored rows.
template <class T>
__device__ void cross_entropy_grad_t(T* g, const T* logits, const int* targets, const float* max, const float* stats,
                                     const float* dloss, const float* count, u64 rows, u64 width, u64 live, u64 offset,
                                     u64 valid, u64* invalid) {
    const float factor = (float)((double)dloss[0] / fmax((double)count[0], 1.0));
    BLOCK_ROWS(r, rows) {
        const bool ignored = targets[r] == IGNORE_INDEX;
        const u64 target = target_column(targets[r], r, offset, valid, width, invalid);
        const float m = max[r], inv = 1.0f / stats[2 * r + 1];
        ROW_COLUMNS(c, width) {
            const u64 i = r * width + c;
            float v = c < live && !ignored ? expf(ld(logits, i) - m) * inv * factor : 0.0f;
            if (c == target) v -= factor;
            st(g, i, v);
        }
    }
}

extern "C" __global__ void cross_entropy_grad(float* g, const float* logits, const int* targets, const float* max,
                                              const float* stats, const float* dloss, const float* count, u64 rows,
                                              u64 width, u64 live, u64 offset, u64 valid, u64* invalid) {
    cross_entropy_grad_t(g, logits, targets, max, stats, dloss, count, rows, width, live, offset, valid, invalid);
}

extern "C" __global__ void cross_entropy_grad_bf16(bf16* g, const bf16* logits, const int* targets, const float* max,
                                                   const float* stats, const float* dloss, const float* count, u64 rows,
                                                   u64 width, u64 live, u64 offset, u64 valid, u64* invalid) {
    cross_entropy_grad_t(g, logits, targets, max, stats, dloss, count, rows, width, live, offset, valid, invalid);
}

// Eight consecutive 16-bit elements src[e .. e + 8) as one 16-byte word, for a source whose rows need
// not start on a 16-byte boundary: the two aligned words around them are loaded and shifted. `len` is
// the source's element count: where the second word would reach past it, the elements are read one by
// one (the caller guarantees e + 8 <= len).
__device__ __forceinline__ Words16 load8_at(const u16* src, u64 e, u64 len) {
    const u64 address = (u64)(src + e), base = address & ~15ull;
    const u32 o = (u32)(address - base) / 2;
    Words16 out;
    if (o == 0) return *reinterpret_cast<const Words16*>(base);
    if (base + 32 > (u64)(src + len)) {
#pragma unroll
        for (int k = 0; k < 4; ++k) out.w[k] = (u32)src[e + 2 * k] | ((u32)src[e + 2 * k + 1] << 16);
        return out;
    }
    const Words16 a = *reinterpret_cast<const Words16*>(base), b = *reinterpret_cast<const Words16*>(base + 16);
    const u32 w[8] = {a.w[0], a.w[1], a.w[2], a.w[3], b.w[0], b.w[1], b.w[2], b.w[3]};
    u32 s[5];
    switch (o >> 1) {
        case 0: s[0] = w[0]; s[1] = w[1]; s[2] = w[2]; s[3] = w[3]; s[4] = w[4]; break;
        case 1: s[0] = w[1]; s[1] = w[2]; s[2] = w[3]; s[3] = w[4]; s[4] = w[5]; break;
        case 2: s[0] = w[2]; s[1] = w[3]; s[2] = w[4]; s[3] = w[5]; s[4] = w[6]; break;
        default: s[0] = w[3]; s[1] = w[4]; s[2] = w[5]; s[3] = w[6]; s[4] = w[7]; break;
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) out.w[k] = (o & 1) ? (s[k] >> 16) | (s[k + 1] << 16) : s[k];
    return out;
}

// ---- cross-entropy on bf16 logits, eight columns at a time -------------------------------------------
// The max and the sums above with each thread reading eight consecutive logits as one 16-byte word (two,
// shifted, where a row does not start on a word: a vocabulary of 50,257 columns) instead of one at a time,
// which left the GPU's memory half idle. The arithmetic per element is the same; the order of the sums is
// not. (The gradient keeps one element a thread: with eight, each of a warp's stores lands 16 bytes from
// the next lane's, and on an H200 the kernel took 2.0 ms instead of 1.0 ms.)

// Logits c0 .. c0 + 8 of a row as f32 (the caller guarantees c0 + 8 <= the row's width).
__device__ __forceinline__ void logits8(const bf16* logits, u64 e, u64 len, float v[8]) {
    const Words16 w = load8_at(reinterpret_cast<const u16*>(logits), e, len);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w.w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w.w[k] & 0xffff0000u);
    }
}

extern "C" __global__ void cross_entropy_max_bf16x8(float* y, const bf16* logits, u64 rows, u64 width, u64 live) {
    const u64 len = rows * width, words = live / 8;
    BLOCK_ROWS(r, rows) {
        float m = NEG_INF;
        for (u64 t = threadIdx.x; t < words; t += blockDim.x) {
            float v[8];
            logits8(logits, r * width + 8 * t, len, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) m = fmaxf(m, v[k]);
        }
        for (u64 c = 8 * words + threadIdx.x; c < live; c += blockDim.x) m = fmaxf(m, ld(logits, r * width + c));
        m = block_max(m);
        if (threadIdx.x == 0) y[r] = m;
    }
}

extern "C" __global__ void cross_entropy_stats_bf16x8(float* y, const bf16* logits, const int* targets,
                                                      const float* max, u64 rows, u64 width, u64 live, u64 offset,
                                                      u64 valid, u64* invalid) {
    const u64 len = rows * width, words = live / 8;
    BLOCK_ROWS(r, rows) {
        const bf16* row = logits + r * width;
        const u64 target = target_column(targets[r], r, offset, valid, width, invalid);
        const float m = max[r];
        float s = 0.0f;
        for (u64 t = threadIdx.x; t < words; t += blockDim.x) {
            float v[8];
            logits8(logits, r * width + 8 * t, len, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) s += expf(v[k] - m);
        }
        for (u64 c = 8 * words + threadIdx.x; c < live; c += blockDim.x) s += expf(ld(row, c) - m);
        s = block_sum(s);
        if (threadIdx.x == 0) {
            y[2 * r] = target < width ? ld(row, target) : 0.0f;
            y[2 * r + 1] = s;
        }
    }
}

// Rows of 16-bit elements written a 16-byte word a thread, for rows that need not start on a word: the
// row's head (up to seven elements before its first word) and tail go one element a thread, every whole
// word between them one word a thread, so a warp's stores cover 512 consecutive bytes. (Eight stores of
// one element each from a lane put the warp's stores 16 bytes apart and ran at half the speed.)
// `head_of` is the number of elements before the first word of a row starting at `row`, at most `width`.
__device__ __forceinline__ u64 head_of(const void* row, u64 width) {
    const u64 h = ((16 - ((u64)row & 15)) & 15) / 2;
    return h < width ? h : width;
}

// The value of the cross-entropy gradient at column c of a row (as cross_entropy_grad_t computes it).
__device__ __forceinline__ float cross_entropy_grad_at(float x, u64 c, u64 live, bool ignored, u64 target, float m,
                                                       float inv, float factor) {
    float v = c < live && !ignored ? expf(x - m) * inv * factor : 0.0f;
    if (c == target) v -= factor;
    return v;
}

// cross_entropy_grad_bf16 with the gradient written a word a thread; the logits' rows must sit at the same
// place within a word as the gradient's (the host checks), so their words are aligned loads.
extern "C" __global__ void cross_entropy_grad_bf16x8(bf16* g, const bf16* logits, const int* targets, const float* max,
                                                     const float* stats, const float* dloss, const float* count,
                                                     u64 rows, u64 width, u64 live, u64 offset, u64 valid,
                                                     u64* invalid) {
    const float factor = (float)((double)dloss[0] / fmax((double)count[0], 1.0));
    BLOCK_ROWS(r, rows) {
        const bool ignored = targets[r] == IGNORE_INDEX;
        const u64 target = target_column(targets[r], r, offset, valid, width, invalid);
        const float m = max[r], inv = 1.0f / stats[2 * r + 1];
        bf16* out = g + r * width;
        const bf16* in = logits + r * width;
        const u64 head = head_of(out, width), words = (width - head) / 8, tail = head + 8 * words;
        for (u64 c = threadIdx.x; c < head; c += blockDim.x) {
            st(out, c, cross_entropy_grad_at(ld(in, c), c, live, ignored, target, m, inv, factor));
        }
        for (u64 w = threadIdx.x; w < words; w += blockDim.x) {
            const u64 c0 = head + 8 * w;
            float v[8];
            load8(in + head, w, v);
#pragma unroll
            for (int k = 0; k < 8; ++k) v[k] = cross_entropy_grad_at(v[k], c0 + k, live, ignored, target, m, inv, factor);
            store8(out + head, w, v);
        }
        for (u64 c = tail + threadIdx.x; c < width; c += blockDim.x) {
            st(out, c, cross_entropy_grad_at(ld(in, c), c, live, ignored, target, m, inv, factor));
        }
    }
}

// ---- optimizer ------------------------------------------------------------------------------------

// torch.optim.SGD: weight decay added to the gradient, momentum buffer set to the gradient on the first
// step.
extern "C" __global__ void sgd_step(float* p, const float* g, float* buf, u64 n, float lr, float weight_decay,
                                    float momentum, int first_step) {
    GRID_STRIDE(i, n) {
        float d = weight_decay != 0.0f ? g[i] + weight_decay * p[i] : g[i];
        if (momentum != 0.0f) {
            const float b = first_step ? d : momentum * buf[i] + d;
            buf[i] = b;
            d = b;
        }
        p[i] -= lr * d;
    }
}

// torch.lerp: a + w (b - a), computed from the nearer end.
__device__ __forceinline__ float lerp(float a, float b, float w) {
    return fabsf(w) < 0.5f ? a + w * (b - a) : b - (b - a) * (1.0f - w);
}

// torch's single-tensor AdamW with the host's f64 scalars cast to f32 (decay = 1 - lr wd, step_size =
// lr / (1 - beta1^t), bias2_sqrt = sqrt(1 - beta2^t), w1 = 1 - beta1, w2 = 1 - beta2).
struct AdamwScalars {
    float decay, step_size, bias2_sqrt, w1, w2, beta2, eps;
};

// One element's AdamW update from its gradient gi (shared by the one-tensor and the many-tensor launch,
// so both round alike).
__device__ __forceinline__ void adamw_one(float* p, float* m, float* v, u64 i, float gi, const AdamwScalars& k) {
    const float mi = lerp(m[i], gi, k.w1);
    const float vi = v[i] * k.beta2 + k.w2 * gi * gi;
    const float denom = sqrtf(vi) / k.bias2_sqrt + k.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * k.decay + -k.step_size * mi / denom;
}

extern "C" __global__ void adamw_step(float* p, const float* g, float* m, float* v, u64 n, float decay,
                                      float step_size, float bias2_sqrt, float w1, float w2, float beta2, float eps) {
    const AdamwScalars k = {decay, step_size, bias2_sqrt, w1, w2, beta2, eps};
    GRID_STRIDE(i, n) adamw_one(p, m, v, i, g[i], k);
}

// ---- many tensors in one launch ---------------------------------------------------------------------------
//
// A span table lists the tensors, `fields` u64 each: their addresses, their length, then the first block
// of the launch that covers them (blocks are numbered across the tensors in order, each covering
// `per_block` elements of one tensor). Block b finds its tensor by a binary search on the first blocks.

// The index of the tensor that block b covers, and the first and past-the-last element it covers.
__device__ __forceinline__ u64 span_of(const u64* spans, u64 fields, u64 tensors, u64 per_block, u64* begin,
                                       u64* end) {
    const u64 b = blockIdx.x, first = fields - 1, len = fields - 2;
    u64 lo = 0, hi = tensors;
    while (hi - lo > 1) {
        const u64 mid = (lo + hi) / 2;
        if (spans[fields * mid + first] <= b) lo = mid; else hi = mid;
    }
    const u64 n = spans[fields * lo + len];
    *begin = (b - spans[fields * lo + first]) * per_block;
    *end = *begin + per_block < n ? *begin + per_block : n;
    return lo;
}

// AdamW on many parameters: spans of 7 fields (parameter, gradient, first and second moment, the
// gradient's scale as f32 bits in the low half with 1 in bit 32 when it applies, length, first block).
// A scaled gradient is multiplied by its scale, written back (as `scale` would leave it) and used.
extern "C" __global__ void adamw_spans(const u64* spans, u64 tensors, u64 per_block, float decay, float step_size,
                                       float bias2_sqrt, float w1, float w2, float beta2, float eps) {
    u64 begin, end;
    const u64* s = spans + 7 * span_of(spans, 7, tensors, per_block, &begin, &end);
    float *p = (float*)s[0], *g = (float*)s[1], *m = (float*)s[2], *v = (float*)s[3];
    const bool scaled = (s[4] >> 32) != 0;
    const float factor = __uint_as_float((u32)s[4]);
    const AdamwScalars k = {decay, step_size, bias2_sqrt, w1, w2, beta2, eps};
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        float gi = g[i];
        if (scaled) {
            gi = gi * factor;
            g[i] = gi;
        }
        adamw_one(p, m, v, i, gi, k);
    }
}

// Casts from bf16 to f32 of many tensors: spans of 4 fields (source, destination, length, first block).
extern "C" __global__ void cast_bf16_to_f32_spans(const u64* spans, u64 tensors, u64 per_block) {
    u64 begin, end;
    const u64* s = spans + 4 * span_of(spans, 4, tensors, per_block, &begin, &end);
    const bf16* x = (const bf16*)s[0];
    float* y = (float*)s[1];
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) y[i] = widen_bf16(x[i]);
}

// ---- row pitch changes (products on operands whose rows are not 16-byte aligned) -----------------------

// dst[r * dst_ld + c] = src[r * src_ld + c] for every row r < rows and column c < cols; one block per row.
template <class W>
__device__ void copy_rows_t(W* dst, const W* src, u64 rows, u64 cols, u64 src_ld, u64 dst_ld) {
    BLOCK_ROWS(r, rows) {
        ROW_COLUMNS(c, cols) dst[r * dst_ld + c] = src[r * src_ld + c];
    }
}

extern "C" __global__ void copy_rows(u32* dst, const u32* src, u64 rows, u64 cols, u64 src_ld, u64 dst_ld) {
    copy_rows_t(dst, src, rows, cols, src_ld, dst_ld);
}

extern "C" __global__ void copy_rows_u16(u16* dst, const u16* src, u64 rows, u64 cols, u64 src_ld, u64 dst_ld) {
    copy_rows_t(dst, src, rows, cols, src_ld, dst_ld);
}

// copy_rows_u16 with the destination written a word a thread (see head_of) and the source read as two
// aligned words shifted (load8_at; `src_len` is the source's element count): for the copy of a padded
// product's corner back into rows that do not start on a word (a 50,257-column output).
extern "C" __global__ void copy_rows_u16x8(u16* dst, const u16* src, u64 src_len, u64 rows, u64 cols, u64 src_ld,
                                           u64 dst_ld) {
    BLOCK_ROWS(r, rows) {
        u16* out = dst + r * dst_ld;
        const u64 at = r * src_ld;
        const u64 head = head_of(out, cols), words = (cols - head) / 8, tail = head + 8 * words;
        for (u64 c = threadIdx.x; c < head; c += blockDim.x) out[c] = src[at + c];
        for (u64 w = threadIdx.x; w < words; w += blockDim.x) {
            reinterpret_cast<Words16*>(out + head)[w] = load8_at(src, at + head + 8 * w, src_len);
        }
        for (u64 c = tail + threadIdx.x; c < cols; c += blockDim.x) out[c] = src[at + c];
    }
}

// pad_rows_u16 sixteen bytes at a time, for a destination that starts 16-byte aligned with dst_ld a
// multiple of 8 (the host checks): each thread writes one word of the destination.
extern "C" __global__ void pad_rows_u16x8(u16* dst, const u16* src, u64 src_len, u64 rows, u64 cols, u64 src_ld,
                                          u64 dst_rows, u64 dst_ld) {
    const u64 per_row = dst_ld / 8;
    GRID_STRIDE(w, dst_rows * per_row) {
        const u64 r = w / per_row, c0 = (w - r * per_row) * 8;
        Words16 out;
        if (r < rows && c0 + 8 <= cols) {
            out = load8_at(src, r * src_ld + c0, src_len);
        } else {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u64 c = c0 + 2 * k;
                const u32 lo = r < rows && c < cols ? src[r * src_ld + c] : 0u;
                const u32 hi = r < rows && c + 1 < cols ? src[r * src_ld + c + 1] : 0u;
                out.w[k] = lo | (hi << 16);
            }
        }
        reinterpret_cast<Words16*>(dst)[w] = out;
    }
}

// A padded product operand written whole in one pass: dst [dst_rows, dst_ld] holds src's [rows, cols]
// block (rows src_ld apart) in its corner and zeros elsewhere. One block per destination row.
extern "C" __global__ void pad_rows_u16(u16* dst, const u16* src, u64 rows, u64 cols, u64 src_ld, u64 dst_rows,
                                        u64 dst_ld) {
    BLOCK_ROWS(r, dst_rows) {
        ROW_COLUMNS(c, dst_ld) dst[r * dst_ld + c] = r < rows && c < cols ? src[r * src_ld + c] : (u16)0;
    }
}
