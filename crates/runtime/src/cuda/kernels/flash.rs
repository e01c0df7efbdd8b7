//! Flash attention on bf16 buffers (the kernels of `flash.cu`): attention and its gradients without the
//! score matrix in device memory, on the tensor cores of Ampere and newer GPUs.
//!
//! The forward pass is one launch. The backward pass (its 64-wide kernel loading the next query block
//! while the current one computes) is three: the forward kernel again, writing only
//! each query row's log-sum-exp and D = rowsum(dO * O) (the plan's `AttentionGrad` receives neither),
//! the backward kernel (dK and dV in place, dQ summed in an f32 scratch), and the rounding of dQ.
//! A non-fused attention (separate q, k and v: Llama) has three `AttentionGrad`s, one per operand, that
//! the plan issues back to back with the same inputs: the first computes all three gradients and keeps
//! the other two (see [`Kept`]), so the backward pass runs once a layer instead of three times.
//! Head sizes 64 and 128 run here; other sizes, pre-Ampere GPUs, operands whose rows are not 16-byte
//! aligned and `OPTIMUS_CUDA_ATTENTION=reference` take the cuBLAS path of [`super::bf16`], which
//! materialises the scores in f32.

use super::*;
use cudarc::driver::DevicePtr;
use cudarc::driver::sys::CUfunction_attribute;

pub(super) const FORWARD_D64: &str = "flash_forward_d64";
pub(super) const FORWARD_D128: &str = "flash_forward_d128";
pub(super) const BACKWARD_D64: &str = "flash_backward_d64";
pub(super) const BACKWARD_D128: &str = "flash_backward_d128";
pub(super) const DQ_STORE: &str = "flash_dq_store";

/// Every `__global__` function of flash.cu.
pub const FLASH_KERNEL_NAMES: &[&str] = &[FORWARD_D64, FORWARD_D128, BACKWARD_D64, BACKWARD_D128, DQ_STORE];

/// Query rows of a forward block, keys of a backward block (flash.cu's `FLASH_ROWS`).
const ROWS: usize = 64;
/// Threads of a block (flash.cu's `FLASH_THREADS`).
const THREADS: u32 = 128;
/// Padding of each shared row, in bf16 elements (flash.cu's `FLASH_PAD`).
const PAD: usize = 8;

/// Dynamic shared memory of a forward block: the Q, K and V tiles.
fn forward_smem(d: usize) -> usize {
    3 * ROWS * (d + PAD) * 2
}

/// Query buffers of a backward block (flash.cu's `STAGES`): two for the 64-wide kernel, whose next
/// query block loads while the current one computes; one for the 128-wide one.
fn backward_stages(d: usize) -> usize {
    if d == 64 { 2 } else { 1 }
}

/// Dynamic shared memory of a backward block: K and V tiles, Q and dO tiles and two f32 rows per query
/// buffer, and dS^T.
fn backward_smem(d: usize) -> usize {
    let stages = backward_stages(d);
    (2 + 2 * stages) * ROWS * (d + PAD) * 2 + ROWS * (ROWS + PAD) * 2 + 2 * stages * ROWS * 4
}

/// The head sizes the kernels are built for.
const HEAD_SIZES: [usize; 2] = [64, 128];

/// The architecture a PTX module targets (`.target sm_90` gives 90), if it says.
pub(super) fn ptx_target(ptx: &str) -> Option<u32> {
    let target = ptx.lines().find_map(|line| line.trim().strip_prefix(".target sm_"))?;
    target.chars().take_while(char::is_ascii_digit).collect::<String>().parse().ok()
}

