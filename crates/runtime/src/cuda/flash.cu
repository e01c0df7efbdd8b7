// Flash attention on bf16 operands, on the tensor cores (mma.sync m16n8k16, Ampere and newer), appended to
// kernels.cu by NVRTC (it uses that file's `bf16`, `u32` and `u64`). The scores never reach device memory:
//
// - `flash_forward_d{64,128}`: one block of 4 warps per 64 query rows of one head; each warp owns 16 rows
//   and walks the key blocks with an online softmax (running max and sum in f32, in the log2 domain), the
//   probabilities rounded to bf16 as the operand of P V, as the cuBLAS path rounds them. Written out: the
//   output (bf16), or, for the backward pass, only each row's log-sum-exp and D = rowsum(dO * O) (f32).
// - `flash_backward_d{64,128}`: one block per 64 keys of one kv head, every query head of its group and
//   every query block in turn; each warp owns 16 keys, keeps dK and dV in registers, recomputes
//   P = exp2(S - lse), forms dS = P (dP - D) and rounds P and dS to bf16 as product operands. dQ is summed
//   over the key blocks by f32 atomics into a scratch that `flash_dq_store` scales and rounds once.
//
// Operand layout: row r of head h of batch b of q starts at q + b*sq*q_row + r*q_row + q_part + h*D (k
// and v likewise with kv_row, k_part, v_part and the kv head h / group); the output and dO have rows of
// o_row elements. The host checks that every row start is 16-byte aligned (cp.async moves 16 bytes).
// Causal attention is aligned at the top left, as on the CPU: query r sees keys 0..=r.
//
// Built for compute_80 and newer; the portable (compute_75) build keeps the entry points as traps, and
// the host never launches them on such a GPU.

#define FLASH_ROWS 64
#define FLASH_THREADS 128
#define FLASH_PAD 8
#define FLASH_INF __int_as_float(0x7f800000)

// The parameters of the entry points (the same on every architecture).
#define FLASH_FORWARD_ARGS                                                                                  \
    const bf16 *q, const bf16 *k, const bf16 *v, bf16 *o, float *lse, float *delta, const bf16 *dout,         \
        u64 q_row, u64 q_part, u64 kv_row, u64 k_part, u64 v_part, u64 o_row, u32 sq, u32 sk, u32 heads, \
        u32 group, int causal, float scale_log2
#define FLASH_BACKWARD_ARGS                                                                                    \
    const bf16 *q, const bf16 *k, const bf16 *v, const bf16 *dout, const float *lse, const float *delta,        \
        float *dq, bf16 *dk, bf16 *dv, u64 q_row, u64 q_part, u64 kv_row, u64 k_part, u64 v_part, u64 o_row, \
        u64 dkv_row, u64 dk_part, u64 dv_part, u32 sq, u32 sk, u32 heads, u32 group, int causal,             \
        float scale_log2, float scale

