//! Loading: one error listing the tensor problems, layer counts bounded by
//! the file, non-finite values, bad token ids and non-regular paths
//! refused, the recurrent-layer schedule
//! from `attention.recurrent_layers` over the interval rule, the legacy fused
//! `ssm_in` layout of qwen3next, and unsupported architectures.

use samesum_engine::{KvType, Logits, Model, SeqState, cpu::Cpu, forward};
use samesum_gguf::{GgmlType, GgufFile, GgufWriter, Metadata};
use std::path::PathBuf;

fn fixture(name: &str) -> GgufFile {
    GgufFile::open(
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/conformance/fixtures")
            .join(name),
    )
    .unwrap()
}

/// Rewrite `f` with metadata `meta` and tensors produced by `edit` from the
/// original list (name, dims, type, bytes).
fn rewrite(
    f: &GgufFile,
    meta: Metadata,
    edit: impl FnOnce(
        Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
    ) -> Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
) -> Vec<u8> {
    let ts = f
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ggml_type,
                f.data_of(t).to_vec(),
            )
        })
        .collect();
    let ts = edit(ts);
    let mut w = GgufWriter::with_metadata(meta);
    for (n, d, ty, _) in &ts {
        w.add_tensor(n.clone(), d, *ty).unwrap();
    }
    let data: Vec<&[u8]> = ts.iter().map(|t| t.3.as_slice()).collect();
    w.to_bytes(&data).unwrap()
}

fn write_tmp(bytes: &[u8]) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    (d, p)
}

fn logits(m: &Model, tokens: &[u32]) -> Vec<u32> {
    let mut st = SeqState::new(&m.hp, 64, KvType::F32);
    forward(m, &Cpu::new(1), &mut st, tokens, Logits::All)
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn every_tensor_problem_is_listed_in_one_error() {
    let f = fixture("qwen3moe.gguf");
    let bytes = rewrite(&f, f.metadata().clone(), |mut ts| {
        ts.retain(|t| t.0 != "blk.1.attn_k.weight" && t.0 != "output_norm.weight");
        for t in ts.iter_mut() {
            if t.0 == "blk.0.ffn_up_exps.weight" {
                t.1 = vec![64, 16, 8];
                t.3.truncate(t.3.len() / 2);
            }
        }
        ts
    });
    let (_d, p) = write_tmp(&bytes);
    let e = Model::load(&p).err().unwrap().to_string();
    assert!(e.contains("3 problems"), "{e}");
    assert!(e.contains("blk.1.attn_k.weight: missing"), "{e}");
    assert!(e.contains("output_norm.weight: missing"), "{e}");
    assert!(
        e.contains("blk.0.ffn_up_exps.weight: expected dims [64, 32, 8], found [64, 16, 8]"),
        "{e}"
    );
}

/// A layer count the file cannot hold (a corrupt or hostile `block_count`)
/// fails at once with the count named, before anything is sized by it; a
/// count the tensor list could hold but does not gives one error whose
/// message lists the first problems and how many more there are, not
/// every missing tensor of every layer.
#[test]
fn layer_counts_are_bounded_by_the_file() {
    let f = fixture("qwen3moe.gguf");
    for count in [u32::MAX, 1_000_000] {
        let mut meta = f.metadata().clone();
        meta.set("qwen3moe.block_count", count);
        let (_d, p) = write_tmp(&rewrite(&f, meta, |ts| ts));
        let e = Model::load(&p).err().unwrap().to_string();
        assert!(
            e.contains(&format!("block_count {count}")) && e.contains("tensors the file holds"),
            "{e}"
        );
    }
    let n_tensors = f.tensors().len() as u32;
    let mut meta = f.metadata().clone();
    meta.set("qwen3moe.block_count", n_tensors);
    let (_d, p) = write_tmp(&rewrite(&f, meta, |ts| ts));
    let e = Model::load(&p).err().unwrap().to_string();
    assert!(e.contains("problems"), "{e}");
    assert!(e.contains("more"), "{e}");
    assert!(e.lines().count() <= 23, "{} lines: {e}", e.lines().count());
}

/// What a model file says is checked before it is trusted: a NaN norm
/// weight, a non-finite epsilon and a bos/eos id outside the vocabulary are
/// errors naming the value; a path that is not a regular file (a directory,
/// a FIFO that would block the open) is a clear error too.
#[test]
fn non_finite_values_and_bad_ids_and_paths_are_refused() {
    let f = fixture("qwen3moe.gguf");
    let bytes = rewrite(&f, f.metadata().clone(), |mut ts| {
        for t in ts.iter_mut() {
            if t.0 == "blk.0.attn_norm.weight" {
                assert_eq!(t.2, GgmlType::F32);
                t.3[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
            }
        }
        ts
    });
    let (_d, p) = write_tmp(&bytes);
    let e = Model::load(&p).err().unwrap().to_string();
    assert!(
        e.contains("blk.0.attn_norm.weight: 1 values are NaN or infinite"),
        "{e}"
    );

    let mut meta = f.metadata().clone();
    meta.set("qwen3moe.attention.layer_norm_rms_epsilon", f32::NAN);
    let (_d, p) = write_tmp(&rewrite(&f, meta, |ts| ts));
    let e = Model::load(&p).err().unwrap().to_string();
    assert!(e.contains("layer_norm_rms_epsilon NaN"), "{e}");

    let n = f
        .metadata()
        .get_str_array("tokenizer.ggml.tokens")
        .unwrap()
        .len() as u32;
    for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"] {
        let mut meta = f.metadata().clone();
        meta.set(key, n + 5);
        let (_d, p) = write_tmp(&rewrite(&f, meta, |ts| ts));
        let g = GgufFile::open(&p).unwrap();
        let e = samesum_engine::tokenizer::Tokenizer::from_metadata(g.metadata())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains(&format!("{key} {}", n + 5)) && e.contains("outside the vocabulary"),
            "{e}"
        );
    }

    let d = tempfile::tempdir().unwrap();
    let e = Model::load(d.path()).err().unwrap().to_string();
    assert!(e.contains("not a regular file"), "{e}");
    #[cfg(unix)]
    {
        let fifo = d.path().join("fifo.gguf");
        let ok = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            let e = Model::load(&fifo).err().unwrap().to_string();
            assert!(e.contains("not a regular file"), "{e}");
        }
    }
}