/// Whether the flash kernels may run: the PTX was built for compute capability 8.0 or newer (older
/// builds hold them as traps), and `OPTIMUS_CUDA_ATTENTION=reference` does not turn them off. Raises
/// the kernels' dynamic shared-memory limit; a GPU that refuses it keeps the cuBLAS path.
pub(super) fn enable(functions: &HashMap<&'static str, CudaFunction>, ptx_arch: Option<u32>) -> bool {
    if ptx_arch.is_none_or(|arch| arch < 80) || std::env::var("OPTIMUS_CUDA_ATTENTION").is_ok_and(|v| v == "reference")
    {
        return false;
    }
    let limits = [(FORWARD_D64, 64), (FORWARD_D128, 128), (BACKWARD_D64, 64), (BACKWARD_D128, 128)];
    limits.iter().all(|&(name, d)| {
        let bytes = if name.starts_with("flash_forward") { forward_smem(d) } else { backward_smem(d) };
        let attribute = CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
        functions.get(name).is_some_and(|f| i32::try_from(bytes).is_ok_and(|b| f.set_attribute(attribute, b).is_ok()))
    })
}

/// The f32 scratch of the backward pass (grown as needed), and the gradients kept for the next
/// `AttentionGrad`s of a non-fused attention.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    lse: Option<CudaSlice<f32>>,
    delta: Option<CudaSlice<f32>>,
    dq: Option<CudaSlice<f32>>,
    kept: Kept,
}

/// The gradients of a non-fused attention computed at the first of its three `AttentionGrad`s: dQ as
/// its f32 sum (in [`Scratch::dq`]), dK and dV in bf16 buffers of the operands' layout. They serve the
/// next `AttentionGrad`s with the same operands (the same device pointers and geometry) and nothing
/// in between: [`Scratch::forget`] runs before any other kernel or transfer, so no write can come
/// between the computation and its use, and each gradient is served once.
/// The device pointers of q, k, v and dy and every number of an attention's geometry.
type KeptKey = [u64; 19];

#[derive(Debug, Default)]
pub(super) struct Kept {
    /// The operands' pointers and geometry the gradients belong to.
    key: KeptKey,
    /// Which of dQ, dK, dV are kept and not yet served.
    pending: [bool; 3],
    dk: Option<CudaSlice<u16>>,
    dv: Option<CudaSlice<u16>>,
}

impl Scratch {
    /// Drops the kept gradients (their buffers stay for the next layer).
    pub(super) fn forget(&mut self) {
        self.kept.pending = [false; 3];
    }
}

/// The geometry of one attention, as the kernels take it (element counts and strides).
#[derive(Clone, Copy, Debug)]
struct Geometry {
    batch: u32,
    heads: u32,
    kv_heads: u32,
    d: usize,
    sq: u32,
    sk: u32,
    q_row: u64,
    q_part: u64,
    kv_row: u64,
    k_part: u64,
    v_part: u64,
    o_row: u64,
    causal: i32,
    /// Query heads per kv head.
    group: u32,
    /// 1 / sqrt(d).
    scale: f32,
    /// The scale of the scores in the log2 domain the kernels work in.
    scale_log2: f32,
}

impl Geometry {
    /// The geometry of `qkv`, if the kernels can run it: a head size they are built for, non-empty
    /// sequences, k and v rows of one width, every row start 16-byte aligned, and a grid the GPU takes.
    fn of(qkv: &Qkv<u16>, causal: bool, stream: &CudaStream) -> Option<Geometry> {
        let [q, k, v] = qkv.packing;
        let aligned = |x: usize| x.is_multiple_of(8);
        let pointers_aligned = qkv.data.iter().all(|s| s.device_ptr(stream).0.is_multiple_of(16));
        let fits = HEAD_SIZES.contains(&qkv.d)
            && q.seq > 0
            && k.seq > 0
            && k.row == v.row
            && [q.row, q.part, k.row, k.part, v.part].into_iter().all(aligned)
            && pointers_aligned
            && qkv.batch <= 65_535
            && qkv.heads <= 65_535;
        let small = |x: usize| u32::try_from(x).ok();
        fits.then_some(())?;
        Some(Geometry {
            batch: small(qkv.batch)?,
            heads: small(qkv.heads)?,
            kv_heads: small(qkv.kv_heads)?,
            d: qkv.d,
            sq: small(q.seq)?,
            sk: small(k.seq)?,
            q_row: q.row as u64,
            q_part: q.part as u64,
            kv_row: k.row as u64,
            k_part: k.part as u64,
            v_part: v.part as u64,
            o_row: qkv.out_packing().row as u64,
            causal: i32::from(causal),
            group: small(qkv.group())?,
            scale: qkv.scale(),
            scale_log2: qkv.scale() * std::f32::consts::LOG2_E,
        })
    }

