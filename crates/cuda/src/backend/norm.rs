//! RMSNorm: a warp a row up to 256 wide, a block a row above (the fused
//! norm launches that also write Q8_K rows are in ops.rs and moe.rs);
//! column copies.

use super::*;

impl Cuda {
    /// RMSNorm of host rows (`x.len() / w.len()` of them) through
    /// `rms_norm_on`'s choice of kernel, or with `reference` through the
    /// block-a-row kernel at every width (for tests).
    #[doc(hidden)]
    pub fn rms_norm_host(
        &self,
        x: &[f32],
        w: &[f32],
        eps: f32,
        reference: bool,
    ) -> Result<Vec<f32>> {
        let rows = x.len() / w.len().max(1);
        let xd = self.dev.upload(x)?;
        let wd = self.dev.upload(w)?;
        let mut y = self.dev.upload(&vec![f32::NAN; x.len()])?;
        if reference {
            let width = w.len() as i32;
            launch!(
                self.dev,
                "rms_norm",
                cfg((rows as u32, 1, 1), 256, 0),
                &xd,
                &wd,
                &mut y,
                &width,
                &eps
            )?;
        } else {
            self.rms_norm_on(&xd, &wd, w.len(), rows, eps, &mut y)?;
        }
        self.dev.download(&y, x.len())
    }

    pub(super) fn rms_norm_rows(
        &self,
        x: &CudaSlice<f32>,
        w: &[f32],
        rows: usize,
        eps: f32,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        self.rms_norm_on(x, self.vec(w)?, w.len(), rows, eps, y)
    }

    /// RMSNorm of `rows` rows of `width` with the weights at `wd`: a warp a
    /// row up to 256 wide (the head norms), else a block a row; the same
    /// arithmetic either way.
    pub(super) fn rms_norm_on(
        &self,
        x: &CudaSlice<f32>,
        wd: &CudaSlice<f32>,
        width: usize,
        rows: usize,
        eps: f32,
        y: &mut CudaSlice<f32>,
    ) -> Result<()> {
        let small = width <= 256;
        let width = width as i32;
        if small {
            let ri = rows as i32;
            return launch!(
                self.dev,
                "rms_norm_small",
                cfg((rows.div_ceil(8) as u32, 1, 1), 256, 0),
                x,
                wd,
                y,
                &ri,
                &width,
                &eps
            );
        }
        launch!(
            self.dev,
            "rms_norm",
            cfg((rows as u32, 1, 1), 256, 0),
            x,
            wd,
            y,
            &width,
            &eps
        )
    }

    pub(super) fn copy_cols(
        &self,
        src: &CudaSlice<f32>,
        src_w: usize,
        dst: &mut CudaSlice<f32>,
        dst_w: usize,
        map: u64,
        m: usize,
    ) -> Result<()> {
        let (sw, dw, mi) = (src_w as i32, dst_w as i32, m as i32);
        launch!(
            self.dev,
            "copy_cols",
            cfg1(m * dst_w),
            src,
            &sw,
            dst,
            &dw,
            &map,
            &mi
        )
    }
}
