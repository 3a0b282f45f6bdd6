//! Dot products of one weight row with one activation row, as ggml pairs them.
//!
//! The activation row is quantized once per row into the weight format's partner
//! ([`act_type`]): Q8_0 for Q4_0/Q5_0/Q8_0/IQ4_NL/MXFP4, Q8_1 for Q4_1/Q5_1, Q8_K for
//! the K-quants and the 256-element i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
//! IQ3_S, IQ4_XS), and plain f32 for F32/F16/BF16 weights.
//!
//! [`dot_with`] runs a chosen kernel family; [`dot`] the best one this CPU has.
//! Every family returns the same bits as the scalar reference ([`scalar`]).

pub mod scalar;
#[cfg(target_arch = "x86_64")]
/// `[e(0), e(1), ...]` written out: `std::array::from_fn` is not compiled with
/// the caller's target features, so its closure would not inline (every vector
/// would go through memory).
macro_rules! arr {
    ($c:ident in 2 => $e:expr) => {
        [{ let $c = 0usize; $e }, { let $c = 1usize; $e }]
    };
    ($c:ident in 4 => $e:expr) => {
        [{ let $c = 0usize; $e }, { let $c = 1usize; $e }, { let $c = 2usize; $e }, { let $c = 3usize; $e }]
    };
    ($c:ident in 8 => $e:expr) => {
        [
            { let $c = 0usize; $e }, { let $c = 1usize; $e }, { let $c = 2usize; $e }, { let $c = 3usize; $e },
            { let $c = 4usize; $e }, { let $c = 5usize; $e }, { let $c = 6usize; $e }, { let $c = 7usize; $e },
        ]
    };
}

#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_amx;
#[cfg(target_arch = "x86_64")]
mod x86_iq;
#[cfg(target_arch = "x86_64")]
mod x86_kquant;
#[cfg(target_arch = "x86_64")]
mod x86_kquant_avx2;
#[cfg(target_arch = "x86_64")]
mod x86_multi;

use crate::blocks::*;
use crate::error::{QuantError, Result};
use crate::isa::Isa;
use crate::quantize;
use samesum_gguf::GgmlType;

/// The activation format ggml pairs with weight format `weight`, or `None` when
/// there is no dot kernel for it.
pub fn act_type(weight: GgmlType) -> Option<GgmlType> {
    use GgmlType::*;
    Some(match weight {
        F32 | F16 | BF16 => F32,
        Q4_0 | Q5_0 | Q8_0 | IQ4_NL | MXFP4 => Q8_0,
        Q4_1 | Q5_1 => Q8_1,
        Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | IQ4_XS | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S => {
            Q8_K
        }
        _ => return None,
    })
}

/// Weight formats with a dot kernel.
pub const DOT_FORMATS: &[GgmlType] = &[
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q2_K,
    GgmlType::Q3_K,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
    GgmlType::IQ4_NL,
    GgmlType::IQ4_XS,
    GgmlType::MXFP4,
    GgmlType::IQ2_XXS,
    GgmlType::IQ2_XS,
    GgmlType::IQ2_S,
    GgmlType::IQ3_XXS,
    GgmlType::IQ3_S,
];

/// An activation row, quantized once into the format its weights pair with.
#[derive(Clone, Debug, PartialEq)]
pub enum ActRow {
    /// Plain f32 (for F32/F16/BF16 weights).
    F32(Vec<f32>),
    /// Q8_0 blocks.
    Q8_0(Vec<BlockQ8_0>),
    /// Q8_1 blocks.
    Q8_1(Vec<BlockQ8_1>),
    /// Q8_K blocks.
    Q8K(Vec<BlockQ8K>),
}