    /// What identifies a non-fused attention's gradients: the operands' and dy's device pointers and
    /// every number of the geometry.
    fn key(&self, [q, k, v, dy]: [u64; 4]) -> KeptKey {
        let [batch, heads, kv_heads, sq, sk, group] =
            [self.batch, self.heads, self.kv_heads, self.sq, self.sk, self.group].map(u64::from);
        let (causal, scale) = (self.causal as u64, u64::from(self.scale.to_bits()));
        let (d, rows) = (self.d as u64, [self.q_row, self.q_part, self.kv_row, self.k_part, self.v_part, self.o_row]);
        let [q_row, q_part, kv_row, k_part, v_part, o_row] = rows;
        [
            q, k, v, dy, batch, heads, kv_heads, sq, sk, group, d, q_row, q_part, kv_row, k_part, v_part, o_row,
            causal, scale,
        ]
    }

    /// Elements of the gradient of k (or v) of a non-fused attention: [batch, sk, kv_row].
    fn kv_grad_len(&self) -> usize {
        self.batch as usize * self.sk as usize * self.kv_row as usize
    }

    /// Query rows (one log-sum-exp and one D each).
    fn rows(&self) -> usize {
        self.batch as usize * self.heads as usize * self.sq as usize
    }

    fn blocks(n: u32) -> u32 {
        n.div_ceil(ROWS as u32)
    }

    fn forward_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (Geometry::blocks(self.sq), self.heads, self.batch),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: forward_smem(self.d) as u32,
        }
    }

    fn backward_config(&self) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (Geometry::blocks(self.sk), self.kv_heads, self.batch),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: backward_smem(self.d) as u32,
        }
    }

    fn forward_kernel(&self) -> &'static str {
        if self.d == 64 { FORWARD_D64 } else { FORWARD_D128 }
    }

    fn backward_kernel(&self) -> &'static str {
        if self.d == 64 { BACKWARD_D64 } else { BACKWARD_D128 }
    }
}

/// Where the backward kernel writes dK and dV: the addresses of their buffers (one packed buffer when
/// fused), its rows and the offsets of the two within a row.
struct GradTargets {
    dk: u64,
    dv: u64,
    row: u64,
    dk_part: u64,
    dv_part: u64,
}

/// A null device pointer, for the kernels' optional operands.
const NULL: u64 = 0;

/// Where the forward kernel writes (device pointers, [`NULL`] for what it does not): the output `out`
/// for the attention itself, or, given `dout`, each row's log-sum-exp `lse` and D = rowsum(dO * O)
/// `delta` for the backward pass.
struct ForwardTargets {
    out: u64,
    lse: u64,
    delta: u64,
    dout: u64,
}

impl Device {
    /// Whether this attention runs on the flash kernels (and their geometry).
    fn flash_geometry(&self, qkv: &Qkv<u16>, causal: bool) -> Option<Geometry> {
        if !self.flash {
            return None;
        }
        Geometry::of(qkv, causal, &self.stream)
    }

    /// The attention output y ([.., sq, heads * d], bf16), if the flash kernels can run it.
    pub(super) fn flash_attention(
        &self,
        qkv: &Qkv<u16>,
        causal: bool,
        y: &mut CudaSlice<u16>,
    ) -> Option<Result<(), KernelError>> {
        let g = self.flash_geometry(qkv, causal)?;
        Some(self.flash_forward(qkv, g, y))
    }

    fn flash_forward(&self, qkv: &Qkv<u16>, g: Geometry, y: &mut CudaSlice<u16>) -> Result<(), KernelError> {
        let (out, _record) = y.device_ptr_mut(&self.stream);
        self.launch_forward(qkv, &g, ForwardTargets { out, lse: NULL, delta: NULL, dout: NULL })
    }

