//! `--mix` presets: the per-tensor types llama-quantize's rules give the real
//! shapes (plans only), the row-length fallback, and a small mixed file written
//! and read back.

use samesum_gguf::{GgmlType, GgufFile};
use samesum_quant::dequant::{can_dequantize, dequantize};
use samesum_synth::mix::{self, Mix};
use samesum_synth::plan::TensorPlan;
use samesum_synth::{SynthOptions, shapes, tensor_plan, write_model};
use std::collections::BTreeSet;

use GgmlType::*;

fn mix(name: &str) -> Mix {
    Mix::from_name(name).unwrap_or_else(|| panic!("no preset {name}"))
}

fn plan_of(shape: shapes::Shape, m: &str) -> Vec<TensorPlan> {
    // The --quant type is ignored once a mix is set (IQ2_XXS is not a --quant choice).
    tensor_plan(&SynthOptions::new(shape, IQ2_XXS, 0).with_mix(mix(m))).unwrap()
}

fn plan(shape: &str, m: &str) -> Vec<TensorPlan> {
    plan_of(shapes::by_name(shape).unwrap(), m)
}

fn ty(p: &[TensorPlan], name: &str) -> GgmlType {
    p.iter()
        .find(|t| t.name == name)
        .unwrap_or_else(|| panic!("no tensor {name}"))
        .ty
}

/// The layers llama.cpp's use_more_bits picks, written out: the first and last
/// eighth, and every third layer between starting at the eighth's end + 2.
fn more_bits_layers(n: u32) -> BTreeSet<u32> {
    let e = n / 8;
    (0..e)
        .chain(7 * n / 8..n)
        .chain((e..7 * n / 8).filter(|i| (i - e) % 3 == 2))
        .collect()
}

/// The layers whose tensor `part` exists in plan `p`.
fn layers_with(p: &[TensorPlan], part: &str) -> Vec<u32> {
    let suffix = format!(".{part}");
    p.iter()
        .filter_map(|t| {
            t.name
                .strip_suffix(&suffix)?
                .strip_prefix("blk.")?
                .parse()
                .ok()
        })
        .collect()
}

/// Asserts every layer's `part` is `more` in the use_more_bits layers and
/// `base` elsewhere.
fn follows_more_bits(p: &[TensorPlan], part: &str, n: u32, more: GgmlType, base: GgmlType) {
    let picked = more_bits_layers(n);
    let layers = layers_with(p, part);
    assert!(!layers.is_empty(), "no {part}");
    for l in layers {
        let want = if picked.contains(&l) { more } else { base };
        assert_eq!(ty(p, &format!("blk.{l}.{part}")), want, "blk.{l}.{part}");
    }
}

/// Every tensor of `p` whose name contains `part` has type `want`.
fn all_are(p: &[TensorPlan], part: &str, want: GgmlType) {
    let hits: Vec<&TensorPlan> = p.iter().filter(|t| t.name.contains(part)).collect();
    assert!(!hits.is_empty(), "no tensor matches {part}");
    for t in hits {
        assert_eq!(t.ty, want, "{}", t.name);
    }
}

const REAL: [&str; 2] = ["qwen3moe-30b-a3b", "qwen35moe-35b-a3b"];
const DELTA_PROJECTIONS: [&str; 5] = [
    "attn_qkv.weight",
    "attn_gate.weight",
    "ssm_beta.weight",
    "ssm_alpha.weight",
    "ssm_out.weight",
];

#[test]
fn more_bits_layers_are_the_known_list_for_48() {
    let l = more_bits_layers(48);
    let want: BTreeSet<u32> = [
        0, 1, 2, 3, 4, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35, 38, 41,
    ]
    .into_iter()
    .chain(42..48)
    .collect();
    assert_eq!(l, want);
}

#[test]
fn every_preset_keeps_the_tensor_list_and_unquantizable_tensors() {
    for shape in REAL {
        let uniform =
            tensor_plan(&SynthOptions::new(shapes::by_name(shape).unwrap(), Q8_0, 0)).unwrap();
        for &m in mix::ALL {
            let p = plan(shape, m.name());
            assert_eq!(p.len(), uniform.len(), "{shape} {m}");
            for (a, b) in p.iter().zip(&uniform) {
                assert_eq!((&a.name, &a.dims), (&b.name, &b.dims), "{shape} {m}");
                let never = a.name.contains("_norm")
                    || a.name.contains("ffn_gate_inp")
                    || a.name.contains("ssm_conv1d")
                    || a.dims.len() == 1;
                if never {
                    assert_eq!(a.ty, F32, "{shape} {m}: {}", a.name);
                } else {
                    assert_ne!(a.ty, F32, "{shape} {m}: {} left unquantized", a.name);
                }
                assert!(
                    a.ty.block_size() == 1 || samesum_synth::fill::direct_block_type(a.ty),
                    "{shape} {m}: {} is {} which synth cannot fill",
                    a.name,
                    a.ty
                );
            }
        }
    }
}

