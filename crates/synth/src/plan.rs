//! The tensor list of a model: names, GGUF dims, types and how to fill them,
//! exactly as llama.cpp's converter names and shapes them.

use crate::shapes::{Arch, Shape};
use samesum_gguf::GgmlType;

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Fill {
    /// Normal with this standard deviation, around zero.
    Normal(f32),
    /// `1 + Normal(sd)`: norm weights (the GGUF form, offsets already applied).
    Norm(f32),
    /// Uniform in `[lo, hi)`.
    Uniform(f32, f32),
    /// `-exp(Uniform(0, ln hi))`: the converter's `ssm_a = -exp(A_log)`.
    NegExp(f32),
}

/// One tensor of the plan.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorPlan {
    /// GGUF name.
    pub name: String,
    /// Dims, ne order (row length first).
    pub dims: Vec<u64>,
    /// Storage type.
    pub ty: GgmlType,
    /// Value distribution.
    pub fill: Fill,
}

/// Which storage type a weight matrix gets for a requested model type.
/// Rows that are not a multiple of the type's block fall back as llama.cpp's
/// quantizer does (to Q8_0 here, the one fallback all block sizes allow).
fn matrix_type(base: GgmlType, ne0: u64, is_output: bool) -> GgmlType {
    let want = if is_output && base == GgmlType::Q4_K {
        GgmlType::Q6_K
    } else {
        base
    };
    if ne0.is_multiple_of(want.block_size() as u64) {
        want
    } else if ne0.is_multiple_of(32) && want.block_size() > 1 {
        GgmlType::Q8_0
    } else {
        GgmlType::F32
    }
}

/// A weight matrix of `dims` (row length first) stored as `base` (Q6_K for the
/// output head of a Q4_K model), drawn with standard deviation `1/sqrt(row)`.
fn matrix(name: String, dims: &[u64], base: GgmlType, is_output: bool) -> TensorPlan {
    TensorPlan {
        name,
        dims: dims.to_vec(),
        ty: matrix_type(base, dims[0], is_output),
        fill: Fill::Normal(1.0 / (dims[0] as f32).sqrt()),
    }
}

/// A small F32 tensor (norms, router, conv taps, gates).
fn vector(name: String, dims: &[u64], fill: Fill) -> TensorPlan {
    TensorPlan {
        name,
        dims: dims.to_vec(),
        ty: GgmlType::F32,
        fill,
    }
}

/// The tensors of `shape` with `vocab` tokens, weights stored as `base`.
pub fn tensors(shape: &Shape, vocab: u64, base: GgmlType) -> Vec<TensorPlan> {
    let d = shape.hidden as u64;
    let (hq, hkv, hd) = (
        shape.heads as u64,
        shape.kv_heads as u64,
        shape.head_dim as u64,
    );
    let (e, f, fs) = (
        shape.experts as u64,
        shape.expert_ff as u64,
        shape.shared_ff as u64,
    );
    let mut out = vec![TensorPlan {
        fill: Fill::Normal(1.0),
        ..matrix("token_embd.weight".into(), &[d, vocab], base, false)
    }];
    for l in 0..shape.layers {
        let p = |s: &str| format!("blk.{l}.{s}");
        let m = |s: &str, dims: &[u64]| matrix(p(s), dims, base, false);
        out.push(vector(p("attn_norm.weight"), &[d], Fill::Norm(0.1)));
        if shape.is_full_attention(l) {
            let q_rows = if shape.arch.is_hybrid() {
                2 * hq * hd
            } else {
                hq * hd
            };
            out.push(m("attn_q.weight", &[d, q_rows]));
            out.push(m("attn_k.weight", &[d, hkv * hd]));
            out.push(m("attn_v.weight", &[d, hkv * hd]));
            out.push(m("attn_output.weight", &[hq * hd, d]));
            out.push(vector(p("attn_q_norm.weight"), &[hd], Fill::Norm(0.1)));
            out.push(vector(p("attn_k_norm.weight"), &[hd], Fill::Norm(0.1)));
        } else {
            let dn = shape.delta.expect("hybrid shapes have delta-net sizes");
            let hv = dn.value_heads as u64;
            out.push(m("attn_qkv.weight", &[d, dn.conv_dim()]));
            out.push(m("attn_gate.weight", &[d, dn.inner_size()]));
            match shape.arch {
                Arch::Qwen3Next => out.push(m("ssm_ba.weight", &[d, 2 * hv])),
                _ => {
                    out.push(m("ssm_beta.weight", &[d, hv]));
                    out.push(m("ssm_alpha.weight", &[d, hv]));
                }
            }
            out.push(vector(
                p("ssm_conv1d.weight"),
                &[dn.conv_kernel as u64, dn.conv_dim()],
                Fill::Normal(0.5),
            ));
            out.push(vector(p("ssm_dt.bias"), &[hv], Fill::Uniform(-1.0, 1.0)));
            out.push(vector(p("ssm_a"), &[hv], Fill::NegExp(16.0)));
            out.push(vector(
                p("ssm_norm.weight"),
                &[dn.value_head_dim as u64],
                Fill::Norm(0.1),
            ));
            out.push(m("ssm_out.weight", &[dn.inner_size(), d]));
        }
        let post = if shape.arch.is_hybrid() {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        out.push(vector(p(post), &[d], Fill::Norm(0.1)));
        out.push(vector(
            p("ffn_gate_inp.weight"),
            &[d, e],
            Fill::Normal(1.0 / (d as f32).sqrt()),
        ));
        out.push(m("ffn_gate_exps.weight", &[d, f, e]));
        out.push(m("ffn_up_exps.weight", &[d, f, e]));
        out.push(m("ffn_down_exps.weight", &[f, d, e]));
        if fs > 0 {
            out.push(m("ffn_gate_shexp.weight", &[d, fs]));
            out.push(m("ffn_up_shexp.weight", &[d, fs]));
            out.push(m("ffn_down_shexp.weight", &[fs, d]));
            out.push(vector(
                p("ffn_gate_inp_shexp.weight"),
                &[d],
                Fill::Normal(1.0 / (d as f32).sqrt()),
            ));
        }
    }
    out.push(vector("output_norm.weight".into(), &[d], Fill::Norm(0.1)));
    out.push(matrix("output.weight".into(), &[d, vocab], base, true));
    out
}
