//! Synthetic models: converter-exact tensor counts and shapes, metadata, a
//! deterministic stream per seed, and sane weight statistics.

use samesum_gguf::{GgmlType, GgufFile};
use samesum_quant::dequant::dequantize;
use samesum_synth::{SynthOptions, describe, shapes, write_model};

fn opts(name: &str, q: GgmlType) -> SynthOptions {
    SynthOptions::new(shapes::by_name(name).unwrap(), q, 42)
}

#[test]
fn real_shapes_have_the_converters_tensor_counts() {
    // Counts from llama.cpp's converter output (architectures.md 3.3, 4.5, 5.3).
    for (name, count) in [
        ("qwen3moe-30b-a3b", 579),
        ("qwen3next-80b-a3b", 843),
        ("qwen35moe-35b-a3b", 733),
    ] {
        let (w, _) = describe(&opts(name, GgmlType::Q4_K)).unwrap();
        assert_eq!(w.tensors().len(), count, "{name}");
    }
}

#[test]
fn real_shapes_have_the_converters_dims() {
    let (w, _) = describe(&opts("qwen3next-80b-a3b", GgmlType::Q4_K)).unwrap();
    let dims = |n: &str| {
        w.tensors()
            .iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("{n}"))
            .dims
            .clone()
    };
    assert_eq!(dims("token_embd.weight"), vec![2048, 151_936]);
    assert_eq!(dims("blk.0.attn_qkv.weight"), vec![2048, 8192]);
    assert_eq!(dims("blk.0.attn_gate.weight"), vec![2048, 4096]);
    assert_eq!(dims("blk.0.ssm_ba.weight"), vec![2048, 64]);
    assert_eq!(dims("blk.0.ssm_conv1d.weight"), vec![4, 8192]);
    assert_eq!(dims("blk.0.ssm_a"), vec![32]);
    assert_eq!(dims("blk.0.ssm_norm.weight"), vec![128]);
    assert_eq!(dims("blk.0.ssm_out.weight"), vec![4096, 2048]);
    assert_eq!(dims("blk.3.attn_q.weight"), vec![2048, 8192]);
    assert_eq!(dims("blk.3.attn_output.weight"), vec![4096, 2048]);
    assert_eq!(dims("blk.3.attn_k_norm.weight"), vec![256]);
    assert_eq!(dims("blk.5.ffn_gate_exps.weight"), vec![2048, 512, 512]);
    assert_eq!(dims("blk.5.ffn_down_exps.weight"), vec![512, 2048, 512]);
    assert_eq!(dims("blk.5.ffn_gate_inp.weight"), vec![2048, 512]);
    assert_eq!(dims("blk.5.ffn_gate_inp_shexp.weight"), vec![2048]);
    assert!(
        !w.tensors().iter().any(|t| t.name == "blk.0.attn_q.weight"),
        "layer 0 is linear"
    );
    let (w, _) = describe(&opts("qwen35moe-35b-a3b", GgmlType::Q4_K)).unwrap();
    let dims = |n: &str| {
        w.tensors()
            .iter()
            .find(|t| t.name == n)
            .unwrap_or_else(|| panic!("{n}"))
            .dims
            .clone()
    };
    assert_eq!(dims("blk.0.ssm_beta.weight"), vec![2048, 32]);
    assert_eq!(dims("blk.0.ssm_alpha.weight"), vec![2048, 32]);
    assert_eq!(dims("output.weight"), vec![2048, 248_320]);
    let m = w.metadata();
    assert_eq!(
        m.get_int_array("qwen35moe.rope.dimension_sections")
            .unwrap(),
        vec![11, 11, 10, 0]
    );
    assert_eq!(m.get_u32("qwen35moe.ssm.inner_size").unwrap(), 4096);
    assert_eq!(m.get_str("tokenizer.ggml.pre").unwrap(), "qwen35");
    // Norms, router and conv stay f32; the output matrix is q6_K in a q4_K model.
    let ty = |n: &str| w.tensors().iter().find(|t| t.name == n).unwrap().ggml_type;
    assert_eq!(ty("blk.0.ffn_gate_inp.weight"), GgmlType::F32);
    assert_eq!(ty("blk.0.ssm_conv1d.weight"), GgmlType::F32);
    assert_eq!(ty("output.weight"), GgmlType::Q6_K);
    assert_eq!(ty("blk.0.ffn_up_exps.weight"), GgmlType::Q4_K);
}

