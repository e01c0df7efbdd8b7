
// ---- collectives on device pointers ---------------------------------------------------------------
//
// The kernels of collectives between mesh devices that share one GPU (one process, a stream each): a
// member reads its peers' buffers in place, through the pointers they shared, and writes only its own
// result. Reductions are taken in f32 in member order and stored once (rounded once into bf16), exactly
// as the host communicators combine (runtime/comm.rs), so a mesh on one GPU gives the threads' results
// bit for bit. The same kernels pack and unpack the member-major blocks that NCCL exchanges.

#define MAX_MEMBERS 64

// The buffers of a group's members, in member order (passed by value).
struct Members {
    u64 ptr[MAX_MEMBERS];
};

// Where element e of one member's block lies in the gathered tensor: e = (t, r) with r < run, and
// t = (b, o) with o < outer; the element is at b stride_b + o stride_o + start + r.
struct Runs {
    u64 run;
    u64 outer;
    u64 stride_b;
    u64 stride_o;
    u64 start;
};

__device__ __forceinline__ u64 run_offset(const Runs& g, u64 e) {
    const u64 r = e % g.run, t = e / g.run;
    return (t / g.outer) * g.stride_b + (t % g.outer) * g.stride_o + g.start + r;
}

// Element i of an f32 (is_bf16 = 0) or bf16 buffer at p, as f32; and the store of an f32 into one.
__device__ __forceinline__ float ld_any(u64 p, u64 i, u32 is_bf16) {
    return is_bf16 ? widen_bf16(((const bf16*)p)[i]) : ((const float*)p)[i];
}

__device__ __forceinline__ void st_any(u64 p, u64 i, float v, u32 is_bf16) {
    if (is_bf16) {
        ((bf16*)p)[i] = round_bf16(v);
    } else {
        ((float*)p)[i] = v;
    }
}

// dst[j] = src[i]: the bits as they are when both have one element type, converted otherwise.
__device__ __forceinline__ void move_any(u64 dst, u64 j, u32 dst_bf16, u64 src, u64 i, u32 src_bf16) {
    if (src_bf16 == dst_bf16) {
        if (src_bf16) {
            ((u16*)dst)[j] = ((const u16*)src)[i];
        } else {
            ((u32*)dst)[j] = ((const u32*)src)[i];
        }
    } else {
        st_any(dst, j, ld_any(src, i, src_bf16), dst_bf16);
    }
}

// out[e] = the sum (op_max = 0) or maximum of element run_offset(g, e) of every member, for e < n,
// in f32 from member 0 on, stored once.
extern "C" __global__ void reduce_members(Members m, u32 count, u32 in_bf16, u32 out_bf16, u32 op_max, Runs g,
                                          u64 out, u64 n) {
    GRID_STRIDE(e, n) {
        const u64 at = run_offset(g, e);
        float acc = ld_any(m.ptr[0], at, in_bf16);
        for (u32 k = 1; k < count; ++k) {
            const float v = ld_any(m.ptr[k], at, in_bf16);
            acc = op_max ? fmaxf(acc, v) : acc + v;
        }
        st_any(out, e, acc, out_bf16);
    }
}

// Member k's block of n elements into its runs of the gathered tensor at out: element e goes to
// run_offset(g, e) + k member_stride.
extern "C" __global__ void gather_members(Members m, u32 count, u32 in_bf16, u32 out_bf16, Runs g,
                                          u64 member_stride, u64 out, u64 n) {
    GRID_STRIDE(i, n * count) {
        const u64 k = i / n, e = i % n;
        move_any(out, run_offset(g, e) + k * member_stride, out_bf16, m.ptr[k], e, in_bf16);
    }
}

// The inverse, from one tensor: member k's runs of `full` into block k of `out` (member-major, n
// elements a block), as NCCL's reduce-scatter takes them.
extern "C" __global__ void pack_members(u64 full, u32 is_bf16, Runs g, u64 member_stride, u64 out, u64 n,
                                        u32 count) {
    GRID_STRIDE(i, n * count) {
        const u64 k = i / n, e = i % n;
        move_any(out, i, is_bf16, full, run_offset(g, e) + k * member_stride, is_bf16);
    }
}