#[test]
fn q4_k_m_on_qwen3moe_gives_q6_k_to_the_layers_use_more_bits_picks() {
    let p = plan("qwen3moe-30b-a3b", "q4_k_m");
    assert_eq!(ty(&p, "output.weight"), Q6_K);
    assert_eq!(ty(&p, "token_embd.weight"), Q4_K);
    follows_more_bits(&p, "attn_v.weight", 48, Q6_K, Q4_K);
    follows_more_bits(&p, "ffn_down_exps.weight", 48, Q6_K, Q4_K);
    for part in [
        "attn_q.weight",
        "attn_k.weight",
        "attn_output.weight",
        "ffn_gate_exps",
        "ffn_up_exps",
    ] {
        all_are(&p, part, Q4_K);
    }
    all_are(&p, "ffn_gate_inp", F32);
}

#[test]
fn q4_k_m_on_qwen35moe_counts_the_delta_net_in_projection_as_attn_v() {
    let p = plan("qwen35moe-35b-a3b", "q4_k_m");
    // One attn_v-class tensor per layer (attn_qkv in the delta-net layers,
    // attn_v in every fourth), so the counter is the layer number.
    let mut v_layers = layers_with(&p, "attn_qkv.weight");
    v_layers.extend(layers_with(&p, "attn_v.weight"));
    v_layers.sort();
    assert_eq!(v_layers, (0..40).collect::<Vec<_>>());
    follows_more_bits(&p, "attn_qkv.weight", 40, Q6_K, Q4_K);
    follows_more_bits(&p, "attn_v.weight", 40, Q6_K, Q4_K);
    follows_more_bits(&p, "ffn_down_exps.weight", 40, Q6_K, Q4_K);
    follows_more_bits(&p, "ffn_down_shexp.weight", 40, Q6_K, Q4_K);
    assert_eq!(ty(&p, "blk.0.attn_qkv.weight"), Q6_K);
    assert_eq!(ty(&p, "blk.5.attn_qkv.weight"), Q4_K);
    assert_eq!(ty(&p, "blk.7.attn_v.weight"), Q6_K);
    for part in [
        "attn_gate",
        "ssm_beta",
        "ssm_alpha",
        "ssm_out",
        "ffn_up_shexp",
    ] {
        all_are(&p, part, Q4_K);
    }
    all_are(&p, "ssm_conv1d", F32);
    assert_eq!(ty(&p, "output.weight"), Q6_K);
}

#[test]
fn q5_k_m_and_the_uniform_presets() {
    for shape in REAL {
        let n = shapes::by_name(shape).unwrap().layers;
        let p = plan(shape, "q5_k_m");
        follows_more_bits(&p, "ffn_down_exps.weight", n, Q6_K, Q5_K);
        all_are(&p, "ffn_gate_exps", Q5_K);
        assert_eq!(ty(&p, "output.weight"), Q6_K);
        assert_eq!(ty(&p, "token_embd.weight"), Q5_K);
        for (m, want) in [("q6_k", Q6_K), ("q8_0", Q8_0), ("bf16", BF16)] {
            let p = plan(shape, m);
            for t in &p {
                let want = if t.dims.len() == 1
                    || t.name.contains("ffn_gate_inp")
                    || t.name.contains("ssm_conv1d")
                {
                    F32
                } else {
                    want
                };
                assert_eq!(t.ty, want, "{shape} {m}: {}", t.name);
            }
        }
    }
}