#[test]
fn written_models_read_back_and_are_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"] {
        for q in [
            GgmlType::Q4_K,
            GgmlType::Q8_0,
            GgmlType::BF16,
            GgmlType::F32,
        ] {
            let a = dir.path().join(format!("{name}-{q}-a.gguf"));
            let b = dir.path().join(format!("{name}-{q}-b.gguf"));
            let c = dir.path().join(format!("{name}-{q}-c.gguf"));
            let mut calls = 0;
            let s = write_model(&opts(name, q), &a, &mut |_, _| calls += 1).unwrap();
            assert!(calls > 0, "no progress reported");
            write_model(&opts(name, q), &b, &mut |_, _| {}).unwrap();
            let mut o = opts(name, q);
            o.seed = 43;
            write_model(&o, &c, &mut |_, _| {}).unwrap();
            let (ba, bb, bc) = (
                std::fs::read(&a).unwrap(),
                std::fs::read(&b).unwrap(),
                std::fs::read(&c).unwrap(),
            );
            assert_eq!(ba, bb, "{name} {q}: same seed, different bytes");
            assert_ne!(ba, bc, "{name} {q}: different seed, same bytes");
            let f = GgufFile::open(&a).unwrap();
            assert_eq!(f.tensors().len(), s.tensors);
            assert_eq!(
                f.metadata()
                    .get_array("tokenizer.ggml.tokens")
                    .unwrap()
                    .items
                    .len(),
                512
            );
            let embd = f.tensor("token_embd.weight").unwrap();
            assert_eq!(embd.dims, vec![256, 512]);
        }
    }
}

#[test]
fn weights_have_sane_statistics() {
    let dir = tempfile::tempdir().unwrap();
    for q in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::BF16,
        GgmlType::F32,
    ] {
        let p = dir.path().join(format!("m-{q}.gguf"));
        write_model(&opts("tiny-qwen3next", q), &p, &mut |_, _| {}).unwrap();
        let f = GgufFile::open(&p).unwrap();
        for name in [
            "blk.0.ffn_up_exps.weight",
            "blk.0.attn_qkv.weight",
            "blk.3.attn_q.weight",
        ] {
            let t = f.tensor(name).unwrap();
            let n = t.n_elements() as usize;
            let mut x = vec![0f32; n];
            dequantize(t.ggml_type, f.data_of(t), &mut x).unwrap();
            let mean = x.iter().map(|&v| v as f64).sum::<f64>() / n as f64;
            let sd = (x.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n as f64).sqrt();
            let want = 1.0 / (t.dims[0] as f64).sqrt();
            assert!(
                x.iter().all(|v| v.is_finite()),
                "{q} {name}: non-finite weight"
            );
            assert!(
                mean.abs() < 0.1 * want,
                "{q} {name}: mean {mean} vs sd {want}"
            );
            assert!(
                sd > 0.7 * want && sd < 1.4 * want,
                "{q} {name}: sd {sd}, want {want}"
            );
        }
        let a = f.tensor("blk.0.ssm_a").unwrap();
        let mut v = vec![0f32; 4];
        dequantize(GgmlType::F32, f.data_of(a), &mut v).unwrap();
        assert!(
            v.iter().all(|&x| (-16.0..=-1.0).contains(&x)),
            "ssm_a {v:?}"
        );
    }
}

#[test]
fn bad_options_are_errors() {
    let mut o = opts("tiny-qwen3moe", GgmlType::IQ1_S);
    assert!(describe(&o).is_err());
    o.quant = GgmlType::Q8_0;
    o.shape.layers = 0;
    assert!(describe(&o).is_err());
}
