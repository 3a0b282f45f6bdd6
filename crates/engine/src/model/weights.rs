//! Binding GGUF tensors to the model's weights, with shape checks.
//!
//! Every expected tensor is looked up and checked (presence, dims, a type with a
//! kernel); all problems are collected and reported in one error, with expected
//! versus found dims. Matrices stay in the mmap: a [`Matrix`] is a typed view
//! (offset and geometry), never a copy. Only small vectors (norm weights, conv
//! taps, gates) are read into `Vec<f32>`.

use super::hparams::{Arch, HParams, LayerKind};
use crate::error::{EngineError, Result};
use samesum_gguf::{GgmlType, GgufFile, TensorInfo};
use samesum_quant::{dequant, dot};

/// A weight matrix (or a stack of expert matrices) in the mapped file.
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    /// Tensor name.
    pub name: String,
    /// Storage type.
    pub ty: GgmlType,
    /// Input length (ne0).
    pub cols: usize,
    /// Output rows per matrix (ne1).
    pub rows: usize,
    /// Number of stacked matrices (experts, ne2), 1 for plain matrices.
    pub n_mats: usize,
    /// Absolute offset of the data in the file.
    pub offset: usize,
    /// Bytes of one row.
    pub row_bytes: usize,
}

impl Matrix {
    /// The bytes of row `r` of matrix `mat` (expert), from the file's bytes.
    #[inline]
    pub fn row<'a>(&self, file: &'a [u8], mat: usize, r: usize) -> &'a [u8] {
        let start = self.offset + (mat * self.rows + r) * self.row_bytes;
        &file[start..start + self.row_bytes]
    }

    /// The bytes of matrix `mat`.
    pub fn mat_bytes<'a>(&self, file: &'a [u8], mat: usize) -> &'a [u8] {
        let start = self.offset + mat * self.rows * self.row_bytes;
        &file[start..start + self.rows * self.row_bytes]
    }
}

/// Attention weights of one layer.
#[derive(Clone, Debug)]
pub struct AttentionW {
    /// Query projection; for hybrid archs rows are per head `[q | gate]`.
    pub q: Matrix,
    /// Key projection.
    pub k: Matrix,
    /// Value projection.
    pub v: Matrix,
    /// Output projection.
    pub o: Matrix,
    /// Per-head query norm (GGUF form: multiply as is).
    pub q_norm: Vec<f32>,
    /// Per-head key norm.
    pub k_norm: Vec<f32>,
    /// Whether the query projection carries an output gate per head.
    pub gated: bool,
}

/// The input projections of a delta-net layer.
#[derive(Clone, Debug)]
pub enum DeltaInput {
    /// Current layout: `attn_qkv` (rows q | k | v) and `attn_gate` (z).
    Split {
        /// q, k, v rows.
        qkv: Matrix,
        /// z rows.
        z: Matrix,
    },
    /// qwen3next legacy: `ssm_in` with rows per key group `[q_g | k_g | v_g | z_g]`.
    Fused {
        /// The fused projection.
        ssm_in: Matrix,
    },
}

/// beta and alpha projections of a delta-net layer.
#[derive(Clone, Debug)]
pub enum DeltaBa {
    /// qwen3next `ssm_ba`: per key group `[b (ratio) | a (ratio)]`.
    Fused(Matrix),
    /// qwen35moe `ssm_beta` and `ssm_alpha`.
    Split {
        /// beta rows.
        beta: Matrix,
        /// alpha rows.
        alpha: Matrix,
    },
}

/// Gated delta-net weights of one layer.
#[derive(Clone, Debug)]
pub struct DeltaNetW {
    /// Input projections.
    pub input: DeltaInput,
    /// beta/alpha projections.
    pub ba: DeltaBa,
    /// Conv taps, `conv[c * Kc + j]`, `j = Kc - 1` multiplies the current token.
    pub conv: Vec<f32>,
    /// `ssm_dt.bias`, per value head.
    pub dt_bias: Vec<f32>,
    /// `ssm_a` = -exp(A_log), per value head.
    pub a: Vec<f32>,
    /// Gated-norm weight, per value dim (shared by heads).
    pub norm: Vec<f32>,
    /// Output projection.
    pub out: Matrix,
}