#[test]
fn unsupported_architecture_names_the_supported_ones() {
    let f = fixture("qwen3moe.gguf");
    let mut meta = f.metadata().clone();
    meta.set("general.architecture", "llama");
    let bytes = rewrite(&f, meta, |ts| ts);
    let (_d, p) = write_tmp(&bytes);
    let e = Model::load(&p).err().unwrap().to_string();
    assert!(
        e.contains("\"llama\"") && e.contains("qwen3moe, qwen3next, qwen35moe"),
        "{e}"
    );
}

#[test]
fn recurrent_layers_override_the_interval_rule() {
    // The fixture's schedule is [linear, full, linear, full]; with the interval set
    // to 4 only `attention.recurrent_layers` can give it.
    let f = fixture("qwen3next.gguf");
    let reference = logits(
        &Model::load(
            PathBuf::from(env!("CARGO_MANIFEST_DIR"))
                .join("../../tests/conformance/fixtures/qwen3next.gguf"),
        )
        .unwrap(),
        &[5, 6, 7],
    );
    let mut meta = f.metadata().clone();
    meta.set("qwen3next.full_attention_interval", 4u32);
    let (_d, p) = write_tmp(&rewrite(&f, meta.clone(), |ts| ts));
    let m = Model::load(&p).unwrap();
    assert_eq!(logits(&m, &[5, 6, 7]), reference);
    // Without the list, the interval rule applies and the tensors no longer fit.
    let mut stripped = Metadata::new();
    for (k, v) in meta.iter() {
        if k != "qwen3next.attention.recurrent_layers" {
            stripped.insert(k, v.clone()).unwrap();
        }
    }
    let (_d2, p2) = write_tmp(&rewrite(&f, stripped, |ts| ts));
    let e = Model::load(&p2).err().unwrap().to_string();
    assert!(e.contains("blk.1.ssm_a: missing"), "{e}");
}

#[test]
fn legacy_fused_ssm_in_gives_the_same_logits() {
    // Re-pack attn_qkv + attn_gate into the old per-key-group ssm_in layout
    // ([q_g | k_g | v_g | z_g] for each group g); every output is the same dot of
    // the same weight row, so the logits must be bit-identical.
    let f = fixture("qwen3next.gguf");
    let m = Model::from_file(fixture("qwen3next.gguf")).unwrap();
    let s = m.hp.ssm.unwrap();
    let (dk, dv, hk, ratio) = (
        s.head_k_dim,
        s.head_v_dim,
        s.n_k_heads,
        s.n_v_heads / s.n_k_heads,
    );
    let kd = s.key_dim();
    let d = m.hp.n_embd;
    let row = d * 4; // f32 rows
    let bytes = rewrite(&f, f.metadata().clone(), |ts| {
        let mut out = Vec::new();
        let find = |n: &str| ts.iter().find(|t| t.0 == n).cloned();
        for t in &ts {
            if let Some(l) = t.0.strip_suffix(".attn_qkv.weight") {
                let qkv = &t.3;
                let z = find(&format!("{l}.attn_gate.weight")).unwrap().3;
                let mut fused = Vec::new();
                let rows = |src: &[u8], start: usize, n: usize| {
                    src[start * row..(start + n) * row].to_vec()
                };
                for g in 0..hk {
                    fused.extend(rows(qkv, g * dk, dk));
                    fused.extend(rows(qkv, kd + g * dk, dk));
                    fused.extend(rows(qkv, 2 * kd + g * ratio * dv, ratio * dv));
                    fused.extend(rows(&z, g * ratio * dv, ratio * dv));
                }
                let n_rows = (fused.len() / row) as u64;
                out.push((
                    format!("{l}.ssm_in.weight"),
                    vec![d as u64, n_rows],
                    GgmlType::F32,
                    fused,
                ));
            } else if !t.0.ends_with(".attn_gate.weight") {
                out.push(t.clone());
            }
        }
        out
    });
    let (_d, p) = write_tmp(&bytes);
    let legacy = Model::load(&p).unwrap();
    assert!(
        legacy.file.has_tensor("blk.0.ssm_in.weight")
            && !legacy.file.has_tensor("blk.0.attn_qkv.weight")
    );
    let tokens = [3, 14, 15, 92, 65, 35, 89, 79];
    assert_eq!(logits(&legacy, &tokens), logits(&m, &tokens));
}
