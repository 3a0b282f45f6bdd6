//! Fuzz the model load path of `samesum run` and `samesum serve`: any bytes,
//! mapped as a model file is, go through the GGUF reader, the tokenizer built
//! from the metadata (with a chat turn rendered by the file's template and
//! encoded), the hyperparameters and the weight binding (`Model::from_file`).
//! Each step must give a value or an error, never a panic or an unbounded
//! allocation, and a model that loads must have every weight view inside the
//! file. Seeds: the small synthetic models in `fuzz/seeds/`
//! (`crates/engine/tests/load_fuzz.rs` makes them).
//!
//! An input that does not start with the GGUF magic is read as a list of
//! edits to one of those models (metadata values set or removed, tensor dims
//! and types changed), which is then encoded and loaded: metadata values of
//! another type or width than the file's are hard to reach by editing bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use samesum_engine::Model;
use samesum_engine::model::weights::{DeltaBa, DeltaInput, Matrix, Mixer};
use samesum_engine::tokenizer::Tokenizer;
use samesum_gguf::{GgmlType, Gguf, GgufFile, GgufWriter, Metadata, Value, ValueType};
use std::sync::OnceLock;

type Tensors = Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>;

/// The seed models, split into metadata and tensors.
fn bases() -> &'static [(Metadata, Tensors)] {
    static BASES: OnceLock<Vec<(Metadata, Tensors)>> = OnceLock::new();
    BASES.get_or_init(|| {
        [
            &include_bytes!("../seeds/qwen3moe.gguf")[..],
            &include_bytes!("../seeds/qwen3next.gguf")[..],
            &include_bytes!("../seeds/qwen35moe.gguf")[..],
        ]
        .iter()
        .map(|b| {
            let g = Gguf::from_bytes(*b).expect("a valid seed");
            let t = g
                .tensors()
                .iter()
                .map(|t| {
                    (
                        t.name.clone(),
                        t.dims.clone(),
                        t.ggml_type,
                        g.data_of(t).to_vec(),
                    )
                })
                .collect();
            (g.metadata().clone(), t)
        })
        .collect()
    })
}

/// The keys the engine reads, after the architecture's name.
const ARCH_KEYS: &[&str] = &[
    "block_count",
    "nextn_predict_layers",
    "embedding_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "rope.dimension_count",
    "rope.freq_base",
    "attention.layer_norm_rms_epsilon",
    "context_length",
    "expert_count",
    "expert_used_count",
    "expert_feed_forward_length",
    "feed_forward_length",
    "expert_shared_feed_forward_length",
    "ssm.time_step_rank",
    "ssm.inner_size",
    "ssm.conv_kernel",
    "ssm.state_size",
    "ssm.group_count",
    "attention.recurrent_layers",
    "full_attention_interval",
];

/// A value of the type `ty` picks, from the 8 bytes `b`.
fn value(ty: u8, b: [u8; 8]) -> Value {
    let v = u64::from_le_bytes(b);
    match ty % 14 {
        0 => Value::U8(v as u8),
        1 => Value::I8(v as i8),
        2 => Value::U16(v as u16),
        3 => Value::I16(v as i16),
        4 => Value::U32(v as u32),
        5 => Value::I32(v as i32),
        6 => Value::F32(f32::from_bits(v as u32)),
        7 => Value::Bool(v & 1 == 1),
        8 => Value::String(
            [
                "qwen3moe",
                "qwen3next",
                "qwen35moe",
                "gpt2",
                "qwen2",
                "qwen35",
                "",
            ][(v % 7) as usize]
                .into(),
        ),
        9 => Value::U64(v),
        10 => Value::I64(v as i64),
        11 => Value::F64(f64::from_bits(v)),
        // The recurrent-layer schedule: up to 8 layers' bits.
        12 => Value::array(
            ValueType::Bool,
            (0..(v >> 8) % 9)
                .map(|i| Value::Bool(v >> i & 1 == 1))
                .collect(),
        ),
        _ => Value::array(
            ValueType::U32,
            vec![Value::U32(v as u32); ((v >> 32) % 4) as usize],
        ),
    }
}

/// The next 8 bytes of `it`.
fn word(it: &mut impl Iterator<Item = u8>) -> Option<[u8; 8]> {
    let mut b = [0u8; 8];
    for x in &mut b {
        *x = it.next()?;
    }
    Some(b)
}