impl ActRow {
    /// Quantize `x` for a dot with weights of type `weight`.
    pub fn quantize(weight: GgmlType, x: &[f32]) -> Result<ActRow> {
        let act = act_type(weight).ok_or(QuantError::Unsupported {
            ty: weight,
            what: "dot",
        })?;
        let bs = act.block_size();
        if !x.len().is_multiple_of(bs) {
            return Err(QuantError::NotBlockMultiple {
                ty: act,
                n: x.len(),
                block: bs,
            });
        }
        Ok(match act {
            GgmlType::F32 => ActRow::F32(x.to_vec()),
            GgmlType::Q8_0 => ActRow::Q8_0(
                x.chunks_exact(32)
                    .map(|c| quantize::q8_0(c.try_into().unwrap()))
                    .collect(),
            ),
            GgmlType::Q8_1 => ActRow::Q8_1(
                x.chunks_exact(32)
                    .map(|c| quantize::q8_1(c.try_into().unwrap()))
                    .collect(),
            ),
            _ => ActRow::Q8K(
                x.chunks_exact(256)
                    .map(|c| quantize::q8_k(c.try_into().unwrap()))
                    .collect(),
            ),
        })
    }

    /// The activation format.
    pub fn act_type(&self) -> GgmlType {
        match self {
            ActRow::F32(_) => GgmlType::F32,
            ActRow::Q8_0(_) => GgmlType::Q8_0,
            ActRow::Q8_1(_) => GgmlType::Q8_1,
            ActRow::Q8K(_) => GgmlType::Q8_K,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ActRow::F32(v) => v.len(),
            ActRow::Q8_0(v) => v.len() * 32,
            ActRow::Q8_1(v) => v.len() * 32,
            ActRow::Q8K(v) => v.len() * 256,
        }
    }

