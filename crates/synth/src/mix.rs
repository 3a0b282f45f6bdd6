//! Per-tensor type layouts ("mixes") of real quantized files, for `synth --mix`.
//!
//! A quantized GGUF file is not one type throughout: `llama-quantize` picks each
//! tensor's type from the requested file type (its `ftype`), the tensor's role
//! (attention value, expert down projection, output head, ...), its position in
//! the model and its row length. This module reproduces that selection, from
//! llama.cpp's `src/llama-quant.cpp`:
//!
//! - which tensors may be quantized at all (`tensor_allows_quantization`): 2-D
//!   and 3-D tensors whose name ends in `weight`, except norms, the expert router
//!   (`ffn_gate_inp`) and the delta net's `ssm_conv1d`; the others keep their
//!   source type (F32 here, as the converter writes them);
//! - the role of a tensor (`tensor_get_category`), from substrings of its name;
//! - the default type of each file type (`llama_ftype_get_default_type`);
//! - the per-role rules (`llama_tensor_get_type_impl`), with the running
//!   counters of attention-value and ffn_down tensors that llama.cpp keeps in
//!   the order it visits tensors (`init_quantize_state_counters` and the
//!   loader's order: tensors outside blocks first, then block by block, by name
//!   within a block);
//! - the fallback when a row is not a whole number of the type's blocks
//!   (`tensor_type_fallback`).
//!
//! Only the branches that can fire for the file types offered here are carried
//! over; branches for other file types test for those types and so cannot
//! change these results. The Falcon and 70B special cases never apply to the
//! architectures synth writes and are left out.
//!
//! One more preset, [`Mix::UdQ4KXl`], follows the published layout of the
//! dynamic "UD-Q4_K_XL" uploads approximately; it is not a `llama-quantize`
//! file type.

use crate::SynthError;
use crate::plan::TensorPlan;
use crate::shapes::Shape;
use samesum_gguf::GgmlType;

/// A llama.cpp file type (`LLAMA_FTYPE_MOSTLY_*` in `include/llama.h`) whose
/// `llama-quantize` layout a preset reproduces.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Ftype {
    /// Q4_K_M (15).
    Q4_K_M,
    /// Q5_K_M (17).
    Q5_K_M,
    /// Q6_K (18).
    Q6_K,
    /// Q8_0 (7).
    Q8_0,
    /// IQ4_XS (30).
    IQ4_XS,
    /// IQ4_NL (25).
    IQ4_NL,
    /// MXFP4_MOE (38): expert tensors MXFP4, the rest Q8_0.
    MXFP4_MOE,
    /// Q2_K (10).
    Q2_K,
    /// Q3_K_M (12).
    Q3_K_M,
    /// IQ2_XXS (19).
    IQ2_XXS,
    /// IQ2_M (29).
    IQ2_M,
    /// IQ3_XXS (23).
    IQ3_XXS,
    /// IQ3_S (26).
    IQ3_S,
    /// BF16 (32).
    BF16,
}

impl Ftype {
    /// The `LLAMA_FTYPE` number, written as `general.file_type`.
    pub fn id(self) -> u32 {
        match self {
            Ftype::Q8_0 => 7,
            Ftype::Q2_K => 10,
            Ftype::Q3_K_M => 12,
            Ftype::Q4_K_M => 15,
            Ftype::Q5_K_M => 17,
            Ftype::Q6_K => 18,
            Ftype::IQ2_XXS => 19,
            Ftype::IQ3_XXS => 23,
            Ftype::IQ4_NL => 25,
            Ftype::IQ3_S => 26,
            Ftype::IQ2_M => 29,
            Ftype::IQ4_XS => 30,
            Ftype::BF16 => 32,
            Ftype::MXFP4_MOE => 38,
        }
    }

    /// The type a tensor gets when no rule picks another
    /// (`llama_ftype_get_default_type`).
    pub fn default_type(self) -> GgmlType {
        match self {
            Ftype::Q4_K_M => GgmlType::Q4_K,
            Ftype::Q5_K_M => GgmlType::Q5_K,
            Ftype::Q6_K => GgmlType::Q6_K,
            Ftype::Q8_0 => GgmlType::Q8_0,
            Ftype::IQ4_XS => GgmlType::IQ4_XS,
            Ftype::IQ4_NL => GgmlType::IQ4_NL,
            Ftype::MXFP4_MOE => GgmlType::MXFP4,
            Ftype::Q2_K => GgmlType::Q2_K,
            Ftype::Q3_K_M => GgmlType::Q3_K,
            Ftype::IQ2_XXS => GgmlType::IQ2_XXS,
            Ftype::IQ2_M => GgmlType::IQ2_S,
            Ftype::IQ3_XXS => GgmlType::IQ3_XXS,
            Ftype::IQ3_S => GgmlType::IQ3_S,
            Ftype::BF16 => GgmlType::BF16,
        }
    }