/// Apply the edits `data` describes to a seed model and encode it; `None`
/// when the edits run out early or the writer refuses the result.
fn edited(data: &[u8]) -> Option<Vec<u8>> {
    let mut it = data.iter().copied();
    let (meta0, tensors0) = &bases()[it.next()? as usize % 3];
    let (mut meta, mut tensors) = (meta0.clone(), tensors0.clone());
    let arch = meta.get_str("general.architecture").ok()?.to_string();
    while let Some(op) = it.next() {
        match op % 5 {
            0 | 1 => {
                // Even: a key the engine reads (present or not); odd: a key
                // of the file.
                let k = it.next()? as usize;
                let key = if k.is_multiple_of(2) {
                    format!("{arch}.{}", ARCH_KEYS[k / 2 % ARCH_KEYS.len()])
                } else {
                    let keys: Vec<&str> = meta.iter().map(|(k, _)| k).collect();
                    // Every key may have been removed by an earlier edit.
                    let Some(key) = keys.get(k % keys.len().max(1)) else {
                        continue;
                    };
                    key.to_string()
                };
                let ty = it.next()?;
                meta.set(key, value(ty, word(&mut it)?));
            }
            2 => {
                let keys: Vec<String> = meta.iter().map(|(k, _)| k.to_string()).collect();
                let Some(drop) = keys.get(it.next()? as usize % keys.len().max(1)) else {
                    continue;
                };
                let mut m = Metadata::new();
                for (k, v) in meta.iter().filter(|(k, _)| k != drop) {
                    m.set(k, v.clone());
                }
                meta = m;
            }
            3 => {
                let n = tensors.len();
                let t = &mut tensors[it.next()? as usize % n];
                let d = it.next()? as usize % 5;
                let v = u64::from_le_bytes(word(&mut it)?);
                if d < t.1.len() {
                    t.1[d] = v;
                } else {
                    t.1.push(v);
                }
            }
            _ => {
                let n = tensors.len();
                let t = &mut tensors[it.next()? as usize % n];
                t.2 = GgmlType::ALL[it.next()? as usize % GgmlType::ALL.len()];
            }
        }
    }
    // The writer pads to the alignment and the data must be written out:
    // keep both small.
    if meta
        .get("general.alignment")
        .and_then(Value::as_u64)
        .is_some_and(|a| a > 1 << 16)
    {
        return None;
    }
    let mut w = GgufWriter::with_metadata(meta);
    for (name, dims, ty, data) in &mut tensors {
        w.add_tensor(name.clone(), dims, *ty).ok()?;
        let size = w.tensors().last()?.size;
        if size > 16 << 20 {
            return None;
        }
        data.resize(size as usize, 0);
    }
    let data: Vec<&[u8]> = tensors.iter().map(|t| t.3.as_slice()).collect();
    w.to_bytes(&data).ok()
}

/// `data` in an anonymous read-only map: the same type `GgufFile::open`
/// gives, so `Model::from_file` takes it without a file on disk.
fn mapped(data: &[u8]) -> Option<memmap2::Mmap> {
    if data.is_empty() {
        return None;
    }
    let mut m = memmap2::MmapOptions::new()
        .len(data.len())
        .map_anon()
        .ok()?;
    m.copy_from_slice(data);
    m.make_read_only().ok()
}

fn inside(m: &Matrix, len: usize) {
    let end = m
        .n_mats
        .checked_mul(m.rows)
        .and_then(|n| n.checked_mul(m.row_bytes))
        .and_then(|n| n.checked_add(m.offset));
    assert!(
        end.is_some_and(|e| e <= len),
        "{}: {} x {} rows of {} bytes at {} do not fit in {len} bytes",
        m.name,
        m.n_mats,
        m.rows,
        m.row_bytes,
        m.offset
    );
    assert_eq!(Some(m.row_bytes as u64), m.ty.row_bytes(m.cols as u64));
}

fn check(model: &Model) {
    let (hp, w, len) = (&model.hp, &model.w, model.bytes().len());
    assert_eq!(hp.layers.len(), hp.n_layer);
    assert_eq!(w.layers.len(), hp.n_layer);
    assert_eq!(w.output_norm.len(), hp.n_embd);
    inside(&w.token_embd, len);
    inside(&w.output, len);
    for l in &w.layers {
        assert_eq!(l.attn_norm.len(), hp.n_embd);
        assert_eq!(l.ffn_norm.len(), hp.n_embd);
        for m in [&l.moe.router, &l.moe.gate, &l.moe.up, &l.moe.down] {
            inside(m, len);
        }
        if let Some(s) = &l.moe.shared {
            for m in [&s.gate, &s.up, &s.down, &s.gate_inp] {
                inside(m, len);
            }
        }
        match &l.mixer {
            Mixer::Attention(a) => {
                assert_eq!(a.q_norm.len(), hp.head_dim);
                assert_eq!(a.k_norm.len(), hp.head_dim);
                for m in [&a.q, &a.k, &a.v, &a.o] {
                    inside(m, len);
                }
            }
            Mixer::Linear(d) => {
                let s = hp.ssm.expect("a delta-net layer has delta-net sizes");
                assert_eq!(d.conv.len(), s.d_conv * s.conv_dim());
                assert_eq!(d.norm.len(), s.head_v_dim);
                match &d.input {
                    DeltaInput::Split { qkv, z } => {
                        inside(qkv, len);
                        inside(z, len);
                    }
                    DeltaInput::Fused { ssm_in } => inside(ssm_in, len),
                }
                match &d.ba {
                    DeltaBa::Fused(ba) => inside(ba, len),
                    DeltaBa::Split { beta, alpha } => {
                        inside(beta, len);
                        inside(alpha, len);
                    }
                }
                inside(&d.out, len);
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let edited_bytes;
    let data = if data.starts_with(b"GGUF") {
        data
    } else {
        let Some(b) = edited(data) else { return };
        edited_bytes = b;
        &edited_bytes[..]
    };
    let Some(map) = mapped(data) else { return };
    let Ok(file) = GgufFile::from_bytes(map.into()) else {
        return;
    };
    if let Ok(tok) = Tokenizer::from_metadata(file.metadata()) {
        if let Ok(text) = tok.chat_messages(&[("system", "be brief"), ("user", "hi <|im_end|>")])
            && let Ok(ids) = tok.encode(&text)
        {
            assert!(ids.iter().all(|&i| (i as usize) < tok.len()));
            let _ = tok.decode(&ids);
        }
        let _ = tok.encode("Hello, world! 123 <|im_start|>");
    }
    if let Ok(model) = Model::from_file(file) {
        check(&model);
    }
});