/// The token mixer of a layer.
#[derive(Clone, Debug)]
pub enum Mixer {
    /// Full attention.
    Attention(AttentionW),
    /// Gated delta net.
    Linear(DeltaNetW),
}

/// The shared expert (hybrid archs).
#[derive(Clone, Debug)]
pub struct SharedW {
    /// Gate projection.
    pub gate: Matrix,
    /// Up projection.
    pub up: Matrix,
    /// Down projection.
    pub down: Matrix,
    /// Scalar gate `sigmoid(gate_inp · x)`, as a 1-row matrix.
    pub gate_inp: Matrix,
}

/// MoE weights of one layer.
#[derive(Clone, Debug)]
pub struct MoeW {
    /// Router, E rows of D.
    pub router: Matrix,
    /// Expert gate projections, E matrices of F rows.
    pub gate: Matrix,
    /// Expert up projections.
    pub up: Matrix,
    /// Expert down projections, E matrices of D rows of F.
    pub down: Matrix,
    /// Shared expert.
    pub shared: Option<SharedW>,
}

/// One trunk layer.
#[derive(Clone, Debug)]
pub struct LayerW {
    /// Pre-mixer norm.
    pub attn_norm: Vec<f32>,
    /// Token mixer.
    pub mixer: Mixer,
    /// Pre-MoE norm (`ffn_norm` or `post_attention_norm`).
    pub ffn_norm: Vec<f32>,
    /// MoE.
    pub moe: MoeW,
}

/// All weights of a model.
#[derive(Clone, Debug)]
pub struct Weights {
    /// Token embeddings, vocab rows of D.
    pub token_embd: Matrix,
    /// Trunk layers.
    pub layers: Vec<LayerW>,
    /// Final norm.
    pub output_norm: Vec<f32>,
    /// LM head (the embeddings when tied).
    pub output: Matrix,
    /// Vocabulary size (rows of the embeddings).
    pub n_vocab: usize,
}

struct Binder<'a> {
    file: &'a GgufFile,
    problems: Vec<String>,
}

fn dims_str(d: &[u64]) -> String {
    format!(
        "[{}]",
        d.iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    )
}

impl<'a> Binder<'a> {
    fn info(&mut self, name: &str) -> Option<&'a TensorInfo> {
        match self.file.tensor(name) {
            Ok(t) => Some(t),
            Err(_) => {
                self.problems.push(format!("{name}: missing"));
                None
            }
        }
    }

    fn check_dims(&mut self, t: &TensorInfo, want: &[&[u64]]) -> bool {
        if want.iter().any(|w| t.dims == *w) {
            return true;
        }
        self.problems.push(format!(
            "{}: expected dims {}, found {}",
            t.name,
            want.iter()
                .map(|w| dims_str(w))
                .collect::<Vec<_>>()
                .join(" or "),
            dims_str(&t.dims)
        ));
        false
    }

    /// A stack of `n` matrices of `rows` x `cols` (n = 1: a plain 2-D matrix).
    fn matrix_n(&mut self, name: &str, cols: usize, rows: usize, n: usize) -> Option<Matrix> {
        let t = self.info(name)?;
        let (c, r, e) = (cols as u64, rows as u64, n as u64);
        let ok = if n == 1 && rows == 1 {
            // One-row matrices (the shared-expert gate) are also written as [cols].
            self.check_dims(t, &[&[c, r], &[c, r, 1], &[c]])
        } else if n == 1 {
            self.check_dims(t, &[&[c, r], &[c, r, 1]])
        } else {
            self.check_dims(t, &[&[c, r, e]])
        };
        if !ok {
            return None;
        }
        if dot::act_type(t.ggml_type).is_none() {
            self.problems
                .push(format!("{name}: type {} has no matmul kernel", t.ggml_type));
            return None;
        }
        Some(Matrix {
            name: name.to_string(),
            ty: t.ggml_type,
            cols,
            rows,
            n_mats: n,
            offset: (self.file.header().data_start + t.offset) as usize,
            row_bytes: t.ggml_type.row_bytes(c).expect("checked by the reader") as usize,
        })
    }

    fn matrix(&mut self, name: &str, cols: usize, rows: usize) -> Option<Matrix> {
        self.matrix_n(name, cols, rows, 1)
    }

    /// A vector of `len` values, stored as `[len]` or `[len, 1]`; or, with `cols`,
    /// a small 2-D array `[cols, len/cols]`.
    fn vector_dims(&mut self, name: &str, want: &[&[u64]]) -> Option<Vec<f32>> {
        let t = self.info(name)?;
        if !self.check_dims(t, want) {
            return None;
        }
        if !dequant::can_dequantize(t.ggml_type) {
            self.problems
                .push(format!("{name}: type {} cannot be read", t.ggml_type));
            return None;
        }
        let mut v = vec![0f32; t.n_elements() as usize];
        match dequant::dequantize(t.ggml_type, self.file.data_of(t), &mut v) {
            Ok(()) => {
                // Norm weights, conv taps and gates of a real model are
                // finite; a NaN here would turn every output into noise.
                let bad = v.iter().filter(|x| !x.is_finite()).count();
                if bad > 0 {
                    self.problems
                        .push(format!("{name}: {bad} values are NaN or infinite"));
                    return None;
                }
                Some(v)
            }
            Err(e) => {
                self.problems.push(format!("{name}: {e}"));
                None
            }
        }
    }

    fn vector(&mut self, name: &str, len: usize) -> Option<Vec<f32>> {
        let l = len as u64;
        self.vector_dims(name, &[&[l], &[l, 1]])
    }
}

