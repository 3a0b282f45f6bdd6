//! Rotary position embedding parameters: the base frequency, the rotated
//! dims, and the context scaling a GGUF declares under `rope.scaling.*`
//! (linear, or YaRN as llama.cpp and transformers compute it).
//!
//! YaRN keeps the high-frequency pairs (many rotations within the original
//! context) at their trained frequency, divides the low-frequency ones by the
//! scaling factor, ramps linearly between the two over the pairs whose
//! rotation count over the original context lies between `beta_fast` and
//! `beta_slow`, and scales cos and sin by `attn_factor · (1 + 0.1 ln factor)`.

use crate::error::{EngineError, Result};
use samesum_gguf::Metadata;

/// The context scaling of the rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub enum RopeScaling {
    /// Trained frequencies.
    #[default]
    None,
    /// Positions divided by `factor`.
    Linear {
        /// The scaling factor (> 1 stretches the context).
        factor: f32,
    },
    /// YaRN.
    Yarn {
        /// The scaling factor.
        factor: f32,
        /// The context the model was trained with before scaling.
        orig_ctx: usize,
        /// Rotation counts bounding the ramp (32 and 1 by default).
        beta_fast: f32,
        /// See `beta_fast`.
        beta_slow: f32,
        /// Extra factor on cos and sin (`rope.scaling.attn_factor`, 1 by
        /// default).
        attn_factor: f32,
        /// The factor on cos and sin in place of `1 + 0.1 ln factor`, when
        /// the model declares one (`rope.scaling.yarn_attn_factor`, from
        /// transformers' `attention_factor`).
        yarn_attn: Option<f32>,
    },
}

/// Everything a RoPE kernel needs, per pair `i` of the `n_rot / 2` rotated
/// pairs: [`Rope::inv_freq`] and the factor [`Rope::mscale`] on cos and sin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Rotated dims of a head.
    pub n_rot: usize,
    /// Frequency base.
    pub theta: f32,
    /// `1 / factor` (1: no scaling).
    pub freq_scale: f32,
    /// 1 for YaRN's ramp, 0 for plain linear scaling.
    pub ext_factor: f32,
    /// The YaRN ramp runs from pair `corr_lo` (extrapolated below) to pair
    /// `corr_hi` (interpolated above).
    pub corr_lo: f32,
    /// See `corr_lo`.
    pub corr_hi: f32,
    /// Factor on cos and sin.
    pub mscale: f32,
}

impl Rope {
    /// Parameters of `scaling` for `n_rot` rotated dims and base `theta`.
    pub fn new(n_rot: usize, theta: f32, scaling: RopeScaling) -> Rope {
        let plain = Rope {
            n_rot,
            theta,
            freq_scale: 1.0,
            ext_factor: 0.0,
            corr_lo: 0.0,
            corr_hi: 0.0,
            mscale: 1.0,
        };
        match scaling {
            RopeScaling::None => plain,
            RopeScaling::Linear { factor } => Rope {
                freq_scale: 1.0 / factor,
                ..plain
            },
            RopeScaling::Yarn {
                factor,
                orig_ctx,
                beta_fast,
                beta_slow,
                attn_factor,
                yarn_attn,
            } => {
                // The pair whose wavelength fits `rot` times in the original
                // context: n_rot · ln(orig / (2π rot)) / (2 ln theta).
                let dim = |rot: f32| {
                    n_rot as f32 * (orig_ctx as f32 / (rot * 2.0 * std::f32::consts::PI)).ln()
                        / (2.0 * theta.ln())
                };
                let lo = dim(beta_fast).floor().max(0.0);
                let hi = dim(beta_slow).ceil().min(n_rot as f32 - 1.0);
                let mscale = match yarn_attn {
                    Some(a) => attn_factor * a,
                    None if factor > 1.0 => attn_factor * (1.0 + 0.1 * factor.ln()),
                    None => attn_factor,
                };
                Rope {
                    freq_scale: 1.0 / factor,
                    ext_factor: 1.0,
                    corr_lo: lo,
                    corr_hi: hi,
                    mscale,
                    ..plain
                }
            }
        }
    }

    /// The angle of pair `i` per position.
    #[inline]
    pub fn inv_freq(&self, i: usize) -> f32 {
        let base = 1.0 / self.theta.powf((2 * i) as f32 / self.n_rot as f32);
        if self.freq_scale == 1.0 {
            return base;
        }
        let interp = base * self.freq_scale;
        if self.ext_factor == 0.0 {
            return interp;
        }
        let y = (i as f32 - self.corr_lo) / (self.corr_hi - self.corr_lo).max(0.001);
        let mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
        interp * (1.0 - mix) + base * mix
    }
}