#[test]
fn iq4_presets_give_attn_v_q5_k_and_keep_ffn_down_with_an_imatrix() {
    for (m, base) in [("iq4_xs", IQ4_XS), ("iq4_nl", IQ4_NL)] {
        for shape in REAL {
            let p = plan(shape, m);
            // n_gqa = 8 (32/4 and 16/2) >= 4.
            all_are(&p, "attn_v.weight", Q5_K);
            if shape.starts_with("qwen35") {
                all_are(&p, "attn_qkv.weight", Q5_K);
                all_are(&p, "ffn_down_shexp", base);
            }
            // With an imatrix the first eighth's ffn_down stays at the base type.
            all_are(&p, "ffn_down_exps", base);
            all_are(&p, "attn_output.weight", base);
            assert_eq!(ty(&p, "output.weight"), Q6_K);
            assert_eq!(ty(&p, "token_embd.weight"), base);
        }
    }
}

#[test]
fn mxfp4_gives_experts_mxfp4_and_everything_else_q8_0() {
    for shape in REAL {
        let p = plan(shape, "mxfp4");
        for t in &p {
            let want = if t.dims.len() == 3 {
                MXFP4
            } else if t.dims.len() == 1
                || t.name.contains("ffn_gate_inp")
                || t.name.contains("ssm_conv1d")
            {
                F32
            } else {
                Q8_0
            };
            assert_eq!(t.ty, want, "{shape}: {}", t.name);
        }
        assert_eq!(ty(&p, "output.weight"), Q8_0);
        assert_eq!(ty(&p, "token_embd.weight"), Q8_0);
    }
}

#[test]
fn q2_k_and_q3_k_m_rules() {
    for shape in REAL {
        let s = shapes::by_name(shape).unwrap();
        let p = plan(shape, "q2_k");
        all_are(&p, "attn_v.weight", Q4_K);
        all_are(&p, "ffn_down", Q3_K);
        all_are(&p, "attn_output.weight", Q3_K);
        all_are(&p, "ffn_up_exps", Q2_K);
        assert_eq!(ty(&p, "output.weight"), Q6_K);
        assert_eq!(ty(&p, "token_embd.weight"), Q2_K);

        let p = plan(shape, "q3_k_m");
        // The first two attn_v-class tensors in visit order Q5_K, then Q4_K.
        let mut v: Vec<(u32, GgmlType)> = p
            .iter()
            .filter(|t| t.name.ends_with("attn_v.weight") || t.name.ends_with("attn_qkv.weight"))
            .map(|t| {
                (
                    t.name[4..].split('.').next().unwrap().parse().unwrap(),
                    t.ty,
                )
            })
            .collect();
        v.sort();
        for (i, (_, t)) in v.iter().enumerate() {
            assert_eq!(*t, if i < 2 { Q5_K } else { Q4_K }, "{shape} attn_v #{i}");
        }
        for l in 0..s.layers {
            let want = if l < s.layers / 16 { Q5_K } else { Q4_K };
            assert_eq!(ty(&p, &format!("blk.{l}.ffn_down_exps.weight")), want);
        }
        all_are(&p, "attn_output.weight", Q4_K);
        all_are(&p, "ffn_gate_exps", Q3_K);
        assert_eq!(ty(&p, "output.weight"), Q6_K);
        assert_eq!(ty(&p, "token_embd.weight"), Q3_K);
    }
}

#[test]
fn iq2_xxs_counts_ffn_down_across_experts_and_shared_experts() {
    let p = plan("qwen35moe-35b-a3b", "iq2_xxs");
    // 40 blocks: the first 5 ffn_down tensors in visit order (blk.0 exps,
    // blk.0 shexp, blk.1 exps, blk.1 shexp, blk.2 exps) are Q2_K.
    let mut downs: Vec<(u32, String)> = p
        .iter()
        .filter(|t| t.name.contains("ffn_down"))
        .map(|t| {
            (
                t.name[4..].split('.').next().unwrap().parse().unwrap(),
                t.name.clone(),
            )
        })
        .collect();
    downs.sort();
    assert_eq!(downs.len(), 80);
    for (i, (_, name)) in downs.iter().enumerate() {
        let want = if i < 5 { Q2_K } else { IQ2_XXS };
        assert_eq!(ty(&p, name), want, "ffn_down #{i} {name}");
    }
    assert_eq!(ty(&p, "blk.2.ffn_down_exps.weight"), Q2_K);
    assert_eq!(ty(&p, "blk.2.ffn_down_shexp.weight"), IQ2_XXS);
    assert_eq!(ty(&p, "output.weight"), Q5_K);
    assert_eq!(ty(&p, "token_embd.weight"), Q2_K);
    all_are(&p, "attn_qkv.weight", Q4_K);
    all_are(&p, "attn_v.weight", Q4_K);
    all_are(&p, "attn_output.weight", IQ2_XXS);
    all_are(&p, "ssm_out", IQ2_XXS);

    // No shared expert: the first 6 of 48 layers.
    let p = plan("qwen3moe-30b-a3b", "iq2_xxs");
    for l in 0..48 {
        let want = if l < 6 { Q2_K } else { IQ2_XXS };
        assert_eq!(
            ty(&p, &format!("blk.{l}.ffn_down_exps.weight")),
            want,
            "{l}"
        );
    }
}