    /// The forward kernel into `targets` (the output, or each row's log-sum-exp and D).
    fn launch_forward(&self, qkv: &Qkv<u16>, g: &Geometry, targets: ForwardTargets) -> Result<(), KernelError> {
        let [q, k, v] = qkv.data;
        let ForwardTargets { out, lse, delta, dout } = targets;
        launch!(
            self,
            g.forward_kernel(),
            Some(g.forward_config()),
            [
                q,
                k,
                v,
                &out,
                &lse,
                &delta,
                &dout,
                &g.q_row,
                &g.q_part,
                &g.kv_row,
                &g.k_part,
                &g.v_part,
                &g.o_row,
                &g.sq,
                &g.sk,
                &g.heads,
                &g.group,
                &g.causal,
                &g.scale_log2
            ]
        )
    }

    /// The gradients `want` (of q, k, v) of the attention into `grad`, if the flash kernels can run it.
    /// `grad` is the packed [.., (3, heads, d)] gradient when fused, else the wanted operand's.
    pub(super) fn flash_attention_grad(
        &self,
        qkv: &Qkv<u16>,
        a: AttentionArgs,
        dy: &CudaSlice<u16>,
        grad: &mut CudaSlice<u16>,
        scratch: &mut Scratch,
    ) -> Option<Result<(), KernelError>> {
        let g = self.flash_geometry(qkv, a.causal)?;
        Some(self.flash_grad_with(qkv, a, g, dy, grad, scratch))
    }

    fn flash_grad_with(
        &self,
        qkv: &Qkv<u16>,
        a: AttentionArgs,
        g: Geometry,
        dy: &CudaSlice<u16>,
        grad: &mut CudaSlice<u16>,
        scratch: &mut Scratch,
    ) -> Result<(), KernelError> {
        if a.fused {
            return self.flash_backward(qkv, a, &g, dy, grad, scratch);
        }
        let [q, k, v] = qkv.data;
        let pointers = [q, k, v, dy].map(|s| s.device_ptr(&self.stream).0);
        let key = g.key(pointers);
        let wrt = usize::from(a.wrt);
        let kept = &mut scratch.kept;
        if kept.key == key && kept.pending.get(wrt) == Some(&true) {
            kept.pending[wrt] = false;
            return self.serve_kept(&g, wrt, grad, scratch);
        }
        scratch.forget();
        self.flash_backward(qkv, a, &g, dy, grad, scratch)?;
        let kept = &mut scratch.kept;
        kept.key = key;
        kept.pending = [0, 1, 2].map(|operand| operand != wrt);
        Ok(())
    }

    /// Writes a kept gradient of a non-fused attention into `grad`: dQ rounded from its sum, dK or dV
    /// copied.
    fn serve_kept(
        &self,
        g: &Geometry,
        wrt: usize,
        grad: &mut CudaSlice<u16>,
        scratch: &Scratch,
    ) -> Result<(), KernelError> {
        let grad_len = grad.len();
        let (grad_ptr, _record) = grad.device_ptr_mut(&self.stream);
        if wrt == 0 {
            let dq = scratch.dq.as_ref().ok_or_else(|| KernelError::Internal("no kept dQ sum".into()))?;
            return self.store_dq(g, grad_ptr, dq);
        }
        let source = if wrt == 1 { &scratch.kept.dk } else { &scratch.kept.dv };
        let n = g.kv_grad_len();
        let source = source.as_ref().filter(|s| s.len() >= n && grad_len >= n);
        let source = source.ok_or_else(|| KernelError::Internal("no kept dK or dV".into()))?;
        let bytes = n * 2;
        let (src_ptr, _src_record) = source.device_ptr(&self.stream);
        // SAFETY: both ranges hold `n` bf16 elements (checked above) on this stream's device.
        unsafe {
            cudarc::driver::result::memcpy_dtod_async(grad_ptr, src_ptr, bytes, self.stream.cu_stream())
                .map_err(driver("copying a kept attention gradient"))?;
        }
        Ok(())
    }

