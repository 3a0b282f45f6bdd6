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

/// The tensors of `shape` with `vocab` tokens, weights stored as `base`.
pub fn tensors(shape: &Shape, vocab: u64, base: GgmlType) -> Vec<TensorPlan> {
    let d = shape.hidden as u64;
    let mut out = Vec::new();
    let mut mat = |name: String, dims: &[u64], is_output: bool, sd: f32| {
        let ty = matrix_type(base, dims[0], is_output);
        out.push(TensorPlan {
            name,
            dims: dims.to_vec(),
            ty,
            fill: Fill::Normal(sd),
        });
    };
    let inv = |n: u64| 1.0 / (n as f32).sqrt();
    mat("token_embd.weight".into(), &[d, vocab], false, 1.0);
    let mut rest: Vec<TensorPlan> = Vec::new();
    let f32t = |name: String, dims: &[u64], fill: Fill| TensorPlan {
        name,
        dims: dims.to_vec(),
        ty: GgmlType::F32,
        fill,
    };
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
    for l in 0..shape.layers {
        let p = |s: &str| format!("blk.{l}.{s}");
        rest.push(f32t(p("attn_norm.weight"), &[d], Fill::Norm(0.1)));
        if shape.is_full_attention(l) {
            let q_rows = if shape.arch.is_hybrid() {
                2 * hq * hd
            } else {
                hq * hd
            };
            let mut m = |s: &str, dims: &[u64], sd| {
                rest.push(TensorPlan {
                    name: p(s),
                    dims: dims.to_vec(),
                    ty: matrix_type(base, dims[0], false),
                    fill: Fill::Normal(sd),
                })
            };
            m("attn_q.weight", &[d, q_rows], inv(d));
            m("attn_k.weight", &[d, hkv * hd], inv(d));
            m("attn_v.weight", &[d, hkv * hd], inv(d));
            m("attn_output.weight", &[hq * hd, d], inv(hq * hd));
            rest.push(f32t(p("attn_q_norm.weight"), &[hd], Fill::Norm(0.1)));
            rest.push(f32t(p("attn_k_norm.weight"), &[hd], Fill::Norm(0.1)));
        } else {
            let dn = shape.delta.expect("hybrid shapes have delta-net sizes");
            let hv = dn.value_heads as u64;
            let mut m = |s: &str, dims: &[u64], sd| {
                rest.push(TensorPlan {
                    name: p(s),
                    dims: dims.to_vec(),
                    ty: matrix_type(base, dims[0], false),
                    fill: Fill::Normal(sd),
                })
            };
            m("attn_qkv.weight", &[d, dn.conv_dim()], inv(d));
            m("attn_gate.weight", &[d, dn.inner_size()], inv(d));
            match shape.arch {
                Arch::Qwen3Next => m("ssm_ba.weight", &[d, 2 * hv], inv(d)),
                _ => {
                    m("ssm_beta.weight", &[d, hv], inv(d));
                    m("ssm_alpha.weight", &[d, hv], inv(d));
                }
            }
            rest.push(f32t(
                p("ssm_conv1d.weight"),
                &[dn.conv_kernel as u64, dn.conv_dim()],
                Fill::Normal(0.5),
            ));
            rest.push(f32t(p("ssm_dt.bias"), &[hv], Fill::Uniform(-1.0, 1.0)));
            rest.push(f32t(p("ssm_a"), &[hv], Fill::NegExp(16.0)));
            rest.push(f32t(
                p("ssm_norm.weight"),
                &[dn.value_head_dim as u64],
                Fill::Norm(0.1),
            ));
            let ssm_out_in = dn.inner_size();
            rest.push(TensorPlan {
                name: p("ssm_out.weight"),
                dims: vec![ssm_out_in, d],
                ty: matrix_type(base, ssm_out_in, false),
                fill: Fill::Normal(inv(ssm_out_in)),
            });
        }
        let post = if shape.arch.is_hybrid() {
            "post_attention_norm.weight"
        } else {
            "ffn_norm.weight"
        };
        rest.push(f32t(p(post), &[d], Fill::Norm(0.1)));
        rest.push(f32t(
            p("ffn_gate_inp.weight"),
            &[d, e],
            Fill::Normal(inv(d)),
        ));
        let mut m = |s: &str, dims: &[u64], sd| {
            rest.push(TensorPlan {
                name: p(s),
                dims: dims.to_vec(),
                ty: matrix_type(base, dims[0], false),
                fill: Fill::Normal(sd),
            })
        };
        m("ffn_gate_exps.weight", &[d, f, e], inv(d));
        m("ffn_up_exps.weight", &[d, f, e], inv(d));
        m("ffn_down_exps.weight", &[f, d, e], inv(f));
        if fs > 0 {
            m("ffn_gate_shexp.weight", &[d, fs], inv(d));
            m("ffn_up_shexp.weight", &[d, fs], inv(d));
            m("ffn_down_shexp.weight", &[fs, d], inv(fs));
            rest.push(f32t(
                p("ffn_gate_inp_shexp.weight"),
                &[d],
                Fill::Normal(inv(d)),
            ));
        }
    }
    out.extend(rest);
    out.push(f32t("output_norm.weight".into(), &[d], Fill::Norm(0.1)));
    let ty = matrix_type(base, d, true);
    out.push(TensorPlan {
        name: "output.weight".into(),
        dims: vec![d, vocab],
        ty,
        fill: Fill::Normal(inv(d)),
    });
    out
}