impl Weights {
    /// Bind every tensor of `hp`'s architecture in `file`.
    pub fn bind(file: &GgufFile, hp: &HParams) -> Result<Weights> {
        let mut b = Binder {
            file,
            problems: Vec::new(),
        };
        let d = hp.n_embd;
        let embd_t = b.info("token_embd.weight");
        let n_vocab = embd_t.and_then(|t| t.dims.get(1)).copied().unwrap_or(0) as usize;
        let token_embd = b.matrix("token_embd.weight", d, n_vocab);
        if let Some(t) = &token_embd
            && !dequant::can_dequantize(t.ty)
        {
            b.problems
                .push(format!("token_embd.weight: type {} cannot be read", t.ty));
        }
        let output_norm = b.vector("output_norm.weight", d);
        let output = if file.has_tensor("output.weight") {
            b.matrix("output.weight", d, n_vocab)
        } else {
            token_embd.clone()
        };
        let mut layers = Vec::with_capacity(hp.n_layer);
        let (hq, hkv, hd) = (hp.n_head, hp.n_head_kv, hp.head_dim);
        let (e, f) = (hp.n_expert, hp.n_ff_exp);
        for (l, kind) in hp.layers.iter().enumerate() {
            let p = |s: &str| format!("blk.{l}.{s}");
            let attn_norm = b.vector(&p("attn_norm.weight"), d);
            let mixer = match kind {
                LayerKind::Attention => {
                    let gated = hp.arch.is_hybrid();
                    let q_rows = if gated { 2 * hq * hd } else { hq * hd };
                    let q = b.matrix(&p("attn_q.weight"), d, q_rows);
                    let k = b.matrix(&p("attn_k.weight"), d, hkv * hd);
                    let v = b.matrix(&p("attn_v.weight"), d, hkv * hd);
                    let o = b.matrix(&p("attn_output.weight"), hq * hd, d);
                    let q_norm = b.vector(&p("attn_q_norm.weight"), hd);
                    let k_norm = b.vector(&p("attn_k_norm.weight"), hd);
                    match (q, k, v, o, q_norm, k_norm) {
                        (Some(q), Some(k), Some(v), Some(o), Some(q_norm), Some(k_norm)) => {
                            Some(Mixer::Attention(AttentionW {
                                q,
                                k,
                                v,
                                o,
                                q_norm,
                                k_norm,
                                gated,
                            }))
                        }
                        _ => None,
                    }
                }
                LayerKind::Linear => {
                    let s = hp.ssm.expect("hybrid archs have delta-net sizes");
                    let (kd, vd, hv) = (s.key_dim(), s.value_dim(), s.n_v_heads);
                    let conv_dim = s.conv_dim();
                    let input =
                        if file.has_tensor(&p("attn_qkv.weight")) || hp.arch == Arch::Qwen35Moe {
                            let qkv = b.matrix(&p("attn_qkv.weight"), d, conv_dim);
                            let z = b.matrix(&p("attn_gate.weight"), d, vd);
                            qkv.zip(z).map(|(qkv, z)| DeltaInput::Split { qkv, z })
                        } else {
                            b.matrix(&p("ssm_in.weight"), d, 2 * kd + 2 * vd)
                                .map(|ssm_in| DeltaInput::Fused { ssm_in })
                        };
                    let ba = match hp.arch {
                        Arch::Qwen3Next => {
                            b.matrix(&p("ssm_ba.weight"), d, 2 * hv).map(DeltaBa::Fused)
                        }
                        _ => {
                            let beta = b.matrix(&p("ssm_beta.weight"), d, hv);
                            let alpha = b.matrix(&p("ssm_alpha.weight"), d, hv);
                            beta.zip(alpha)
                                .map(|(beta, alpha)| DeltaBa::Split { beta, alpha })
                        }
                    };
                    let kc = s.d_conv as u64;
                    let conv = b.vector_dims(&p("ssm_conv1d.weight"), &[&[kc, conv_dim as u64]]);
                    let dt_bias = b.vector(&p("ssm_dt.bias"), hv);
                    let a = b.vector(&p("ssm_a"), hv);
                    let norm = b.vector(&p("ssm_norm.weight"), s.head_v_dim);
                    let out = b.matrix(&p("ssm_out.weight"), vd, d);
                    match (input, ba, conv, dt_bias, a, norm, out) {
                        (
                            Some(input),
                            Some(ba),
                            Some(conv),
                            Some(dt_bias),
                            Some(a),
                            Some(norm),
                            Some(out),
                        ) => Some(Mixer::Linear(DeltaNetW {
                            input,
                            ba,
                            conv,
                            dt_bias,
                            a,
                            norm,
                            out,
                        })),
                        _ => None,
                    }
                }
            };
            let post = if hp.arch.is_hybrid() {
                "post_attention_norm.weight"
            } else {
                "ffn_norm.weight"
            };
            let ffn_norm = b.vector(&p(post), d);
            let router = b.matrix(&p("ffn_gate_inp.weight"), d, e);
            let gate = b.matrix_n(&p("ffn_gate_exps.weight"), d, f, e);
            let up = b.matrix_n(&p("ffn_up_exps.weight"), d, f, e);
            let down = b.matrix_n(&p("ffn_down_exps.weight"), f, d, e);
            let shared = if hp.n_ff_shexp > 0 {
                let fs = hp.n_ff_shexp;
                let sg = b.matrix(&p("ffn_gate_shexp.weight"), d, fs);
                let su = b.matrix(&p("ffn_up_shexp.weight"), d, fs);
                let sd = b.matrix(&p("ffn_down_shexp.weight"), fs, d);
                let gi = b.matrix(&p("ffn_gate_inp_shexp.weight"), d, 1);
                match (sg, su, sd, gi) {
                    (Some(gate), Some(up), Some(down), Some(gate_inp)) => Some(Some(SharedW {
                        gate,
                        up,
                        down,
                        gate_inp,
                    })),
                    _ => None,
                }
            } else {
                Some(None)
            };
            if let (
                Some(attn_norm),
                Some(mixer),
                Some(ffn_norm),
                Some(router),
                Some(gate),
                Some(up),
                Some(down),
                Some(shared),
            ) = (attn_norm, mixer, ffn_norm, router, gate, up, down, shared)
            {
                layers.push(LayerW {
                    attn_norm,
                    mixer,
                    ffn_norm,
                    moe: MoeW {
                        router,
                        gate,
                        up,
                        down,
                        shared,
                    },
                });
            }
        }
        if !b.problems.is_empty() || layers.len() != hp.n_layer {
            if b.problems.is_empty() {
                b.problems.push("some layers could not be bound".into());
            }
            return Err(EngineError::Tensors(b.problems));
        }
        Ok(Weights {
            token_embd: token_embd.expect("no problems"),
            layers,
            output_norm: output_norm.expect("no problems"),
            output: output.expect("no problems"),
            n_vocab,
        })
    }
}