    /// The backward kernels: every gradient of a fused attention into `grad`; for a non-fused one, the
    /// gradient of operand `a.wrt` into `grad` and the other two into the kept buffers.
    fn flash_backward(
        &self,
        qkv: &Qkv<u16>,
        a: AttentionArgs,
        g: &Geometry,
        dy: &CudaSlice<u16>,
        grad: &mut CudaSlice<u16>,
        scratch: &mut Scratch,
    ) -> Result<(), KernelError> {
        let g = *g;
        let lse = grow(&mut scratch.lse, &self.stream, g.rows())?;
        let delta = grow(&mut scratch.delta, &self.stream, g.rows())?;
        {
            let (lse, _lse_record) = lse.device_ptr_mut(&self.stream);
            let (delta, _delta_record) = delta.device_ptr_mut(&self.stream);
            let (dout, _dout_record) = dy.device_ptr(&self.stream);
            self.launch_forward(qkv, &g, ForwardTargets { out: NULL, lse, delta, dout })?;
        }
        let [q, k, v] = qkv.data;
        let dq_len = g.rows() * g.d;
        // Every gradient is computed (a non-fused attention keeps the two it was not asked for).
        let dq = grow(&mut scratch.dq, &self.stream, dq_len)?;
        self.stream.memset_zeros(&mut dq.slice_mut(0..dq_len)).map_err(driver("zeroing the dQ sum"))?;
        let (grad_ptr, _record) = grad.device_ptr_mut(&self.stream);
        let targets = if a.fused {
            GradTargets { dk: grad_ptr, dv: grad_ptr, row: g.q_row, dk_part: g.k_part, dv_part: g.v_part }
        } else {
            let n = g.kv_grad_len();
            let kept = |operand: u8, slot: &mut Option<CudaSlice<u16>>| -> Result<u64, KernelError> {
                match a.wrt == operand {
                    true => Ok(grad_ptr),
                    false => Ok(grow(slot, &self.stream, n)?.device_ptr(&self.stream).0),
                }
            };
            let (dk, dv) = (kept(1, &mut scratch.kept.dk)?, kept(2, &mut scratch.kept.dv)?);
            GradTargets { dk, dv, row: g.kv_row, dk_part: 0, dv_part: 0 }
        };
        let dq_ptr = dq.device_ptr(&self.stream).0;
        launch!(
            self,
            g.backward_kernel(),
            Some(g.backward_config()),
            [
                q,
                k,
                v,
                dy,
                &*lse,
                &*delta,
                &dq_ptr,
                &targets.dk,
                &targets.dv,
                &g.q_row,
                &g.q_part,
                &g.kv_row,
                &g.k_part,
                &g.v_part,
                &g.o_row,
                &targets.row,
                &targets.dk_part,
                &targets.dv_part,
                &g.sq,
                &g.sk,
                &g.heads,
                &g.group,
                &g.causal,
                &g.scale_log2,
                &g.scale
            ]
        )?;
        match a.fused || a.wrt == 0 {
            true => self.store_dq(&g, grad_ptr, dq),
            false => Ok(()),
        }
    }

    /// dQ rounded from its f32 sum into q's layout at `out` (rows of q, from its part of a fused row).
    fn store_dq(&self, g: &Geometry, out: u64, dq: &CudaSlice<f32>) -> Result<(), KernelError> {
        let dq_len = g.rows() * g.d;
        let rows = g.batch as u64 * g.sq as u64;
        let (heads, d) = (g.heads as u64, g.d as u64);
        launch!(self, DQ_STORE, elementwise(dq_len), [&out, dq, &rows, &heads, &d, &g.q_row, &g.q_part, &g.scale])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_memory_fits_every_gpu_the_kernels_run_on() {
        // Ampere's smallest per-block opt-in limit is 99 KiB (sm_86); the forward d=64 block fits the
        // default 48 KiB.
        for d in HEAD_SIZES {
            assert!(forward_smem(d) <= 99 * 1024 && backward_smem(d) <= 99 * 1024, "d = {d}");
        }
        assert!(forward_smem(64) <= 48 * 1024);
    }

    #[test]
    fn the_ptx_target_is_read_from_its_directive() {
        assert_eq!(ptx_target("//\n.version 8.5\n.target sm_90\n.address_size 64"), Some(90));
        assert_eq!(ptx_target(".target sm_75, debug"), Some(75));
        assert_eq!(ptx_target(".version 8.5"), None);
    }
}
