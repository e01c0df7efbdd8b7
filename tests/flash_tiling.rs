//! A CPU model of the CUDA flash attention's tiling (crates/runtime/src/cuda/flash.cu), checked against the CPU
//! backend's attention and its gradients: 64-row query blocks walking 64-key blocks with an online
//! softmax in the log2 domain, causal blocks skipped, a log-sum-exp per row kept for the backward pass,
//! and the backward pass per 64-key block over every query head of a kv head's group, with
//! D = rowsum(dO * O). It runs everywhere (no GPU) and pins down the algorithm the kernels implement; the
//! kernels themselves are checked against the CPU backend on a GPU by tests/cuda_kernels.rs.

use optimus::plan::Kernel;
use optimus::plan::tensor::Tensor;

mod cpu_kernel;
use cpu_kernel::eval;

/// Query rows of a forward block and keys of a backward block, as in flash.cu.
const BLOCK: usize = 64;

/// One attention: q [b, sq, heads * d], k and v [b, sk, kv_heads * d], row-major.
struct Problem {
    batch: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
    sq: usize,
    sk: usize,
    causal: bool,
}

impl Problem {
    fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    fn q_at(&self, b: usize, r: usize, h: usize) -> usize {
        (b * self.sq + r) * self.heads * self.d + h * self.d
    }

    fn kv_at(&self, b: usize, c: usize, hk: usize) -> usize {
        (b * self.sk + c) * self.kv_heads * self.d + hk * self.d
    }

    fn seen(&self, row: usize, col: usize) -> bool {
        col < self.sk && (!self.causal || col <= row)
    }

    fn scale_log2(&self) -> f64 {
        std::f64::consts::LOG2_E / (self.d as f64).sqrt()
    }

    fn dot(&self, x: &[f32], i: usize, y: &[f32], j: usize) -> f64 {
        (0..self.d).map(|e| f64::from(x[i + e]) * f64::from(y[j + e])).sum()
    }

    /// The key blocks a query block visits: all of them, or up to its own when causal.
    fn key_blocks(&self, qb: usize) -> usize {
        let all = self.sk.div_ceil(BLOCK);
        if self.causal { all.min(qb + 1) } else { all }
    }

    /// The forward pass: the output and each row's log-sum-exp (log2 domain), per (b, h, row).
    fn forward(&self, q: &[f32], k: &[f32], v: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let mut out = vec![0.0; self.batch * self.sq * self.heads * self.d];
        let mut lse = vec![f64::INFINITY; self.batch * self.heads * self.sq];
        for b in 0..self.batch {
            for h in 0..self.heads {
                for qb in 0..self.sq.div_ceil(BLOCK) {
                    for r in qb * BLOCK..((qb + 1) * BLOCK).min(self.sq) {
                        let (o, l) = self.forward_row(q, k, v, (b, h, r), self.key_blocks(qb));
                        let at = self.q_at(b, r, h);
                        out[at..at + self.d].copy_from_slice(&o);
                        lse[(b * self.heads + h) * self.sq + r] = l;
                    }
                }
            }
        }
        (out, lse)
    }

    /// One query row over `blocks` key blocks with the online softmax of the kernel.
    fn forward_row(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        (b, h, r): (usize, usize, usize),
        blocks: usize,
    ) -> (Vec<f64>, f64) {
        let hk = h / self.group();
        let (mut m, mut l, mut acc) = (f64::NEG_INFINITY, 0.0, vec![0.0; self.d]);
        for j in 0..blocks {
            let cols = j * BLOCK..((j + 1) * BLOCK).min(self.sk);
            let s: Vec<f64> = cols
                .clone()
                .map(|c| {
                    let live = self.seen(r, c);
                    if live {
                        self.dot(q, self.q_at(b, r, h), k, self.kv_at(b, c, hk)) * self.scale_log2()
                    } else {
                        f64::NEG_INFINITY
                    }
                })
                .collect();
            let mx = s.iter().copied().fold(m, f64::max);
            let base = if mx == f64::NEG_INFINITY { 0.0 } else { mx };
            let correction = (m - base).exp2();
            (m, l) = (mx, l * correction);
            acc.iter_mut().for_each(|a| *a *= correction);
            for (c, &sc) in cols.zip(&s) {
                let p = (sc - base).exp2();
                l += p;
                let at = self.kv_at(b, c, hk);
                acc.iter_mut().enumerate().for_each(|(e, a)| *a += p * f64::from(v[at + e]));
            }
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        (acc.iter().map(|a| a * inv).collect(), if l > 0.0 { m + l.log2() } else { f64::INFINITY })
    }

    /// The backward pass: (dq, dk, dv), per key block as the kernel walks them.
    fn backward(&self, q: &[f32], k: &[f32], v: &[f32], dy: &[f32]) -> [Vec<f64>; 3] {
        let (out, lse) = self.forward(q, k, v);
        let mut delta = vec![0.0; lse.len()];
        for b in 0..self.batch {
            for h in 0..self.heads {
                for r in 0..self.sq {
                    let at = self.q_at(b, r, h);
                    delta[(b * self.heads + h) * self.sq + r] =
                        (0..self.d).map(|e| f64::from(dy[at + e]) * out[at + e]).sum();
                }
            }
        }
        let mut grads = [vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]];
        for b in 0..self.batch {
            for hk in 0..self.kv_heads {
                for kb in 0..self.sk.div_ceil(BLOCK) {
                    self.backward_block(q, k, v, dy, (&lse, &delta), (b, hk, kb), &mut grads);
                }
            }
        }
        let scale = 1.0 / (self.d as f64).sqrt();
        let [dq, dk, _] = &mut grads;
        dq.iter_mut().chain(dk.iter_mut()).for_each(|g| *g *= scale);
        grads
    }