    /// Whether the row is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The dot product of weight row `w` (bytes of type `weight`) with `act`, using the
/// best kernel family this CPU has.
pub fn dot(weight: GgmlType, w: &[u8], act: &ActRow) -> Result<f32> {
    dot_with(Isa::best(), weight, w, act)
}

fn cast<B: bytemuck::Pod>(ty: GgmlType, w: &[u8]) -> Result<&[B]> {
    crate::cast_blocks(ty, w)
}

/// The dot product with kernel family `isa` (falls back to scalar for formats
/// that family does not accelerate). Errors if `isa` is not supported here.
pub fn dot_with(isa: Isa, weight: GgmlType, w: &[u8], act: &ActRow) -> Result<f32> {
    let mut out = [0f32];
    dot_rows_with(isa, weight, w, act, &mut out)?;
    Ok(out[0])
}

/// Dot products of `out.len()` consecutive weight rows (`w` holds exactly that
/// many rows of `act.len()` elements) with one activation row, using the best
/// kernel family this CPU has. Validation and dispatch happen once per call.
pub fn dot_rows(weight: GgmlType, w: &[u8], act: &ActRow, out: &mut [f32]) -> Result<()> {
    dot_rows_with(Isa::best(), weight, w, act, out)
}

/// [`dot_rows`] with kernel family `isa`. Every row's result is exactly
/// [`dot_with`] of that row.
pub fn dot_rows_with(
    isa: Isa,
    weight: GgmlType,
    w: &[u8],
    act: &ActRow,
    out: &mut [f32],
) -> Result<()> {
    let expected_act = act_type(weight).ok_or(QuantError::Unsupported {
        ty: weight,
        what: "dot",
    })?;
    if act.act_type() != expected_act {
        return Err(QuantError::ActivationType {
            weight,
            act: act.act_type(),
            expected: expected_act,
        });
    }
    let n = act.len();
    let row_bytes = crate::row_size(weight, n)?;
    if w.len() != row_bytes * out.len() {
        return Err(QuantError::RowMismatch {
            ty: weight,
            expected: if out.len() == 1 {
                w.len() / weight.type_size() * weight.block_size()
            } else {
                out.len() * n
            },
            found: if out.len() == 1 {
                n
            } else {
                w.len() / row_bytes.max(1) * n
            },
        });
    }
    if !isa.supported() {
        return Err(QuantError::Unsupported {
            ty: weight,
            what: "this kernel family on this CPU",
        });
    }
    let per_row = n / weight.block_size();
    if per_row == 0 {
        out.fill(0.0);
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    let isa = isa.min(Isa::Avx512);
    #[cfg(target_arch = "x86_64")]
    let (w, out) = if isa == Isa::Avx512 && out.len() >= 8 {
        // Eight weight rows at a time where a kernel shares each activation
        // block among them (one weight row per float lane); the rest below.
        let done = x86_multi::dot_rows8(weight, w, act, per_row, out)?;
        let rb = w.len() / out.len();
        (&w[done * rb..], &mut out[done..])
    } else {
        (w, out)
    };
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Scalar && x86::dot_rows(isa, weight, w, act, per_row, out)? {
        return Ok(());
    }
    macro_rules! each_row {
        ($kernel:path, $a:expr) => {{
            let blocks = cast(weight, w)?;
            for (o, wr) in out.iter_mut().zip(blocks.chunks_exact(per_row)) {
                *o = $kernel(wr, $a);
            }
        }};
    }
    use GgmlType as T;
    match (weight, act) {
        (T::F32, ActRow::F32(x)) => each_row!(scalar::f32_f32, x),
        (T::F16, ActRow::F32(x)) => each_row!(scalar::f16_f32, x),
        (T::BF16, ActRow::F32(x)) => each_row!(scalar::bf16_f32, x),
        (T::Q4_0, ActRow::Q8_0(a)) => each_row!(scalar::q4_0_q8_0, a),
        (T::Q5_0, ActRow::Q8_0(a)) => each_row!(scalar::q5_0_q8_0, a),
        (T::Q8_0, ActRow::Q8_0(a)) => each_row!(scalar::q8_0_q8_0, a),
        (T::IQ4_NL, ActRow::Q8_0(a)) => each_row!(scalar::iq4_nl_q8_0, a),
        (T::MXFP4, ActRow::Q8_0(a)) => each_row!(scalar::mxfp4_q8_0, a),
        (T::Q4_1, ActRow::Q8_1(a)) => each_row!(scalar::q4_1_q8_1, a),
        (T::Q5_1, ActRow::Q8_1(a)) => each_row!(scalar::q5_1_q8_1, a),
        (T::Q2_K, ActRow::Q8K(a)) => each_row!(scalar::q2_k_q8_k, a),
        (T::Q3_K, ActRow::Q8K(a)) => each_row!(scalar::q3_k_q8_k, a),
        (T::Q4_K, ActRow::Q8K(a)) => each_row!(scalar::q4_k_q8_k, a),
        (T::Q5_K, ActRow::Q8K(a)) => each_row!(scalar::q5_k_q8_k, a),
        (T::Q6_K, ActRow::Q8K(a)) => each_row!(scalar::q6_k_q8_k, a),
        (T::IQ4_XS, ActRow::Q8K(a)) => each_row!(scalar::iq4_xs_q8_k, a),
        (T::IQ2_XS, ActRow::Q8K(a)) => each_row!(scalar::iq2_xs_q8_k, a),
        (T::IQ3_S, ActRow::Q8K(a)) => each_row!(scalar::iq3_s_q8_k, a),
        (T::IQ2_XXS, ActRow::Q8K(a)) => each_row!(scalar::iq2_xxs_q8_k, a),
        (T::IQ3_XXS, ActRow::Q8K(a)) => each_row!(scalar::iq3_xxs_q8_k, a),
        (T::IQ2_S, ActRow::Q8K(a)) => each_row!(scalar::iq2_s_q8_k, a),
        _ => {
            return Err(QuantError::Unsupported {
                ty: weight,
                what: "dot",
            });
        }
    }
    Ok(())
}

/// Dot products of `n` consecutive weight rows with several activation rows:
/// `out[r * n + j]` = weight row `j` · `acts[r]`. Every value is
/// bit-identical to [`dot_rows`] of that row pair; kernels that share the
/// unpacking of a weight block across activation rows ([`multi_accelerated`])
/// are used where they exist.
pub fn dot_rows_multi(weight: GgmlType, w: &[u8], acts: &[ActRow], out: &mut [f32]) -> Result<()> {
    dot_rows_multi_with(Isa::best(), weight, w, acts, out)
}

/// [`dot_rows_multi`] with kernel family `isa`.
pub fn dot_rows_multi_with(
    isa: Isa,
    weight: GgmlType,
    w: &[u8],
    acts: &[ActRow],
    out: &mut [f32],
) -> Result<()> {
    let nr = acts.len();
    if nr == 0 {
        return Ok(());
    }
    let n = acts[0].len();
    let row_bytes = crate::row_size(weight, n)?;
    let rows = out.len() / nr;
    if out.len() != rows * nr || w.len() != rows * row_bytes || acts.iter().any(|a| a.len() != n) {
        return Err(QuantError::RowMismatch {
            ty: weight,
            expected: rows * nr,
            found: out.len(),
        });
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Amx
        && nr >= amx_min_rows(weight)
        && isa.supported()
        && n > 0
        && x86_multi::dot_rows_multi_amx(weight, w, acts, n, rows, out)?
    {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if isa >= Isa::Avx512
        && isa.supported()
        && n > 0
        && x86_multi::dot_rows_multi(weight, w, acts, n, rows, out)?
    {
        return Ok(());
    }
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2
        && isa.supported()
        && n > 0
        && x86_kquant_avx2::dot_rows_multi(weight, w, acts, n, rows, out)?
    {
        return Ok(());
    }
    for (a, o) in acts.iter().zip(out.chunks_exact_mut(rows)) {
        dot_rows_with(isa, weight, w, a, o)?;
    }
    Ok(())
}

/// Fewest activation rows for which [`dot_rows_multi`] uses `weight`'s AMX
/// tiles (fewer run the AVX-512 kernels: same bits, less set-up). Q6_K's
/// tiles unpack four operands a step, which pays only from about 32 rows
/// (one thread, 2,048-element rows: AVX-512 79.6 G products/s at 24 rows
/// and 78.0 at 32, the tiles 57.2 and 77.6, then 102.4 at 48).
fn amx_min_rows(weight: GgmlType) -> usize {
    if weight == GgmlType::Q6_K { 40 } else { 12 }
}

/// Whether this CPU and OS let the process use AMX-INT8 tiles.
#[cfg(target_arch = "x86_64")]
pub(crate) fn amx_available() -> bool {
    x86_amx::available()
}

/// How many weight rows a [`dot_rows_multi`] call on `acts` activation rows
/// should cover for the best use of caches: the AVX-512 kernels want a small
/// tile of weight rows (it stays in L1 while every group of 8 activation
/// rows passes) when there are several groups; the AMX kernels tile the
/// weight rows themselves and rearrange the activations once per call, so
/// they want every row the caller has. `usize::MAX` means no limit.
pub fn multi_rows_per_call(weight: GgmlType, acts: usize) -> usize {
    #[cfg(target_arch = "x86_64")]
    if Isa::best() == Isa::Amx
        && acts >= amx_min_rows(weight)
        && x86_multi::AMX_FORMATS.contains(&weight)
    {
        return usize::MAX;
    }
    let _ = weight;
    if acts <= 8 { usize::MAX } else { 16 }
}

/// Which weight formats have a multi-row kernel in family `isa` (one weight
/// block unpacked once for several activation rows); [`dot_rows_multi_with`]
/// runs the others one activation row at a time.
pub fn multi_accelerated(isa: Isa) -> &'static [GgmlType] {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => x86_multi::MULTI_FORMATS,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86_kquant_avx2::TILE_FORMATS,
        _ => &[],
    }
}

/// Which weight formats family `isa` accelerates (the rest run the scalar kernel).
pub fn accelerated(isa: Isa) -> &'static [GgmlType] {
    match isa {
        Isa::Scalar => &[],
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => x86::AVX2_FORMATS,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Amx => x86::AVX512_FORMATS,
        #[cfg(not(target_arch = "x86_64"))]
        _ => &[],
    }
}