#if __CUDA_ARCH__ >= 800

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes from global to shared memory, asynchronously; zeros when `valid` is false.
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, bool valid) {
    const int bytes = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Waits until at most `N` of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Four 8x8 bf16 matrices from shared memory (lane l gives row l % 8 of matrix l / 8).
__device__ __forceinline__ void ldsm_x4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// As `ldsm_x4`, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c (16x8, f32) += a (16x16, bf16, row-major fragment) b (16x8, bf16, column fragment).
__device__ __forceinline__ void mma16816(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c[0] and c[1] (two 8-column tiles) += a times the B fragments b[0..1] and b[2..3] (as `frag_b_*` load
// them for two adjacent tiles).
__device__ __forceinline__ void mma_pair(float (*c)[4], const u32* a, const u32* b) {
    mma16816(c[0], a, b[0], b[1]);
    mma16816(c[1], a, b[2], b[3]);
}

// Two f32 rounded to nearest-even bf16 and packed, `lo` in the low half (the lower column).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float bf16_lo(u32 x) { return __uint_as_float(x << 16); }
__device__ __forceinline__ float bf16_hi(u32 x) { return __uint_as_float(x & 0xffff0000u); }

// Starts copying rows [row0, row0 + FLASH_ROWS) of a [rows, D] slice whose rows are `stride` elements
// apart into shared rows of D + FLASH_PAD elements; rows past `rows` become zeros.
template <int D>
__device__ __forceinline__ void flash_load(bf16* tile, const bf16* g, u64 stride, u32 row0, u32 rows) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < FLASH_ROWS * CHUNKS; i += FLASH_THREADS) {
        const int r = i / CHUNKS, c = i % CHUNKS;
        const bool valid = row0 + r < rows;
        const bf16* src = valid ? g + (u64)(row0 + r) * stride + c * 8 : g;
        cp_async16(smem_addr(tile + r * (D + FLASH_PAD) + c * 8), src, valid);
    }
}

// The A fragments (16 rows from `row0`, 16 columns from `col0`) of a row-major shared tile.
__device__ __forceinline__ void frag_a(const bf16* tile, int ld, int row0, int col0, u32* a) {
    const int lane = threadIdx.x % 32;
    ldsm_x4(smem_addr(tile + (row0 + lane % 16) * ld + col0 + (lane / 16) * 8), a);
}

// The B fragments of two 8-column tiles (n0 and n0 + 8) over 16 k from `k0`, for a tile stored with its
// n index along rows (b[0], b[1] for n0; b[2], b[3] for n0 + 8): K for Q K^T, Q or dO for K Q^T.
__device__ __forceinline__ void frag_b_rows(const bf16* tile, int ld, int n0, int k0, u32* b) {
    const int lane = threadIdx.x % 32;
    ldsm_x4(smem_addr(tile + (n0 + lane % 8 + (lane / 16) * 8) * ld + k0 + ((lane / 8) % 2) * 8), b);
}

// The B fragments of two 8-column tiles (n0, n0 + 8) over 16 k from `k0`, for a tile stored with its k
// index along rows: V for P V, dO for P^T dO, Q for dS^T Q, K for dS K.
__device__ __forceinline__ void frag_b_cols(const bf16* tile, int ld, int k0, int n0, u32* b) {
    const int lane = threadIdx.x % 32;
    ldsm_x4_t(smem_addr(tile + (k0 + lane % 8 + ((lane / 8) % 2) * 8) * ld + n0 + (lane / 16) * 8), b);
}

// The A fragments (16 rows from `m0`, 16 k from `k0`) of the transpose of a shared tile stored with its
// k index along rows: dS from the stored dS^T.
__device__ __forceinline__ void frag_a_transposed(const bf16* tile, int ld, int m0, int k0, u32* a) {
    const int lane = threadIdx.x % 32;
    ldsm_x4_t(smem_addr(tile + (k0 + lane % 8 + (lane / 16) * 8) * ld + m0 + ((lane / 8) % 2) * 8), a);
}

// The A fragment of a 16x16 slice (columns 16 kk..) of a 16-row accumulator held as 8-column C tiles.
__device__ __forceinline__ void c_to_a(const float (*c)[4], int kk, u32* a) {
    a[0] = pack_bf16x2(c[2 * kk][0], c[2 * kk][1]);
    a[1] = pack_bf16x2(c[2 * kk][2], c[2 * kk][3]);
    a[2] = pack_bf16x2(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[3] = pack_bf16x2(c[2 * kk + 1][2], c[2 * kk + 1][3]);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

template <int D>
__device__ void flash_forward_t(const bf16* q, const bf16* k, const bf16* v, bf16* o, float* lse, float* delta,
                                const bf16* dout, u64 q_row, u64 q_part, u64 kv_row, u64 k_part, u64 v_part,
                                u64 o_row, u32 sq, u32 sk, u32 heads, u32 group, int causal, float scale_log2) {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    constexpr int LD = D + FLASH_PAD;
    bf16* sq_tile = (bf16*)flash_smem;
    bf16* sk_tile = sq_tile + FLASH_ROWS * LD;
    bf16* sv_tile = sk_tile + FLASH_ROWS * LD;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 qb = blockIdx.x, h = blockIdx.y, b = blockIdx.z, hk = h / group;
    const u32 q0 = qb * FLASH_ROWS;
    const bf16* qh = q + (u64)b * sq * q_row + q_part + (u64)h * D;
    const bf16* kh = k + (u64)b * sk * kv_row + k_part + (u64)hk * D;
    const bf16* vh = v + (u64)b * sk * kv_row + v_part + (u64)hk * D;

    flash_load<D>(sq_tile, qh, q_row, q0, sq);
    flash_load<D>(sk_tile, kh, kv_row, 0, sk);
    cp_async_commit();
    u32 kblocks = (sk + FLASH_ROWS - 1) / FLASH_ROWS;
    if (causal && qb + 1 < kblocks) kblocks = qb + 1;

    const u32 row[2] = {q0 + warp * 16 + g, q0 + warp * 16 + g + 8};
    float acc[D / 8][4];
    for (int n = 0; n < D / 8; ++n)
        for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
    float m[2] = {-FLASH_INF, -FLASH_INF}, l[2] = {0.0f, 0.0f};
    u32 qf[D / 16][4];

    for (u32 j = 0; j < kblocks; ++j) {
        flash_load<D>(sv_tile, vh, kv_row, j * FLASH_ROWS, sk);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        if (j == 0) {
            for (int kk = 0; kk < D / 16; ++kk) frag_a(sq_tile, LD, warp * 16, kk * 16, qf[kk]);
        }
        float s[8][4];
        for (int n = 0; n < 8; ++n)
            for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
        for (int kk = 0; kk < D / 16; ++kk) {
            for (int p = 0; p < 4; ++p) {
                u32 bf[4];
                frag_b_rows(sk_tile, LD, p * 16, kk * 16, bf);
                mma_pair(&s[2 * p], qf[kk], bf);
            }
        }
        __syncthreads();
        if (j + 1 < kblocks) flash_load<D>(sk_tile, kh, kv_row, (j + 1) * FLASH_ROWS, sk);
        cp_async_commit();

        const u32 k0 = j * FLASH_ROWS;
        float mx[2] = {m[0], m[1]};
        for (int n = 0; n < 8; ++n) {
            for (int e = 0; e < 4; ++e) {
                const u32 col = k0 + n * 8 + 2 * t + (e & 1);
                const bool live = col < sk && (!causal || col <= row[e / 2]);
                s[n][e] = live ? s[n][e] * scale_log2 : -FLASH_INF;
                mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
            }
        }
        float base[2];
        for (int i = 0; i < 2; ++i) {
            mx[i] = quad_max(mx[i]);
            base[i] = mx[i] == -FLASH_INF ? 0.0f : mx[i];
            const float corr = exp2f(m[i] - base[i]);
            m[i] = mx[i];
            l[i] *= corr;
            for (int n = 0; n < D / 8; ++n) {
                acc[n][2 * i] *= corr;
                acc[n][2 * i + 1] *= corr;
            }
        }
        for (int n = 0; n < 8; ++n) {
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(s[n][e] - base[e / 2]);
                s[n][e] = p;
                l[e / 2] += p;
            }
        }
        cp_async_wait<1>();
        __syncthreads();
        for (int kk = 0; kk < 4; ++kk) {
            u32 a[4];
            c_to_a(s, kk, a);
            for (int p = 0; p < D / 16; ++p) {
                u32 bf[4];
                frag_b_cols(sv_tile, LD, kk * 16, p * 16, bf);
                mma_pair(&acc[2 * p], a, bf);
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();

    float inv[2];
    for (int i = 0; i < 2; ++i) {
        l[i] = quad_sum(l[i]);
        inv[i] = l[i] > 0.0f ? 1.0f / l[i] : 0.0f;
    }
    if (delta == 0) {
        for (int i = 0; i < 2; ++i) {
            if (row[i] >= sq) continue;
            bf16* out = o + ((u64)b * sq + row[i]) * o_row + (u64)h * D;
            for (int n = 0; n < D / 8; ++n) {
                const u32 pair = pack_bf16x2(acc[n][2 * i] * inv[i], acc[n][2 * i + 1] * inv[i]);
                *(u32*)(out + n * 8 + 2 * t) = pair;
            }
        }
        return;
    }
    for (int i = 0; i < 2; ++i) {
        float dot = 0.0f;
        if (row[i] < sq) {
            const bf16* dy = dout + ((u64)b * sq + row[i]) * o_row + (u64)h * D;
            for (int n = 0; n < D / 8; ++n) {
                const u32 pair = *(const u32*)(dy + n * 8 + 2 * t);
                dot += bf16_lo(pair) * acc[n][2 * i] * inv[i] + bf16_hi(pair) * acc[n][2 * i + 1] * inv[i];
            }
        }
        dot = quad_sum(dot);
        if (t == 0 && row[i] < sq) {
            const u64 at = ((u64)b * heads + h) * sq + row[i];
            lse[at] = l[i] > 0.0f ? m[i] + log2f(l[i]) : FLASH_INF;
            delta[at] = dot;
        }
    }
}

// 4 bytes from global to shared memory, asynchronously; zeros when `valid` is false.
__device__ __forceinline__ void cp_async4(u32 dst, const void* src, bool valid) {
    const int bytes = valid ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

// The shared buffers of one query block of the backward pass: its Q and dO tiles, and each row's
// log-sum-exp and D.
struct FlashQueryTiles {
    bf16* q;
    bf16* dout;
    float* lse;
    float* delta;
};

// Starts copying query block q0 of head h of batch b into `tiles`: Q and dO rows (zeros past sq), and the
// rows' log-sum-exp and D (zeros past sq, where every score is masked).
template <int D>
__device__ __forceinline__ void flash_query_load(const FlashQueryTiles& tiles, const bf16* q, const bf16* dout,
                                                 const float* lse, const float* delta, u64 q_row, u64 q_part,
                                                 u64 o_row, u32 b, u32 h, u32 sq, u32 heads, u32 q0) {
    flash_load<D>(tiles.q, q + (u64)b * sq * q_row + q_part + (u64)h * D, q_row, q0, sq);
    flash_load<D>(tiles.dout, dout + (u64)b * sq * o_row + (u64)h * D, o_row, q0, sq);
    if (threadIdx.x < FLASH_ROWS) {
        const u32 at = q0 + threadIdx.x;
        const bool valid = at < sq;
        const u64 row = ((u64)b * heads + h) * sq + (valid ? at : 0);
        cp_async4(smem_addr(tiles.lse + threadIdx.x), lse + row, valid);
        cp_async4(smem_addr(tiles.delta + threadIdx.x), delta + row, valid);
    }
}

// STAGES query buffers: with 2, the next query block's tiles load while this one's products run (the
// 64-wide kernel: 64 KiB of shared memory); with 1, each block loads, then computes (the 128-wide one,
// which two buffers would take past the 99 KiB some Ampere GPUs allow a block).
template <int D, int STAGES>
__device__ void flash_backward_t(const bf16* q, const bf16* k, const bf16* v, const bf16* dout, const float* lse,
                                 const float* delta, float* dq, bf16* dk, bf16* dv, u64 q_row, u64 q_part,
                                 u64 kv_row, u64 k_part, u64 v_part, u64 o_row, u64 dkv_row, u64 dk_part,
                                 u64 dv_part, u32 sq, u32 sk, u32 heads, u32 group, int causal, float scale_log2,
                                 float scale) {
    extern __shared__ __align__(16) unsigned char flash_smem[];
    constexpr int LD = D + FLASH_PAD;
    constexpr int LDS = FLASH_ROWS + FLASH_PAD;
    bf16* sk_tile = (bf16*)flash_smem;
    bf16* sv_tile = sk_tile + FLASH_ROWS * LD;
    bf16* query_tiles = sv_tile + FLASH_ROWS * LD;
    bf16* sds = query_tiles + 2 * STAGES * FLASH_ROWS * LD;
    float* stats_rows = (float*)(sds + FLASH_ROWS * LDS);
    FlashQueryTiles buffers[STAGES];
    for (int s = 0; s < STAGES; ++s) {
        buffers[s].q = query_tiles + 2 * s * FLASH_ROWS * LD;
        buffers[s].dout = buffers[s].q + FLASH_ROWS * LD;
        buffers[s].lse = stats_rows + 2 * s * FLASH_ROWS;
        buffers[s].delta = buffers[s].lse + FLASH_ROWS;
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const u32 kb = blockIdx.x, hk = blockIdx.y, b = blockIdx.z;
    const u32 k0 = kb * FLASH_ROWS;
    const bf16* kh = k + (u64)b * sk * kv_row + k_part + (u64)hk * D;
    const bf16* vh = v + (u64)b * sk * kv_row + v_part + (u64)hk * D;
    flash_load<D>(sk_tile, kh, kv_row, k0, sk);
    flash_load<D>(sv_tile, vh, kv_row, k0, sk);

    const u32 key[2] = {k0 + warp * 16 + g, k0 + warp * 16 + g + 8};
    float acc_dk[D / 8][4], acc_dv[D / 8][4];
    for (int n = 0; n < D / 8; ++n)
        for (int e = 0; e < 4; ++e) acc_dk[n][e] = acc_dv[n][e] = 0.0f;
    const u32 qblocks = (sq + FLASH_ROWS - 1) / FLASH_ROWS;
    const u32 first = causal ? kb : 0;
    // Every (query head of the group, query block) pair in turn.
    const u32 per_head = qblocks > first ? qblocks - first : 0, pairs = group * per_head;
    if (pairs > 0) {
        flash_query_load<D>(buffers[0], q, dout, lse, delta, q_row, q_part, o_row, b, hk * group, sq, heads,
                            first * FLASH_ROWS);
    }
    cp_async_commit();

    for (u32 pair = 0; pair < pairs; ++pair) {
        const u32 r = pair / per_head, i = first + pair % per_head;
        const u32 h = hk * group + r;
        const u32 q0 = i * FLASH_ROWS;
        const FlashQueryTiles& cur = buffers[STAGES == 2 ? (pair & 1) : 0];
        if (STAGES == 2) {
            if (pair + 1 < pairs) {
                const u32 next_h = hk * group + (pair + 1) / per_head, next_i = first + (pair + 1) % per_head;
                flash_query_load<D>(buffers[(pair + 1) & 1], q, dout, lse, delta, q_row, q_part, o_row, b, next_h,
                                    sq, heads, next_i * FLASH_ROWS);
            }
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            if (pair > 0) {
                flash_query_load<D>(cur, q, dout, lse, delta, q_row, q_part, o_row, b, h, sq, heads, q0);
                cp_async_commit();
            }
            cp_async_wait<0>();
        }
        __syncthreads();
        {
            bf16* sq_tile = cur.q;
            bf16* so_tile = cur.dout;
            const float* s_lse = cur.lse;
            const float* s_delta = cur.delta;

            // S^T = K Q^T and dP^T = V dO^T: 16 keys of this warp by the 64 queries.
            float s[8][4], dp[8][4];
            for (int n = 0; n < 8; ++n)
                for (int e = 0; e < 4; ++e) s[n][e] = dp[n][e] = 0.0f;
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 ak[4], av[4];
                frag_a(sk_tile, LD, warp * 16, kk * 16, ak);
                frag_a(sv_tile, LD, warp * 16, kk * 16, av);
                for (int p = 0; p < 4; ++p) {
                    u32 bf[4];
                    frag_b_rows(sq_tile, LD, p * 16, kk * 16, bf);
                    mma_pair(&s[2 * p], ak, bf);
                    frag_b_rows(so_tile, LD, p * 16, kk * 16, bf);
                    mma_pair(&dp[2 * p], av, bf);
                }
            }
            // P^T = exp2(S^T - lse) where the key is seen, dS^T = P^T (dP^T - D).
            for (int n = 0; n < 8; ++n) {
                for (int e = 0; e < 4; ++e) {
                    const int c = n * 8 + 2 * t + (e & 1);
                    const u32 query = q0 + c, kr = key[e / 2];
                    const bool live = kr < sk && query < sq && (!causal || kr <= query);
                    const float p = live ? exp2f(s[n][e] * scale_log2 - s_lse[c]) : 0.0f;
                    s[n][e] = p;
                    dp[n][e] = p * (dp[n][e] - s_delta[c]);
                }
            }
            // dV += P^T dO, dK += dS^T Q.
            for (int kk = 0; kk < 4; ++kk) {
                u32 ap[4], ads[4];
                c_to_a(s, kk, ap);
                c_to_a(dp, kk, ads);
                for (int p = 0; p < D / 16; ++p) {
                    u32 bf[4];
                    frag_b_cols(so_tile, LD, kk * 16, p * 16, bf);
                    mma_pair(&acc_dv[2 * p], ap, bf);
                    frag_b_cols(sq_tile, LD, kk * 16, p * 16, bf);
                    mma_pair(&acc_dk[2 * p], ads, bf);
                }
            }
            // dS^T to shared memory, then dQ (16 queries of this warp) += dS K over the block's keys (the
            // condition is the same in every thread, so the barrier inside is reached by all or none).
            if (dq != 0) {
                for (int n = 0; n < 8; ++n) {
                    const int c = n * 8 + 2 * t;
                    *(u32*)(sds + (warp * 16 + g) * LDS + c) = pack_bf16x2(dp[n][0], dp[n][1]);
                    *(u32*)(sds + (warp * 16 + g + 8) * LDS + c) = pack_bf16x2(dp[n][2], dp[n][3]);
                }
                __syncthreads();
                float acc_dq[D / 8][4];
                for (int n = 0; n < D / 8; ++n)
                    for (int e = 0; e < 4; ++e) acc_dq[n][e] = 0.0f;
                for (int kk = 0; kk < 4; ++kk) {
                    u32 a[4];
                    frag_a_transposed(sds, LDS, warp * 16, kk * 16, a);
                    for (int p = 0; p < D / 16; ++p) {
                        u32 bf[4];
                        frag_b_cols(sk_tile, LD, kk * 16, p * 16, bf);
                        mma_pair(&acc_dq[2 * p], a, bf);
                    }
                }
                for (int i = 0; i < 2; ++i) {
                    const u32 query = q0 + warp * 16 + g + 8 * i;
                    if (query >= sq) continue;
                    float* at = dq + (((u64)b * sq + query) * heads + h) * D + 2 * t;
                    for (int n = 0; n < D / 8; ++n) {
                        atomicAdd(at + n * 8, acc_dq[n][2 * i]);
                        atomicAdd(at + n * 8 + 1, acc_dq[n][2 * i + 1]);
                    }
                }
            }
        }
        __syncthreads();
    }
    cp_async_wait<0>();
    for (int i = 0; i < 2; ++i) {
        if (key[i] >= sk) continue;
        const u64 at = ((u64)b * sk + key[i]) * dkv_row + (u64)hk * D + 2 * t;
        for (int n = 0; n < D / 8; ++n) {
            if (dk != 0) {
                *(u32*)(dk + at + dk_part + n * 8) =
                    pack_bf16x2(acc_dk[n][2 * i] * scale, acc_dk[n][2 * i + 1] * scale);
            }
            if (dv != 0) *(u32*)(dv + at + dv_part + n * 8) = pack_bf16x2(acc_dv[n][2 * i], acc_dv[n][2 * i + 1]);
        }
    }
}

#define FLASH_FORWARD_CALL \
    q, k, v, o, lse, delta, dout, q_row, q_part, kv_row, k_part, v_part, o_row, sq, sk, heads, group, causal, scale_log2
#define FLASH_BACKWARD_CALL                                                                                     \
    q, k, v, dout, lse, delta, dq, dk, dv, q_row, q_part, kv_row, k_part, v_part, o_row, dkv_row, dk_part, dv_part, \
        sq, sk, heads, group, causal, scale_log2, scale

extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_forward_d64(FLASH_FORWARD_ARGS) {
    flash_forward_t<64>(FLASH_FORWARD_CALL);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_forward_d128(FLASH_FORWARD_ARGS) {
    flash_forward_t<128>(FLASH_FORWARD_CALL);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_backward_d64(FLASH_BACKWARD_ARGS) {
    flash_backward_t<64, 2>(FLASH_BACKWARD_CALL);
}
extern "C" __global__ void __launch_bounds__(FLASH_THREADS) flash_backward_d128(FLASH_BACKWARD_ARGS) {
    flash_backward_t<128, 1>(FLASH_BACKWARD_CALL);
}

#else

// Before Ampere there are no bf16 tensor-core instructions: the host never launches these.
extern "C" __global__ void flash_forward_d64(FLASH_FORWARD_ARGS) { __trap(); }
extern "C" __global__ void flash_forward_d128(FLASH_FORWARD_ARGS) { __trap(); }
extern "C" __global__ void flash_backward_d64(FLASH_BACKWARD_ARGS) { __trap(); }
extern "C" __global__ void flash_backward_d128(FLASH_BACKWARD_ARGS) { __trap(); }

#endif

// dQ from its f32 sum: out[b, r, q_part + h * d + c] = round(scale * dq[b, r, h, c]), for the rows of q.
extern "C" __global__ void flash_dq_store(bf16* out, const float* dq, u64 rows, u64 heads, u64 d, u64 q_row,
                                          u64 q_part, float scale) {
    const u64 width = heads * d;
    GRID_STRIDE(i, rows * width) {
        const u64 r = i / width, c = i % width;
        out[r * q_row + q_part + c] = round_bf16(dq[i] * scale);
    }
}
