//! A stage's output projection that recomputation can skip.
//!
//! With `FsdpOptions::recompute`, backward runs each stage's forward again only to rebuild its
//! graph. The stage's output *value* is never read there: the seed is `Σ out · g`, whose
//! gradient with respect to `out` is `g` whatever `out` holds. So the last product of a stage
//! (`y = h · wᵀ`, candle-nn's `Linear` without bias) is wasted work in that second forward: for
//! an MLP block it is half of the recomputed FLOPs. [`ProjectOnlyGradients`] stands in for it:
//! its forward returns zeros of the product's shape, its backward is the product's own (the
//! same kernels on the same operands as candle's matmul backward, so the gradients are bitwise
//! those of `Linear`).
//!
//! Only valid where nothing downstream in the stage reads `y`'s value: `y` is the stage's
//! output, or reaches it through ops whose backward does not read their inputs (a residual
//! add). Stages opt in through [`super::UnitParams::output_linear`].

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Shape, Tensor};
use candle_nn::{Linear, Module};

/// The gradients of `a · wᵀ` without its value (module doc).
struct ProjectOnlyGradients;

fn zeros_like_product(dtype: DType, a: &Layout, w: &Layout) -> candle_core::Result<(usize, Shape)> {
    let (rows, out) = (a.shape().dims2()?.0, w.shape().dims2()?.0);
    match dtype {
        DType::F32 | DType::BF16 => Ok((rows * out, Shape::from_dims(&[rows, out]))),
        other => Err(candle_core::Error::Msg(format!(
            "output_linear: dtype {other:?} (f32 or bf16 expected)"
        ))),
    }
}

impl CustomOp2 for ProjectOnlyGradients {
    fn name(&self) -> &'static str {
        "ragged-project-only-gradients"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        la: &Layout,
        _: &CpuStorage,
        lw: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (n, shape) = zeros_like_product(a.dtype(), la, lw)?;
        let zeros = match a {
            CpuStorage::BF16(_) => CpuStorage::BF16(vec![half::bf16::ZERO; n]),
            _ => CpuStorage::F32(vec![0.0; n]),
        };
        Ok((zeros, shape))
    }

    #[cfg(feature = "candle-cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        la: &Layout,
        _: &candle_core::CudaStorage,
        lw: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        let (n, shape) = zeros_like_product(a.dtype(), la, lw)?;
        let dev = a.device().clone();
        let zeros = match a.dtype() {
            DType::BF16 => {
                candle_core::CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<half::bf16>(n)?, dev)
            }
            _ => candle_core::CudaStorage::wrap_cuda_slice(dev.alloc_zeros::<f32>(n)?, dev),
        };
        Ok((zeros, shape))
    }

    /// candle's matmul backward for `a.matmul(&w.t())` followed by the transpose's: the lhs
    /// gradient `g · (wᵀ)ᵀ` (`(wᵀ)ᵀ` has `w`'s layout), the rhs one `(aᵀ · g)ᵀ`.
    fn bwd(
        &self,
        a: &Tensor,
        w: &Tensor,
        _: &Tensor,
        g: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_a = g.matmul(w)?;
        let grad_w = a.t()?.matmul(g)?.t()?;
        Ok((Some(grad_a), Some(grad_w)))
    }
}

/// `x · wᵀ` as candle-nn's `Linear::new(w, None)` computes it, or, when `value_needed` is false,
/// zeros of its shape whose backward gives `Linear`'s gradients bitwise (module doc). Inputs of
/// rank 3 or 4 are flattened to rows as `Linear` does for contiguous inputs; a non-contiguous
/// one (where `Linear` broadcasts the matmul instead) is computed in full.
pub(crate) fn output_linear(
    x: &Tensor,
    w: &Tensor,
    value_needed: bool,
) -> candle_core::Result<Tensor> {
    let dims = x.dims().to_vec();
    let flattens = matches!(dims.len(), 3 | 4) && x.is_contiguous();
    if value_needed || !(dims.len() == 2 || flattens) {
        return Linear::new(w.clone(), None).forward(x);
    }
    let rank = dims.len();
    let k = dims[rank - 1];
    let rows = x.elem_count() / k.max(1);
    let y = x.reshape((rows, k))?.apply_op2(w, ProjectOnlyGradients)?;
    let mut out = dims;
    out[rank - 1] = w.dim(0)?;
    y.reshape(out)
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    fn seeded(shape: &[usize], seed: u64, dtype: DType) -> Var {
        let n: usize = shape.iter().product();
        let mut s = seed;
        let v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5
            })
            .collect();
        let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
        Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        t.to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect()
    }

    /// Gradients of `Σ y · g` for x and w, with y from `output_linear`.
    fn grads(x: &Var, w: &Var, g: &Tensor, value_needed: bool) -> (Tensor, Vec<u32>, Vec<u32>) {
        let y = output_linear(x.as_tensor(), w.as_tensor(), value_needed).unwrap();
        let grads = (&y * g).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = bits(grads.get(x.as_tensor()).unwrap());
        let gw = bits(grads.get(w.as_tensor()).unwrap());
        (y, gx, gw)
    }

    /// Skipping the value keeps `Linear`'s gradients bitwise, for rows, contiguous batches and
    /// bf16; the stand-in value is zeros of the product's shape; a non-contiguous batch (which
    /// `Linear` broadcasts) is computed in full.
    #[test]
    fn skipped_value_keeps_linear_gradients_bitwise() {
        for (x_shape, dtype) in [
            (vec![7, 12], DType::F32),
            (vec![2, 5, 12], DType::F32),
            (vec![2, 3, 2, 12], DType::F32),
            (vec![2, 5, 12], DType::BF16),
        ] {
            let x = seeded(&x_shape, 1, dtype);
            let w = seeded(&[9, 12], 2, dtype);
            let mut g_shape = x_shape.clone();
            *g_shape.last_mut().unwrap() = 9;
            let g = seeded(&g_shape, 3, dtype).as_tensor().detach();
            let (full, gx, gw) = grads(&x, &w, &g, true);
            let linear = Linear::new(w.as_tensor().clone(), None);
            assert_eq!(bits(&full), bits(&linear.forward(x.as_tensor()).unwrap()));
            let (zeros, gx_skip, gw_skip) = grads(&x, &w, &g, false);
            assert_eq!(zeros.dims(), full.dims(), "{x_shape:?}");
            assert!(bits(&zeros).iter().all(|&b| b == 0), "{x_shape:?}");
            assert_eq!(gx, gx_skip, "x gradient, {x_shape:?} {dtype:?}");
            assert_eq!(gw, gw_skip, "w gradient, {x_shape:?} {dtype:?}");
        }
        let x = seeded(&[5, 2, 12], 4, DType::F32);
        let strided = x.as_tensor().transpose(0, 1).unwrap();
        let w = seeded(&[9, 12], 2, DType::F32);
        let y = output_linear(&strided, w.as_tensor(), false).unwrap();
        let linear = Linear::new(w.as_tensor().clone(), None);
        assert_eq!(bits(&y), bits(&linear.forward(&strided).unwrap()));
    }
}