/// The `rope.scaling.*` keys of architecture prefix `a` (`n_ctx_train`: the
/// default original context).
pub(crate) fn scaling_from_metadata(
    m: &Metadata,
    a: &str,
    n_ctx_train: usize,
) -> Result<RopeScaling> {
    let k = |s: &str| format!("{a}.rope.scaling.{s}");
    let float = |key: &str, default: f32| -> Result<f32> {
        let v = match m.get(&k(key)) {
            None => default,
            Some(_) => m.get_float(&k(key))? as f32,
        };
        if !v.is_finite() {
            return Err(EngineError::BadHParam(format!(
                "{} = {v} is not finite",
                k(key)
            )));
        }
        Ok(v)
    };
    let ty = match m.get(&k("type")) {
        None => "linear",
        Some(_) => m.get_str(&k("type"))?,
    };
    let factor = float("factor", 0.0)?;
    if factor < 0.0 {
        return Err(EngineError::BadHParam(format!(
            "{} = {factor} is negative",
            k("factor")
        )));
    }
    // A missing or unit factor means no scaling, as llama.cpp reads it.
    let scaled = factor != 0.0 && factor != 1.0;
    match ty {
        "none" => Ok(RopeScaling::None),
        "linear" if !scaled => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor }),
        "yarn" if !scaled => Ok(RopeScaling::None),
        "yarn" => {
            let orig_ctx = match m.get(&k("original_context_length")) {
                None => n_ctx_train,
                Some(_) => usize::try_from(m.get_uint(&k("original_context_length"))?)
                    .unwrap_or(usize::MAX),
            };
            if orig_ctx == 0 || orig_ctx > 1 << 30 {
                return Err(EngineError::BadHParam(format!(
                    "{} = {orig_ctx} must be in 1..=2^30",
                    k("original_context_length")
                )));
            }
            let beta_fast = float("yarn_beta_fast", 32.0)?;
            let beta_slow = float("yarn_beta_slow", 1.0)?;
            if beta_fast <= 0.0 || beta_slow <= 0.0 {
                return Err(EngineError::BadHParam(format!(
                    "YaRN betas {beta_fast} and {beta_slow} must be positive"
                )));
            }
            if float("yarn_log_multiplier", 0.0)? != 0.0 {
                return Err(EngineError::BadHParam(format!(
                    "{} (DeepSeek's mscale_all_dim) is not supported",
                    k("yarn_log_multiplier")
                )));
            }
            Ok(RopeScaling::Yarn {
                factor,
                orig_ctx,
                beta_fast,
                beta_slow,
                attn_factor: float("attn_factor", 1.0)?,
                yarn_attn: match m.get(&k("yarn_attn_factor")) {
                    None => None,
                    Some(_) => Some(float("yarn_attn_factor", 1.0)?),
                },
            })
        }
        other => Err(EngineError::BadHParam(format!(
            "{} = {other:?}: only none, linear and yarn are supported",
            k("type")
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The plain parameters give the trained frequencies bit for bit.
    #[test]
    fn no_scaling_is_the_trained_frequency() {
        let r = Rope::new(128, 1e6, RopeScaling::None);
        for i in 0..64 {
            assert_eq!(
                r.inv_freq(i).to_bits(),
                (1.0 / 1e6f32.powf((2 * i) as f32 / 128.0)).to_bits()
            );
        }
        assert_eq!(r.mscale, 1.0);
    }

    /// YaRN against values computed independently in f64 with transformers'
    /// formulas (`_compute_yarn_parameters`, truncate on): Qwen3's
    /// factor 4 over 32,768 trained positions, base 1e6, 128 rotated dims.
    #[test]
    fn yarn_matches_the_reference_formulas() {
        let (n_rot, base, factor, orig) = (128usize, 1e6f64, 4.0f64, 32768f64);
        let r = Rope::new(
            n_rot,
            base as f32,
            RopeScaling::Yarn {
                factor: factor as f32,
                orig_ctx: orig as usize,
                beta_fast: 32.0,
                beta_slow: 1.0,
                attn_factor: 1.0,
                yarn_attn: None,
            },
        );
        let dim = |rot: f64| {
            (n_rot as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln()) / (2.0 * base.ln())
        };
        let (lo, hi) = (
            dim(32.0).floor().max(0.0),
            dim(1.0).ceil().min(n_rot as f64 - 1.0),
        );
        assert_eq!((r.corr_lo as f64, r.corr_hi as f64), (lo, hi));
        for i in 0..n_rot / 2 {
            let extrap = 1.0 / base.powf((2 * i) as f64 / n_rot as f64);
            let interp = extrap / factor;
            let ramp = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
            let ext_w = 1.0 - ramp;
            let want = interp * (1.0 - ext_w) + extrap * ext_w;
            let got = r.inv_freq(i) as f64;
            assert!(
                ((got - want) / want).abs() < 1e-5,
                "pair {i}: {got} vs {want}"
            );
        }
        assert!((r.mscale as f64 - (0.1 * factor.ln() + 1.0)).abs() < 1e-6);
    }
}