#[test]
fn iq2_m_iq3_xxs_and_iq3_s_rules() {
    for shape in REAL {
        let p = plan(shape, "iq2_m");
        assert_eq!(ty(&p, "output.weight"), Q5_K);
        assert_eq!(ty(&p, "token_embd.weight"), IQ3_S);
        all_are(&p, "attn_v.weight", Q4_K);
        all_are(&p, "attn_output.weight", IQ3_S);
        all_are(&p, "ffn_gate_exps", IQ2_S);
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), IQ3_S);
        assert_eq!(ty(&p, "blk.20.ffn_down_exps.weight"), IQ2_S);

        let p = plan(shape, "iq3_xxs");
        assert_eq!(ty(&p, "output.weight"), Q5_K);
        assert_eq!(ty(&p, "token_embd.weight"), IQ3_S);
        all_are(&p, "attn_q.weight", IQ2_S);
        all_are(&p, "attn_k.weight", IQ2_S);
        all_are(&p, "attn_v.weight", Q4_K);
        all_are(&p, "attn_output.weight", IQ3_S);
        // With an imatrix ffn_down keeps the default.
        all_are(&p, "ffn_down_exps", IQ3_XXS);
        all_are(&p, "ffn_up_exps", IQ3_XXS);

        let p = plan(shape, "iq3_s");
        assert_eq!(ty(&p, "output.weight"), Q6_K);
        assert_eq!(ty(&p, "token_embd.weight"), IQ3_S);
        all_are(&p, "attn_v.weight", Q4_K);
        all_are(&p, "attn_output.weight", IQ3_S);
        all_are(&p, "ffn_down_exps", IQ3_S);
    }
    let p = plan("qwen35moe-35b-a3b", "iq3_xxs");
    all_are(&p, "attn_qkv.weight", Q4_K);
    all_are(&p, "attn_gate.weight", IQ3_XXS);
}

#[test]
fn ud_q4_k_xl_layout() {
    for shape in REAL {
        let s = shapes::by_name(shape).unwrap();
        let p = plan(shape, "ud-q4_k_xl");
        all_are(&p, "ffn_gate_exps", Q4_K);
        all_are(&p, "ffn_up_exps", Q4_K);
        for l in 0..s.layers {
            let want = if l >= 7 * s.layers / 8 { Q6_K } else { Q5_K };
            assert_eq!(
                ty(&p, &format!("blk.{l}.ffn_down_exps.weight")),
                want,
                "{shape} {l}"
            );
        }
        for part in [
            "attn_q.weight",
            "attn_k.weight",
            "attn_v.weight",
            "attn_output.weight",
        ] {
            all_are(&p, part, Q8_0);
        }
        if s.shared_ff > 0 {
            let shared = ["ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"];
            for part in DELTA_PROJECTIONS.iter().copied().chain(shared) {
                all_are(&p, part, Q8_0);
            }
        }
        assert_eq!(ty(&p, "token_embd.weight"), Q4_K);
        assert_eq!(ty(&p, "output.weight"), Q6_K);
        all_are(&p, "ffn_gate_inp", F32);
    }
}

#[test]
fn eight_expert_rules_fire_on_the_tiny_shapes() {
    // tiny-qwen3moe: 8 experts, n_gqa 2.
    let p = plan("tiny-qwen3moe", "q4_k_m");
    all_are(&p, "attn_v.weight", Q8_0);
    all_are(&p, "attn_k.weight", Q8_0);
    all_are(&p, "attn_output.weight", Q5_K);
    all_are(&p, "attn_q.weight", Q4_K);
    let p = plan("tiny-qwen3moe", "iq2_xxs");
    all_are(&p, "attn_v.weight", Q4_K);
    all_are(&p, "attn_k.weight", Q4_K);
    all_are(&p, "attn_output.weight", Q5_K);
    let p = plan("tiny-qwen3moe", "q6_k");
    all_are(&p, "attn_v.weight", Q8_0);
    all_are(&p, "attn_output.weight", Q6_K);
    let p = plan("tiny-qwen35moe", "q4_k_m");
    all_are(&p, "attn_qkv.weight", Q8_0);
}