    /// One block of 64 keys of kv head hk: every query head of its group, every query block that sees it.
    #[allow(clippy::too_many_arguments)]
    fn backward_block(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        dy: &[f32],
        (lse, delta): (&[f64], &[f64]),
        (b, hk, kb): (usize, usize, usize),
        [dq, dk, dv]: &mut [Vec<f64>; 3],
    ) {
        let first = if self.causal { kb } else { 0 };
        for h in hk * self.group()..(hk + 1) * self.group() {
            for qb in first..self.sq.div_ceil(BLOCK) {
                for r in qb * BLOCK..((qb + 1) * BLOCK).min(self.sq) {
                    let stats = (b * self.heads + h) * self.sq + r;
                    for c in kb * BLOCK..((kb + 1) * BLOCK).min(self.sk) {
                        if !self.seen(r, c) {
                            continue;
                        }
                        let (qa, ka, ya) = (self.q_at(b, r, h), self.kv_at(b, c, hk), self.q_at(b, r, h));
                        let p = (self.dot(q, qa, k, ka) * self.scale_log2() - lse[stats]).exp2();
                        let dp = self.dot(dy, ya, v, ka);
                        let ds = p * (dp - delta[stats]);
                        for e in 0..self.d {
                            dv[ka + e] += p * f64::from(dy[ya + e]);
                            dk[ka + e] += ds * f64::from(q[qa + e]);
                            dq[qa + e] += ds * f64::from(k[ka + e]);
                        }
                    }
                }
            }
        }
    }
}

/// Deterministic uniforms in [-1, 1).
fn uniforms(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    (0..n)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn cpu_kernel(kernel: Kernel, inputs: &[&Tensor], shape: &[u64]) -> Result<Vec<f32>, String> {
    Ok(eval(&kernel, inputs, shape)?.f32()?.to_vec())
}

fn close(name: &str, model: &[f64], reference: &[f32]) -> Result<(), String> {
    if model.len() != reference.len() {
        return Err(format!("{name}: {} elements, the CPU gives {}", model.len(), reference.len()));
    }
    for (i, (&m, &r)) in model.iter().zip(reference).enumerate() {
        if (m - f64::from(r)).abs() > 1e-5 * f64::from(r).abs().max(1.0) {
            return Err(format!("{name}: element {i}: the tiled model gives {m}, the CPU {r}"));
        }
    }
    Ok(())
}

fn check(p: &Problem, seed: u64) -> Result<(), String> {
    let (qw, kw) = (p.heads * p.d, p.kv_heads * p.d);
    let q = uniforms(seed, p.batch * p.sq * qw);
    let k = uniforms(seed + 1, p.batch * p.sk * kw);
    let v = uniforms(seed + 2, p.batch * p.sk * kw);
    let dy = uniforms(seed + 3, p.batch * p.sq * qw);
    let shape = |s: usize, w: usize| [p.batch as u64, s as u64, w as u64];
    let tensors = [
        Tensor::from_f32(&shape(p.sq, qw), q.clone()),
        Tensor::from_f32(&shape(p.sk, kw), k.clone()),
        Tensor::from_f32(&shape(p.sk, kw), v.clone()),
        Tensor::from_f32(&shape(p.sq, qw), dy.clone()),
    ];
    let [tq, tk, tv, tdy] = &tensors;
    let (heads, kv_heads, causal) = (p.heads as u64, p.kv_heads as u64, p.causal);
    let forward = Kernel::Attention { heads, kv_heads, causal, fused: false };
    let want = cpu_kernel(forward, &[tq, tk, tv], &shape(p.sq, qw))?;
    close("the output", &p.forward(&q, &k, &v).0, &want)?;
    let grads = p.backward(&q, &k, &v, &dy);
    for (wrt, (name, s, w)) in [("dq", p.sq, qw), ("dk", p.sk, kw), ("dv", p.sk, kw)].into_iter().enumerate() {
        let kernel = Kernel::AttentionGrad { heads, kv_heads, causal, fused: false, wrt: wrt as u8 };
        close(name, &grads[wrt], &cpu_kernel(kernel, &[tdy, tq, tk, tv], &shape(s, w))?)?;
    }
    Ok(())
}

#[test]
fn the_tiled_algorithm_computes_the_cpu_attention_and_its_gradients() -> Result<(), String> {
    let cases = [
        Problem { batch: 2, heads: 2, kv_heads: 2, d: 8, sq: 130, sk: 130, causal: true },
        Problem { batch: 1, heads: 2, kv_heads: 2, d: 8, sq: 64, sk: 64, causal: false },
        Problem { batch: 1, heads: 4, kv_heads: 2, d: 4, sq: 70, sk: 150, causal: false },
        Problem { batch: 1, heads: 6, kv_heads: 2, d: 4, sq: 150, sk: 70, causal: true },
        Problem { batch: 1, heads: 3, kv_heads: 1, d: 4, sq: 33, sk: 33, causal: true },
    ];
    for (seed, case) in cases.iter().enumerate() {
        check(case, 10 * seed as u64 + 1).map_err(|e| {
            format!(
                "heads {}/{} d {} sq {} sk {} causal {}: {e}",
                case.heads, case.kv_heads, case.d, case.sq, case.sk, case.causal
            )
        })?;
    }
    Ok(())
}