    /// Whether published files of this type are made with an importance
    /// matrix, which some rules read: true for the i-quants.
    pub fn has_imatrix(self) -> bool {
        matches!(
            self,
            Ftype::IQ4_XS
                | Ftype::IQ4_NL
                | Ftype::IQ2_XXS
                | Ftype::IQ2_M
                | Ftype::IQ3_XXS
                | Ftype::IQ3_S
        )
    }
}

/// A `synth --mix` preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mix {
    /// The layout `llama-quantize` writes for this file type.
    Quantize(Ftype),
    /// The dynamic UD-Q4_K_XL uploads' layout, approximately: expert gate/up
    /// Q4_K, expert down Q5_K (Q6_K in the last eighth of the layers),
    /// attention, delta-net projections and shared expert Q8_0, token
    /// embedding Q4_K, output Q6_K.
    UdQ4KXl,
}

/// Every preset, in the order the help lists them.
pub const ALL: &[Mix] = &[
    Mix::Quantize(Ftype::Q4_K_M),
    Mix::Quantize(Ftype::Q5_K_M),
    Mix::Quantize(Ftype::Q6_K),
    Mix::Quantize(Ftype::Q8_0),
    Mix::Quantize(Ftype::IQ4_XS),
    Mix::Quantize(Ftype::IQ4_NL),
    Mix::Quantize(Ftype::MXFP4_MOE),
    Mix::Quantize(Ftype::Q3_K_M),
    Mix::Quantize(Ftype::Q2_K),
    Mix::Quantize(Ftype::IQ3_S),
    Mix::Quantize(Ftype::IQ3_XXS),
    Mix::Quantize(Ftype::IQ2_M),
    Mix::Quantize(Ftype::IQ2_XXS),
    Mix::Quantize(Ftype::BF16),
    Mix::UdQ4KXl,
];