#[test]
fn rows_that_are_not_whole_blocks_fall_back_as_llama_does() {
    // Expert rows of 96 (a multiple of 32, not of 256) and of 48 (neither).
    let mut s = shapes::by_name("tiny-qwen3moe").unwrap();
    s.expert_ff = 96;
    // 2 layers: use_more_bits picks layer 1 only (the last eighth); a
    // sixteenth and an eighth of 2 layers are none (so no Q5_K for q3_k_m and
    // no Q2_K for iq2_xxs).
    for (m, blk0, blk1) in [
        ("q4_k_m", Q5_0, Q8_0),
        ("q5_k_m", Q5_1, Q8_0),
        ("q6_k", Q8_0, Q8_0),
        ("iq4_xs", IQ4_NL, IQ4_NL),
        ("q2_k", Q4_0, Q4_0),
        ("q3_k_m", Q5_0, Q5_0),
        ("iq2_xxs", IQ4_NL, IQ4_NL),
        ("ud-q4_k_xl", Q5_1, Q8_0),
    ] {
        let p = plan_of(s.clone(), m);
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), blk0, "{m}");
        assert_eq!(ty(&p, "blk.1.ffn_down_exps.weight"), blk1, "{m}");
    }
    // Rows of 256 (gate and up) keep their type.
    let p = plan_of(s.clone(), "q4_k_m");
    assert_eq!(ty(&p, "blk.0.ffn_up_exps.weight"), Q4_K);
    s.expert_ff = 48;
    for m in ["q4_k_m", "iq4_xs", "q8_0", "mxfp4"] {
        let p = plan_of(s.clone(), m);
        assert_eq!(ty(&p, "blk.0.ffn_down_exps.weight"), F16, "{m}");
        assert_ne!(ty(&p, "blk.0.ffn_up_exps.weight"), F16, "{m}");
    }
}

#[test]
fn a_mixed_tiny_file_reads_back_with_the_planned_types() {
    let dir = tempfile::tempdir().unwrap();
    for (m, file_type) in [("q4_k_m", 15), ("iq4_xs", 30), ("mxfp4", 38), ("bf16", 32)] {
        let opts =
            SynthOptions::new(shapes::by_name("tiny-qwen35moe").unwrap(), Q8_0, 5).with_mix(mix(m));
        let path = dir.path().join(format!("tiny-{m}.gguf"));
        write_model(&opts, &path, &mut |_, _| {}).unwrap();
        let f = GgufFile::open(&path).unwrap();
        let p = tensor_plan(&opts).unwrap();
        assert_eq!(f.tensors().len(), p.len());
        for t in &p {
            let info = f.tensor(&t.name).unwrap();
            assert_eq!(info.ggml_type, t.ty, "{m}: {}", t.name);
            if can_dequantize(info.ggml_type) {
                let mut x = vec![0f32; info.n_elements() as usize];
                dequantize(info.ggml_type, f.data_of(info), &mut x).unwrap();
                assert!(x.iter().all(|v| v.is_finite()), "{m}: {}", t.name);
            }
        }
        let md = f.metadata();
        assert_eq!(md.get_u32("general.file_type").unwrap(), file_type, "{m}");
        let qv = md.get_u32("general.quantization_version").ok();
        assert_eq!(qv, if m == "bf16" { None } else { Some(2) }, "{m}");
        let types: BTreeSet<GgmlType> = f.tensors().iter().map(|t| t.ggml_type).collect();
        // 8 experts: attn_v/attn_qkv and attn_k Q8_0, attn_output Q5_K.
        match m {
            "q4_k_m" => assert_eq!(types, BTreeSet::from([F32, Q4_K, Q5_K, Q6_K, Q8_0])),
            "iq4_xs" => assert_eq!(types, BTreeSet::from([F32, IQ4_XS, Q5_K, Q6_K, Q8_0])),
            "mxfp4" => assert_eq!(types, BTreeSet::from([F32, MXFP4, Q8_0])),
            _ => assert_eq!(types, BTreeSet::from([F32, BF16])),
        }
    }
}