impl Mix {
    /// The preset's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Mix::Quantize(f) => match f {
                Ftype::Q4_K_M => "q4_k_m",
                Ftype::Q5_K_M => "q5_k_m",
                Ftype::Q6_K => "q6_k",
                Ftype::Q8_0 => "q8_0",
                Ftype::IQ4_XS => "iq4_xs",
                Ftype::IQ4_NL => "iq4_nl",
                Ftype::MXFP4_MOE => "mxfp4",
                Ftype::Q2_K => "q2_k",
                Ftype::Q3_K_M => "q3_k_m",
                Ftype::IQ2_XXS => "iq2_xxs",
                Ftype::IQ2_M => "iq2_m",
                Ftype::IQ3_XXS => "iq3_xxs",
                Ftype::IQ3_S => "iq3_s",
                Ftype::BF16 => "bf16",
            },
            Mix::UdQ4KXl => "ud-q4_k_xl",
        }
    }

    /// The preset named `name` (case-insensitive; `mxfp4_moe` is `mxfp4`).
    pub fn from_name(name: &str) -> Option<Mix> {
        let name = name.to_ascii_lowercase();
        let name = if name == "mxfp4_moe" { "mxfp4" } else { &name };
        ALL.iter().copied().find(|m| m.name() == name)
    }

    /// One line on where the preset's layout comes from.
    pub fn about(self) -> &'static str {
        match self {
            Mix::Quantize(f) => match f {
                Ftype::Q4_K_M => {
                    "llama-quantize Q4_K_M: Q4_K; attn_v/attn_qkv and ffn_down Q6_K in its use_more_bits layers; output Q6_K"
                }
                Ftype::Q5_K_M => {
                    "llama-quantize Q5_K_M: Q5_K; attn_v/attn_qkv and ffn_down Q6_K in its use_more_bits layers; output Q6_K"
                }
                Ftype::Q6_K => "llama-quantize Q6_K: every matrix Q6_K",
                Ftype::Q8_0 => "llama-quantize Q8_0: every matrix Q8_0",
                Ftype::IQ4_XS => {
                    "llama-quantize IQ4_XS (imatrix): IQ4_XS; attn_v/attn_qkv Q5_K; output Q6_K"
                }
                Ftype::IQ4_NL => {
                    "llama-quantize IQ4_NL (imatrix): IQ4_NL; attn_v/attn_qkv Q5_K; output Q6_K"
                }
                Ftype::MXFP4_MOE => {
                    "llama-quantize MXFP4_MOE: expert tensors MXFP4, everything else Q8_0"
                }
                Ftype::Q2_K => {
                    "llama-quantize Q2_K: Q2_K; attn_v/attn_qkv Q4_K; ffn_down and attn_output Q3_K; output Q6_K"
                }
                Ftype::Q3_K_M => {
                    "llama-quantize Q3_K_M: Q3_K; attn_v/attn_qkv and ffn_down Q5_K early, then Q4_K; attn_output Q4_K; output Q6_K"
                }
                Ftype::IQ2_XXS => {
                    "llama-quantize IQ2_XXS (imatrix): IQ2_XXS; first eighth of ffn_down Q2_K; attn_v/attn_qkv Q4_K; output Q5_K"
                }
                Ftype::IQ2_M => {
                    "llama-quantize IQ2_M (imatrix): IQ2_S; first eighth of ffn_down and attn_output IQ3_S; attn_v/attn_qkv Q4_K; output Q5_K"
                }
                Ftype::IQ3_XXS => {
                    "llama-quantize IQ3_XXS (imatrix): IQ3_XXS; attn_q/attn_k IQ2_S; attn_v/attn_qkv Q4_K; attn_output IQ3_S; output Q5_K"
                }
                Ftype::IQ3_S => {
                    "llama-quantize IQ3_S (imatrix): IQ3_S; attn_v/attn_qkv Q4_K; output Q6_K"
                }
                Ftype::BF16 => {
                    "llama-quantize BF16 (or the converter's --outtype bf16): every matrix BF16"
                }
            },
            Mix::UdQ4KXl => {
                "approximates the UD-Q4_K_XL uploads' published layout (not a llama-quantize type): experts Q4_K, expert down Q5_K (Q6_K in the last eighth), attention, delta net and shared expert Q8_0"
            }
        }
    }

    /// `general.file_type`: the file type's `LLAMA_FTYPE` number; Q4_K_M (15)
    /// for the dynamic preset, as those files are made from Q4_K_M.
    pub fn file_type(self) -> u32 {
        match self {
            Mix::Quantize(f) => f.id(),
            Mix::UdQ4KXl => Ftype::Q4_K_M.id(),
        }
    }

    /// Whether the layout assumes an importance matrix (see [`Ftype::has_imatrix`]).
    pub fn has_imatrix(self) -> bool {
        match self {
            Mix::Quantize(f) => f.has_imatrix(),
            Mix::UdQ4KXl => false,
        }
    }
}

impl std::fmt::Display for Mix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The names of all presets.
pub fn names() -> Vec<&'static str> {
    ALL.iter().map(|m| m.name()).collect()
}

/// A tensor's role, from its name (llama.cpp's `tensor_category`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Category {
    /// `token_embd.weight`.
    TokenEmbd,
    /// `attn_q.weight`.
    AttnQ,
    /// `attn_v.weight`.
    AttnV,
    /// `attn_k.weight`.
    AttnK,
    /// `attn_qkv.weight` (here: the delta net's fused in-projection).
    AttnQkv,
    /// `attn_kv_b.weight`.
    AttnKvB,
    /// `attn_output.weight`.
    AttnOutput,
    /// Any `ffn_up*`.
    FfnUp,
    /// Any `ffn_gate*` (the router too, which is never quantized).
    FfnGate,
    /// Any `ffn_down*`.
    FfnDown,
    /// `output.weight`.
    Output,
    /// Everything else.
    Other,
}

impl Category {
    /// The role of tensor `name`, tested in llama.cpp's order.
    pub fn of(name: &str) -> Category {
        if name == "output.weight" {
            return Category::Output;
        }
        if name == "token_embd.weight" || name == "per_layer_token_embd.weight" {
            return Category::TokenEmbd;
        }
        const BY_SUBSTRING: [(&str, Category); 9] = [
            ("attn_qkv.weight", Category::AttnQkv),
            ("attn_kv_b.weight", Category::AttnKvB),
            ("attn_v.weight", Category::AttnV),
            ("attn_k.weight", Category::AttnK),
            ("attn_q.weight", Category::AttnQ),
            ("attn_output.weight", Category::AttnOutput),
            ("ffn_up", Category::FfnUp),
            ("ffn_gate", Category::FfnGate),
            ("ffn_down", Category::FfnDown),
        ];
        BY_SUBSTRING
            .iter()
            .find(|(s, _)| name.contains(s))
            .map_or(Category::Other, |&(_, c)| c)
    }

    /// Whether the rules treat it as an attention value projection
    /// (`category_is_attn_v`): attn_v, attn_qkv and attn_kv_b.
    pub fn is_attn_v(self) -> bool {
        matches!(
            self,
            Category::AttnV | Category::AttnQkv | Category::AttnKvB
        )
    }
}

/// ggml's `ggml_n_dims`: the number of dimensions up to the last one above 1.
fn n_dims(dims: &[u64]) -> usize {
    dims.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1)
}

/// Whether `llama-quantize` may change the type of this tensor
/// (`tensor_allows_quantization`, the checks that concern these architectures).
pub fn allows_quantization(name: &str, dims: &[u64]) -> bool {
    n_dims(dims) >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && !name.contains("ssm_conv1d")
}

/// The layer number of a `blk.N.` tensor name.
fn layer_of(name: &str) -> Option<i64> {
    let rest = name.strip_prefix("blk.")?;
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The order llama-quantize visits tensors in (its loader's name order):
/// tensors outside the blocks first, then block by block, by name within each.
fn visit_order(plan: &[TensorPlan]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..plan.len()).collect();
    order.sort_by(|&a, &b| {
        let key = |t: &TensorPlan| (layer_of(&t.name).unwrap_or(-1), t.name.clone());
        key(&plan[a]).cmp(&key(&plan[b]))
    });
    order
}

/// Where a tensor's row length is not a whole number of `target`'s blocks,
/// the type llama.cpp falls back to (`tensor_type_fallback`): IQ4_NL for the
/// 256-element i-quants, Q4_0 for Q2_K/Q3_K, Q5_0 for Q4_K, Q5_1 for Q5_K,
/// Q8_0 for Q6_K; F16 when even that does not fit.
pub fn fallback(target: GgmlType, ncols: u64) -> Result<GgmlType, SynthError> {
    use GgmlType::*;
    let fits = |t: GgmlType| ncols.is_multiple_of(t.block_size() as u64);
    if fits(target) {
        return Ok(target);
    }
    let to = match target {
        IQ1_S | IQ1_M | IQ2_XXS | IQ2_XS | IQ2_S | IQ3_XXS | IQ3_S | IQ4_XS => IQ4_NL,
        Q2_K | Q3_K | TQ1_0 | TQ2_0 => Q4_0,
        Q4_K => Q5_0,
        Q5_K => Q5_1,
        Q6_K => Q8_0,
        t if t.block_size() <= 32 => t,
        t => {
            return Err(SynthError::Invalid(format!(
                "no fallback type for {t} on a row of {ncols}"
            )));
        }
    };
    Ok(if fits(to) { to } else { F16 })
}

/// The model facts the rules read (llama.cpp's hparams).
#[derive(Clone, Copy, Debug)]
struct Hparams {
    /// Blocks (`n_layer_all`).
    n_layer: i64,
    /// Experts (`n_expert`).
    n_expert: i64,
    /// Query heads per KV head (`n_gqa()`; 0 without KV heads).
    n_gqa: i64,
}

/// llama.cpp's `quantize_state_impl`: the counters the rules read.
#[derive(Clone, Debug, Default)]
struct State {
    n_attention_wv: i64,
    i_attention_wv: i64,
    /// The block count (llama.cpp sets its `n_ffn_down`, `n_ffn_gate` and
    /// `n_ffn_up` to it).
    n_ffn_down: i64,
    i_ffn_down: i64,
    i_ffn_gate: i64,
    i_ffn_up: i64,
    has_imatrix: bool,
    has_tied_embeddings: bool,
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and
/// every third one between.
fn use_more_bits(i_layer: i64, n_layers: i64) -> bool {
    i_layer < n_layers / 8 || i_layer >= 7 * n_layers / 8 || (i_layer - n_layers / 8) % 3 == 2
}

/// The layer a rule uses for an ffn tensor (`layer_info`): the name's block
/// number when the model has experts (their tensors are not visited in a
/// fixed pattern), else the running counter.
fn layer_info(hp: Hparams, counter: i64, name: &str) -> Result<(i64, i64), SynthError> {
    let n_layer = hp.n_layer;
    if hp.n_expert <= 1 {
        return Ok((counter, n_layer));
    }
    let i_layer = layer_of(name)
        .ok_or_else(|| SynthError::Invalid(format!("no layer number in tensor name {name}")))?;
    if !(0..n_layer).contains(&i_layer) {
        return Err(SynthError::Invalid(format!(
            "layer {i_layer} of tensor {name} is outside [0, {n_layer})"
        )));
    }
    Ok((i_layer, n_layer))
}

/// `llama_tensor_get_type_impl` for the file types offered here: the type a
/// quantizable tensor gets, starting from the file type's default.
fn rule_type(
    qs: &mut State,
    hp: Hparams,
    ftype: Ftype,
    name: &str,
    dims: &[u64],
    category: Category,
) -> Result<GgmlType, SynthError> {
    use Ftype as F;
    use GgmlType as T;
    let mut new_type = ftype.default_type();
    let is_iq2 = matches!(ftype, F::IQ2_XXS | F::IQ2_M);
    if category == Category::Output || (qs.has_tied_embeddings && category == Category::TokenEmbd) {
        let nx = dims[0];
        if ftype == F::MXFP4_MOE || !nx.is_multiple_of(new_type.block_size() as u64) {
            new_type = T::Q8_0;
        } else if is_iq2 || ftype == F::IQ3_XXS {
            new_type = T::Q5_K;
        } else if new_type != T::Q8_0 {
            new_type = T::Q6_K;
        }
    } else if ftype == F::MXFP4_MOE {
        // Expert tensors (a third dimension above 1) MXFP4, the rest Q8_0.
        new_type = if dims.get(2).is_some_and(|&e| e > 1) {
            T::MXFP4
        } else {
            T::Q8_0
        };
    } else if category == Category::TokenEmbd {
        match ftype {
            F::IQ2_XXS => new_type = T::Q2_K,
            F::IQ2_M | F::IQ3_XXS => new_type = T::IQ3_S,
            _ => {}
        }
    } else if is_iq2 {
        if category.is_attn_v() {
            new_type = if hp.n_gqa >= 4 || hp.n_expert >= 4 {
                T::Q4_K
            } else if ftype == F::IQ2_M {
                T::IQ3_S
            } else {
                T::Q2_K
            };
            qs.i_attention_wv += 1;
        } else if hp.n_expert == 8 && category == Category::AttnK {
            new_type = T::Q4_K;
        } else if category == Category::FfnDown {
            // A running count over every ffn_down tensor (experts and shared
            // expert alike), not the layer number.
            if qs.i_ffn_down < qs.n_ffn_down / 8 {
                new_type = if ftype == F::IQ2_M { T::IQ3_S } else { T::Q2_K };
            }
            qs.i_ffn_down += 1;
        } else if category == Category::AttnOutput {
            if hp.n_expert == 8 {
                new_type = T::Q5_K;
            } else if ftype == F::IQ2_M {
                new_type = T::IQ3_S;
            }
        }
    } else if category.is_attn_v() {
        // attn_qkv lands here too, so llama.cpp's later rule for it (Q5_K for
        // Q4_K_M) is never reached.
        let gqa4 = hp.n_gqa >= 4;
        match ftype {
            F::Q2_K => new_type = if gqa4 { T::Q4_K } else { T::Q3_K },
            F::IQ3_XXS => {
                new_type = if gqa4 {
                    T::Q4_K
                } else if !qs.has_imatrix {
                    T::IQ3_S
                } else {
                    T::IQ3_XXS
                }
            }
            F::IQ3_S if gqa4 => new_type = T::Q4_K,
            F::Q3_K_M => {
                new_type = if qs.i_attention_wv < 2 {
                    T::Q5_K
                } else {
                    T::Q4_K
                }
            }
            F::IQ4_NL | F::IQ4_XS if gqa4 => new_type = T::Q5_K,
            F::Q4_K_M | F::Q5_K_M if use_more_bits(qs.i_attention_wv, qs.n_attention_wv) => {
                new_type = T::Q6_K
            }
            _ => {}
        }
        if hp.n_expert == 8 {
            new_type = T::Q8_0;
        }
        qs.i_attention_wv += 1;
    } else if category == Category::AttnK {
        if hp.n_expert == 8 {
            new_type = T::Q8_0;
        } else if ftype == F::IQ3_XXS {
            new_type = T::IQ2_S;
        }
    } else if category == Category::AttnQ {
        if ftype == F::IQ3_XXS {
            new_type = T::IQ2_S;
        }
    } else if category == Category::FfnDown {
        let (i_layer, n_layer) = layer_info(hp, qs.i_ffn_down, name)?;
        let first_eighth = i_layer < n_layer / 8;
        match ftype {
            F::Q2_K => new_type = T::Q3_K,
            F::IQ3_XXS if !qs.has_imatrix => {
                new_type = if first_eighth { T::Q4_K } else { T::Q3_K }
            }
            F::Q3_K_M => {
                new_type = if i_layer < n_layer / 16 {
                    T::Q5_K
                } else {
                    T::Q4_K
                }
            }
            F::Q4_K_M if use_more_bits(i_layer, n_layer) => new_type = T::Q6_K,
            F::IQ4_NL | F::IQ4_XS if first_eighth && !qs.has_imatrix => new_type = T::Q5_K,
            F::Q5_K_M if use_more_bits(i_layer, n_layer) => new_type = T::Q6_K,
            _ => {}
        }
        qs.i_ffn_down += 1;
    } else if category == Category::AttnOutput {
        if hp.n_expert == 8 {
            if matches!(
                ftype,
                F::Q2_K | F::IQ3_XXS | F::Q3_K_M | F::IQ4_NL | F::Q4_K_M | F::IQ3_S | F::IQ4_XS
            ) {
                new_type = T::Q5_K;
            }
        } else {
            match ftype {
                F::Q2_K => new_type = T::Q3_K,
                F::IQ3_XXS => new_type = T::IQ3_S,
                F::Q3_K_M => new_type = T::Q4_K,
                _ => {}
            }
        }
    } else if category == Category::FfnGate {
        // Only IQ3_XS has a rule here; the layer is still checked and counted.
        layer_info(hp, qs.i_ffn_gate, name)?;
        qs.i_ffn_gate += 1;
    } else if category == Category::FfnUp {
        layer_info(hp, qs.i_ffn_up, name)?;
        qs.i_ffn_up += 1;
    }
    Ok(new_type)
}

/// The dynamic UD-Q4_K_XL-style type of a quantizable tensor.
fn ud_q4_k_xl_type(name: &str, category: Category, n_layer: i64) -> GgmlType {
    use GgmlType as T;
    const Q8_0_PARTS: [&str; 11] = [
        "attn_q.weight",
        "attn_k.weight",
        "attn_v.weight",
        "attn_output.weight",
        "attn_qkv.weight",
        "attn_gate.weight",
        "ssm_ba.weight",
        "ssm_alpha.weight",
        "ssm_beta.weight",
        "ssm_out.weight",
        "_shexp.weight",
    ];
    match category {
        Category::TokenEmbd => T::Q4_K,
        Category::Output => T::Q6_K,
        Category::FfnDown if name.contains("_exps") => {
            let last_eighth = layer_of(name).is_some_and(|l| l >= 7 * n_layer / 8);
            if last_eighth { T::Q6_K } else { T::Q5_K }
        }
        _ if Q8_0_PARTS.iter().any(|p| name.contains(p)) => T::Q8_0,
        _ => T::Q4_K,
    }
}

/// Set the type of every tensor of `plan` (a model of `shape`, tensors in
/// their source types) to the one `mix` gives it.
pub fn apply(shape: &Shape, mix: Mix, plan: &mut [TensorPlan]) -> Result<(), SynthError> {
    let hp = Hparams {
        n_layer: shape.layers as i64,
        n_expert: (shape.experts as i64).max(1),
        n_gqa: shape.heads.checked_div(shape.kv_heads).unwrap_or(0) as i64,
    };
    let mut qs = State {
        n_attention_wv: plan
            .iter()
            .filter(|t| Category::of(&t.name).is_attn_v())
            .count() as i64,
        n_ffn_down: hp.n_layer,
        has_imatrix: mix.has_imatrix(),
        has_tied_embeddings: !plan.iter().any(|t| t.name == "output.weight"),
        ..State::default()
    };
    for i in visit_order(plan) {
        let t = &mut plan[i];
        if !allows_quantization(&t.name, &t.dims) {
            continue;
        }
        let category = Category::of(&t.name);
        let want = match mix {
            Mix::Quantize(ftype) => {
                let default = ftype.default_type();
                if default.block_size() == 1 {
                    // A float file type: every quantizable tensor takes it as is.
                    t.ty = default;
                    continue;
                }
                rule_type(&mut qs, hp, ftype, &t.name, &t.dims, category)?
            }
            Mix::UdQ4KXl => ud_q4_k_xl_type(&t.name, category, hp.n_layer),
        };
        t.ty = fallback(want, t.dims[0])?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_file_types_are_llamas() {
        for &m in ALL {
            assert_eq!(Mix::from_name(m.name()), Some(m));
            assert_eq!(Mix::from_name(&m.name().to_uppercase()), Some(m));
        }
        assert_eq!(
            Mix::from_name("MXFP4_MOE"),
            Some(Mix::Quantize(Ftype::MXFP4_MOE))
        );
        assert_eq!(Mix::from_name("q4_k"), None);
        let ids: Vec<u32> = ALL.iter().map(|m| m.file_type()).collect();
        assert_eq!(
            ids,
            [15, 17, 18, 7, 30, 25, 38, 12, 10, 26, 23, 29, 19, 32, 15]
        );
    }

    #[test]
    fn categories_follow_the_name_tests_in_order() {
        assert_eq!(Category::of("blk.0.attn_qkv.weight"), Category::AttnQkv);
        assert_eq!(Category::of("blk.3.attn_v.weight"), Category::AttnV);
        assert_eq!(Category::of("blk.0.attn_gate.weight"), Category::Other);
        assert_eq!(
            Category::of("blk.0.ffn_gate_shexp.weight"),
            Category::FfnGate
        );
        assert_eq!(
            Category::of("blk.0.ffn_down_exps.weight"),
            Category::FfnDown
        );
        assert_eq!(Category::of("blk.0.ssm_out.weight"), Category::Other);
        assert_eq!(Category::of("output.weight"), Category::Output);
        assert!(!allows_quantization(
            "blk.0.ffn_gate_inp.weight",
            &[2048, 256]
        ));
        assert!(!allows_quantization("blk.0.ssm_conv1d.weight", &[4, 8192]));
        assert!(!allows_quantization("blk.0.attn_norm.weight", &[2048]));
        assert!(!allows_quantization("blk.0.ssm_a", &[32]));
        assert!(!allows_quantization("blk.0.attn_q.weight", &[2048, 1]));
        assert!(allows_quantization("blk.0.ssm_beta.weight", &[2048, 32]));
    }

    #[test]
    fn fallbacks_are_llamas() {
        use GgmlType::*;
        for (t, to) in [
            (IQ4_XS, IQ4_NL),
            (IQ2_XXS, IQ4_NL),
            (IQ3_S, IQ4_NL),
            (Q2_K, Q4_0),
            (Q3_K, Q4_0),
            (Q4_K, Q5_0),
            (Q5_K, Q5_1),
            (Q6_K, Q8_0),
        ] {
            assert_eq!(fallback(t, 256 * 3).unwrap(), t);
            assert_eq!(fallback(t, 64).unwrap(), to, "{t}");
            assert_eq!(fallback(t, 48).unwrap(), F16, "{t}");
        }
        assert_eq!(fallback(Q8_0, 64).unwrap(), Q8_0);
        assert_eq!(fallback(MXFP4, 48).unwrap(), F16);
        assert_eq!(fallback(BF16, 7).unwrap(), BF16);
        assert!(fallback(Q8_K, 64).is_err());
    }

    #[test]
    fn visit_order_puts_unblocked_tensors_first_then_blocks_by_number() {
        let t = |n: &str| TensorPlan {
            name: n.into(),
            dims: vec![256, 256],
            ty: GgmlType::F32,
            fill: crate::plan::Fill::Normal(1.0),
        };
        let plan = [
            t("token_embd.weight"),
            t("blk.10.attn_v.weight"),
            t("blk.2.ffn_down_shexp.weight"),
            t("blk.2.ffn_down_exps.weight"),
            t("output.weight"),
        ];
        let names: Vec<&str> = visit_order(&plan)
            .into_iter()
            .map(|i| plan[i].name.as_str())
            .collect();
        assert_eq!(
            names,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.ffn_down_exps.weight",
                "blk.2.ffn_down_shexp.weight",
                "blk.10.attn_v.weight"
            ]
        );
    }
}
