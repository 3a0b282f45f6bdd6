//! Loading untrusted model files: GGUF bytes -> header -> tokenizer and
//! hyperparameters from the metadata -> weight binding gives a model or an
//! error, never a panic, an abort or an unbounded allocation.
//!
//! The inputs are small valid synthetic models of the three architectures and
//! thousands of deterministic mutations of them: bit flips and extreme
//! integers written into the header, truncations, metadata values replaced by
//! extreme values of every type, keys removed, the architecture swapped,
//! tensors re-dimensioned, re-typed, renamed or dropped. A model that loads
//! must have every weight view inside the file and agree with its
//! hyperparameters. A counting allocator refuses (aborts on) any single
//! allocation over [`ALLOC_LIMIT`], as libFuzzer's `-malloc_limit_mb` does, and
//! names the case first.
//!
//! `fuzz/fuzz_targets/load_model.rs` checks the same property without bounds
//! under cargo-fuzz, starting from the small models built here:
//! `SAMESUM_FUZZ_SEEDS=DIR cargo test -p samesum-engine --test load_fuzz`
//! writes them to `DIR`. `SAMESUM_LOAD_FUZZ=N` sets the mutations per
//! small model (default 400; the full-width models get an eighth of that),
//! and `SAMESUM_LOAD_FUZZ=case:K` runs only case `K` (base * 1000000 + case,
//! as a failure names it).

use samesum_engine::model::weights::{DeltaBa, DeltaInput, Matrix, Mixer};
use samesum_engine::model::{HParams, LayerKind};
use samesum_engine::{Model, tokenizer::Tokenizer};
use samesum_gguf::{GgmlType, Gguf, GgufWriter, Metadata, Value};
use samesum_quant::rng::Rng;
use samesum_synth::shapes::{self, DeltaNet, Shape};
use samesum_synth::{SynthOptions, describe, fill};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The largest single allocation a load may ask for. The inputs are at most
/// a few MiB; loading one needs a small multiple of that.
const ALLOC_LIMIT: usize = 256 << 20;

/// The case being run (base * 1_000_000 + case), printed when an allocation
/// is refused.
static CASE: AtomicU64 = AtomicU64::new(u64::MAX);

struct Bounded;

// SAFETY: forwards to the system allocator; only refuses (by aborting) sizes
// over the limit.
unsafe impl GlobalAlloc for Bounded {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check_size(layout.size());
        // SAFETY: the caller's layout is passed through unchanged.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check_size(layout.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        check_size(new_size);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Bounded = Bounded;

/// Abort, naming the case and printing the stack, on an allocation over the
/// limit. The message is put together without allocating.
fn check_size(size: usize) {
    if size <= ALLOC_LIMIT {
        return;
    }
    let mut buf = [0u8; 160];
    let mut n = 0;
    let mut put = |s: &[u8]| {
        let k = s.len().min(buf.len() - n);
        buf[n..n + k].copy_from_slice(&s[..k]);
        n += k;
    };
    put(b"load_fuzz: allocation of ");
    put(digits(size as u64, &mut [0u8; 20]));
    put(b" bytes refused in case ");
    put(digits(CASE.load(Ordering::Relaxed), &mut [0u8; 20]));
    put(b" (base * 1000000 + case)\n");
    let _ = std::io::stderr().write_all(&buf[..n]);
    // The allocations the trace itself makes are small.
    let _ = writeln!(
        std::io::stderr(),
        "{}",
        std::backtrace::Backtrace::force_capture()
    );
    std::process::abort();
}

fn digits(mut v: u64, out: &mut [u8; 20]) -> &[u8] {
    let mut i = out.len();
    loop {
        i -= 1;
        out[i] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            return &out[i..];
        }
    }
}

/// A synthetic shape of `name` shrunk to a few tens of KiB: every structural
/// feature of the architecture (GQA, partial RoPE, shared experts, delta-net
/// and attention layers) at widths of one or two 32-value blocks.
fn small_shape(name: &str) -> Shape {
    let mut s = shapes::by_name(name).expect("known shape");
    s.vocab = Some(300);
    s.hidden = 32;
    s.layers = 2;
    s.heads = 2;
    s.kv_heads = 1;
    s.head_dim = 16;
    s.context = 256;
    s.ff = s.ff.map(|_| 64);
    s.experts = 4;
    s.experts_used = 2;
    s.expert_ff = 32;
    if s.arch.is_hybrid() {
        s.rope_dims = Some(8);
        s.shared_ff = 32;
        s.delta = Some(DeltaNet {
            conv_kernel: 4,
            key_head_dim: 16,
            key_heads: 1,
            value_heads: 2,
            value_head_dim: 16,
        });
        // Layer 0 is a delta net, layer 1 full attention.
        s.full_attention_interval = 2;
    }
    s
}

/// The GGUF image `samesum_synth::write_model` would write for `opts`, in memory.
fn synth_bytes(opts: &SynthOptions) -> Vec<u8> {
    let (w, plan) = describe(opts).expect("valid options");
    let data: Vec<Vec<u8>> = plan
        .iter()
        .zip(w.tensors())
        .map(|(t, info)| {
            let mut rng = Rng::new(fill::tensor_seed(opts.seed, &t.name));
            let mut buf = vec![0u8; info.size as usize];
            fill::fill(&mut rng, t.ty, t.fill, &mut buf);
            buf
        })
        .collect();
    let refs: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    w.to_bytes(&refs).expect("writes")
}

/// The small models: the seeds of the cargo-fuzz target.
fn small_models() -> Vec<(&'static str, Vec<u8>)> {
    [
        ("qwen3moe", "tiny-qwen3moe"),
        ("qwen3next", "tiny-qwen3next"),
        ("qwen35moe", "tiny-qwen35moe"),
    ]
    .into_iter()
    .map(|(arch, shape)| {
        let opts = SynthOptions::new(small_shape(shape), GgmlType::Q8_0, 7);
        (arch, synth_bytes(&opts))
    })
    .collect()
}

/// A valid model, split into what the structured mutations edit.
struct Base {
    name: String,
    bytes: Vec<u8>,
    data_start: usize,
    meta: Metadata,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl Base {
    fn new(name: String, bytes: Vec<u8>) -> Base {
        let g = Gguf::from_bytes(bytes.as_slice()).expect("valid base");
        let tensors = g
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
        let (data_start, meta) = (g.header().data_start as usize, g.metadata().clone());
        Base {
            name,
            bytes,
            data_start,
            meta,
            tensors,
        }
    }
}

type Tensors = Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>;

/// Re-encode `meta` and `tensors`; `None` when the writer refuses them (a
/// size over the bound or a duplicate name: the reader has its own tests for
/// such headers).
fn encode(meta: &Metadata, tensors: &Tensors) -> Option<Vec<u8>> {
    // The writer pads every tensor to the alignment: a huge one would make
    // the encoded file huge.
    if meta
        .get("general.alignment")
        .and_then(Value::as_u64)
        .is_some_and(|a| a > 1 << 16)
    {
        return None;
    }
    let mut w = GgufWriter::with_metadata(meta.clone());
    for (n, d, ty, _) in tensors {
        w.add_tensor(n.clone(), d, *ty).ok()?;
    }
    let data: Vec<&[u8]> = tensors.iter().map(|t| t.3.as_slice()).collect();
    w.to_bytes(&data).ok()
}

const INTERESTING: &[u64] = &[
    0,
    1,
    2,
    3,
    7,
    8,
    16,
    31,
    32,
    33,
    255,
    256,
    1023,
    4096,
    65535,
    65536,
    1 << 20,
    (1 << 31) - 1,
    1 << 31,
    u32::MAX as u64,
    1 << 32,
    (1 << 32) + 1,
    1 << 40,
    1 << 48,
    1 << 56,
    1 << 62,
    i64::MAX as u64,
    1 << 63,
    u64::MAX - 1,
    u64::MAX,
];

fn interesting(rng: &mut Rng) -> u64 {
    match rng.below(4) {
        0 => rng.next_u64() >> rng.below(64),
        _ => INTERESTING[rng.below(INTERESTING.len() as u64) as usize],
    }
}

/// The keys the engine reads, for `arch`: most of the metadata mutations
/// go to them (including the optional ones the base does not have).
fn known_keys(arch: &str) -> Vec<String> {
    let mut keys: Vec<String> = [
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
    ]
    .iter()
    .map(|k| format!("{arch}.{k}"))
    .collect();
    keys.extend(
        [
            "general.architecture",
            "general.alignment",
            "tokenizer.ggml.model",
            "tokenizer.ggml.pre",
            "tokenizer.ggml.tokens",
            "tokenizer.ggml.token_type",
            "tokenizer.ggml.merges",
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.add_bos_token",
            "tokenizer.chat_template",
        ]
        .iter()
        .map(|k| k.to_string()),
    );
    keys
}

const STRINGS: &[&str] = &[
    "",
    "qwen3moe",
    "qwen3next",
    "qwen35moe",
    "llama",
    "gpt2",
    "qwen2",
    "qwen35",
    "<|im_end|>",
    "a b",
    "ab",
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{{ raise_exception('no') }}",
    "{%",
    "\u{0}\u{ffff}",
];

/// A random metadata value of a random type, leaning to extremes.
fn random_value(rng: &mut Rng, depth: u32) -> Value {
    let i = interesting(rng);
    match rng.below(if depth > 1 { 12 } else { 14 }) {
        0 => Value::U8(i as u8),
        1 => Value::I8(i as i8),
        2 => Value::U16(i as u16),
        3 => Value::I16(i as i16),
        4 | 5 => Value::U32(i as u32),
        6 => Value::I32(i as i32),
        7 => Value::U64(i),
        8 => Value::I64(i as i64),
        9 => Value::F32(
            [
                0.0,
                -1.0,
                1e-6,
                f32::NAN,
                f32::INFINITY,
                f32::MIN_POSITIVE,
                1e38,
                10000.0,
            ][rng.below(8) as usize],
        ),
        10 => Value::Bool(rng.below(2) == 1),
        11 => Value::String(STRINGS[rng.below(STRINGS.len() as u64) as usize].into()),
        12 => Value::F64([f64::NAN, -0.0, 1e300, 1e-300][rng.below(4) as usize]),
        _ => {
            // Arrays: of bools (the recurrent-layer schedule), of numbers, of
            // strings (vocabularies, merges), of arrays.
            let n = [0, 1, 2, 3, 300, 1000][rng.below(6) as usize];
            let proto = random_value(rng, depth + 1);
            let ty = proto.value_type();
            let items = (0..n)
                .map(|_| match &proto {
                    Value::Bool(_) => Value::Bool(rng.below(2) == 1),
                    Value::U32(_) => Value::U32(rng.below(400) as u32),
                    Value::I32(_) => Value::I32(rng.below(6) as i32),
                    _ => proto.clone(),
                })
                .collect();
            Value::array(ty, items)
        }
    }
}

fn without_key(meta: &Metadata, key: &str) -> Metadata {
    let mut m = Metadata::new();
    for (k, v) in meta.iter() {
        if k != key {
            m.set(k, v.clone());
        }
    }
    m
}

/// Mutation `case` of `base`, deterministic; `None` when the mutation gives
/// nothing the writer can encode.
fn mutate(base: &Base, case: u64) -> Option<Vec<u8>> {
    let mut rng = Rng::new(case.wrapping_mul(0x2545_f491_4f6c_dd1d) ^ base.bytes.len() as u64);
    let arch = base.meta.get_str("general.architecture").ok()?.to_string();
    let mut bytes = base.bytes.clone();
    let rounds = 1 + rng.below(3);
    let mut meta = base.meta.clone();
    let mut tensors = base.tensors.clone();
    let mut structured = false;
    for _ in 0..rounds {
        // The header's extent in what is left of the file.
        let header = base.data_start.min(bytes.len());
        let kind = rng.below(9);
        if kind < 3 && header == 0 {
            continue;
        }
        match kind {
            // Bit flips in the header.
            0 => {
                for _ in 0..1 + rng.below(8) {
                    let at = rng.below(header as u64) as usize;
                    bytes[at] ^= 1 << rng.below(8);
                }
            }
            // An extreme integer over the header.
            1 => {
                let v = interesting(&mut rng).to_le_bytes();
                let w = [1, 2, 4, 8][rng.below(4) as usize];
                let at = rng.below(header as u64) as usize;
                let end = (at + w).min(bytes.len());
                bytes[at..end].copy_from_slice(&v[..end - at]);
            }
            // Truncation, mostly inside the header.
            2 => {
                let cut = if rng.below(4) == 0 {
                    rng.below(bytes.len() as u64 + 1)
                } else {
                    rng.below(header as u64)
                };
                bytes.truncate(cut as usize);
            }
            // A metadata value replaced (or added).
            3 | 4 => {
                let arch = meta.get_str("general.architecture").unwrap_or(&arch);
                let keys = known_keys(arch);
                let key = if rng.below(4) == 0 {
                    let all: Vec<&str> = meta.iter().map(|(k, _)| k).collect();
                    all[rng.below(all.len() as u64) as usize].to_string()
                } else {
                    keys[rng.below(keys.len() as u64) as usize].clone()
                };
                let v = random_value(&mut rng, 0);
                meta.set(key, v);
                structured = true;
            }
            // A metadata key removed.
            5 => {
                let keys: Vec<String> = meta.iter().map(|(k, _)| k.to_string()).collect();
                meta = without_key(&meta, &keys[rng.below(keys.len() as u64) as usize]);
                structured = true;
            }
            // The architecture swapped, with its keys renamed.
            6 => {
                let to = ["qwen3moe", "qwen3next", "qwen35moe"][rng.below(3) as usize];
                let mut m = Metadata::new();
                for (k, v) in meta.iter() {
                    let k = match k.strip_prefix(&format!("{arch}.")) {
                        Some(rest) => format!("{to}.{rest}"),
                        None => k.to_string(),
                    };
                    m.set(k, v.clone());
                }
                m.set("general.architecture", to);
                meta = m;
                structured = true;
            }
            // A tensor re-dimensioned or re-typed (data sized to match).
            7 => {
                let i = rng.below(tensors.len() as u64) as usize;
                let (_, dims, ty, data) = &mut tensors[i];
                if rng.below(2) == 0 {
                    let j = rng.below(dims.len() as u64) as usize;
                    dims[j] = match rng.below(4) {
                        0 => interesting(&mut rng),
                        1 => dims[j] * 2,
                        2 => dims[j] / 2,
                        _ => dims[j] + 32,
                    };
                    if rng.below(4) == 0 {
                        dims.push(1 + rng.below(4));
                        dims.truncate(4);
                    }
                } else {
                    *ty = GgmlType::ALL[rng.below(GgmlType::ALL.len() as u64) as usize];
                }
                let size = samesum_gguf::tensor_size("t", dims, *ty).ok()?;
                if size > 16 << 20 {
                    return None;
                }
                data.resize(size as usize, 0);
                structured = true;
            }
            // A tensor dropped, renamed or moved to the front.
            _ => {
                let i = rng.below(tensors.len() as u64) as usize;
                match rng.below(3) {
                    0 => {
                        tensors.remove(i);
                    }
                    1 => tensors[i].0 = format!("blk.{}.{}", rng.below(4), tensors[i].0),
                    _ => {
                        let t = tensors.remove(i);
                        tensors.insert(0, t);
                    }
                }
                structured = true;
            }
        }
    }
    if structured {
        // A structured edit re-encodes the file from the edited metadata and
        // tensors; the case's byte edits are dropped.
        encode(&meta, &tensors)
    } else {
        Some(bytes)
    }
}

fn check_matrix(m: &Matrix, file_len: usize) {
    let row =
        m.ty.row_bytes(m.cols as u64)
            .expect("a bound matrix has whole blocks");
    assert_eq!(m.row_bytes as u64, row, "{}: row bytes", m.name);
    let len = m
        .n_mats
        .checked_mul(m.rows)
        .and_then(|n| n.checked_mul(m.row_bytes))
        .and_then(|n| n.checked_add(m.offset))
        .expect("a bound matrix's extent fits in usize");
    assert!(
        len <= file_len,
        "{}: ends at {len}, past the file's {file_len} bytes",
        m.name
    );
}

/// The loaded model's weights lie inside the file and agree with its
/// hyperparameters.
fn check_model(m: &Model) {
    let hp: &HParams = &m.hp;
    let n = m.bytes().len();
    let w = &m.w;
    assert_eq!(hp.layers.len(), hp.n_layer);
    assert_eq!(w.layers.len(), hp.n_layer);
    assert_eq!(w.output_norm.len(), hp.n_embd);
    assert_eq!(w.token_embd.rows, w.n_vocab);
    check_matrix(&w.token_embd, n);
    check_matrix(&w.output, n);
    for (l, (layer, kind)) in w.layers.iter().zip(&hp.layers).enumerate() {
        assert_eq!(layer.attn_norm.len(), hp.n_embd, "layer {l}");
        assert_eq!(layer.ffn_norm.len(), hp.n_embd, "layer {l}");
        let mut mats: Vec<&Matrix> = vec![
            &layer.moe.router,
            &layer.moe.gate,
            &layer.moe.up,
            &layer.moe.down,
        ];
        if let Some(s) = &layer.moe.shared {
            mats.extend([&s.gate, &s.up, &s.down, &s.gate_inp]);
        }
        match (&layer.mixer, kind) {
            (Mixer::Attention(a), LayerKind::Attention) => {
                assert_eq!(a.q_norm.len(), hp.head_dim);
                assert_eq!(a.k_norm.len(), hp.head_dim);
                mats.extend([&a.q, &a.k, &a.v, &a.o]);
            }
            (Mixer::Linear(d), LayerKind::Linear) => {
                let s = hp.ssm.expect("a delta-net layer has delta-net sizes");
                assert_eq!(d.conv.len(), s.d_conv * s.conv_dim());
                assert_eq!(d.dt_bias.len(), s.n_v_heads);
                assert_eq!(d.a.len(), s.n_v_heads);
                assert_eq!(d.norm.len(), s.head_v_dim);
                match &d.input {
                    DeltaInput::Split { qkv, z } => mats.extend([qkv, z]),
                    DeltaInput::Fused { ssm_in } => mats.push(ssm_in),
                }
                match &d.ba {
                    DeltaBa::Fused(ba) => mats.push(ba),
                    DeltaBa::Split { beta, alpha } => mats.extend([beta, alpha]),
                }
                mats.push(&d.out);
            }
            _ => panic!("layer {l}: mixer does not match the schedule {kind:?}"),
        }
        for mat in mats {
            check_matrix(mat, n);
        }
    }
}

/// Load `bytes` as the server does (tokenizer, hyperparameters, weights),
/// rendering and encoding a chat turn when the tokenizer builds; `Err` with
/// the error's text when loading refuses the file. Binding needs a mapped
/// file, so the bytes go through `dir`.
fn load(bytes: &[u8], dir: &Path) -> Result<(), String> {
    let g = Gguf::from_bytes(bytes).map_err(|e| e.to_string())?;
    if let Ok(tok) = Tokenizer::from_metadata(g.metadata()) {
        if let Ok(text) = tok.chat_messages(&[("system", "be brief"), ("user", "hi <|im_end|>")])
            && let Ok(ids) = tok.encode(&text)
        {
            let _ = tok.decode(&ids);
        }
        let _ = tok.encode("Hello, world! 123 <|im_start|>");
    }
    let hp = HParams::from_metadata(g.metadata(), g.tensors().len()).map_err(|e| e.to_string())?;
    let path = dir.join("m.gguf");
    std::fs::write(&path, bytes).expect("write the model");
    let m = Model::load(&path).map_err(|e| e.to_string())?;
    assert_eq!(m.hp, hp, "Model::load read other hyperparameters");
    check_model(&m);
    Ok(())
}

/// Where and why the last panic happened, as the hook that the mutation
/// test installs records it (the hook is process-wide: a panic of another
/// test in this file while it runs is recorded, not printed).
static LAST_PANIC: Mutex<Option<String>> = Mutex::new(None);

/// Run mutations `0..cases` of `base`: how many were encoded, how many
/// loaded, and each one that panicked (its input kept in the temporary
/// directory, named in the line).
fn fuzz_base(b: usize, base: &Base, cases: u64, dir: &Path) -> (u64, u64, Vec<String>) {
    let (mut ok, mut run, mut panics) = (0, 0, Vec::new());
    let only = fuzz_setting().1;
    for case in 0..cases {
        if only.is_some_and(|o| o != b as u64 * 1_000_000 + case) {
            continue;
        }
        CASE.store(b as u64 * 1_000_000 + case, Ordering::Relaxed);
        let Some(bytes) = mutate(base, case) else {
            continue;
        };
        run += 1;
        match std::panic::catch_unwind(|| load(&bytes, dir)) {
            Ok(Ok(())) => ok += 1,
            Ok(Err(_)) => {}
            Err(_) => {
                let keep =
                    std::env::temp_dir().join(format!("load-fuzz-{}-{case}.gguf", base.name));
                std::fs::write(&keep, &bytes).expect("keep the failing input");
                let why = LAST_PANIC.lock().unwrap().take().unwrap_or_default();
                panics.push(format!(
                    "{} mutation {case} ({}): {why}",
                    base.name,
                    keep.display()
                ));
            }
        }
    }
    CASE.store(u64::MAX, Ordering::Relaxed);
    (run, ok, panics)
}

#[test]
fn small_models_load() {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in small_models() {
        assert!(
            bytes.len() < 100 << 10,
            "{name}: {} bytes, more than a small seed",
            bytes.len()
        );
        load(&bytes, dir.path()).unwrap_or_else(|e| panic!("{name}: {e}"));
        let m = Model::load(dir.path().join("m.gguf")).unwrap();
        assert_eq!(m.hp.n_layer, 2);
        if m.hp.arch.is_hybrid() {
            assert_eq!(m.hp.layers, [LayerKind::Linear, LayerKind::Attention]);
        }
    }
    if let Some(out) = std::env::var_os("SAMESUM_FUZZ_SEEDS") {
        let out = Path::new(&out);
        std::fs::create_dir_all(out).unwrap();
        for (name, bytes) in small_models() {
            std::fs::write(out.join(format!("{name}.gguf")), bytes).unwrap();
        }
    }
}

/// `SAMESUM_LOAD_FUZZ`: the number of cases per base model (default 400),
/// or `case:ID` to rerun one case (ID as a failure's line names it):
/// (cases, the one case).
fn fuzz_setting() -> (u64, Option<u64>) {
    let v = std::env::var("SAMESUM_LOAD_FUZZ").unwrap_or_default();
    match v
        .strip_prefix("case:")
        .and_then(|id| id.parse::<u64>().ok())
    {
        // Enough cases that the full-width models' eighth reaches it too.
        Some(id) => ((id % 1_000_000 + 1) * 8, Some(id)),
        None => (v.parse().unwrap_or(400), None),
    }
}

#[test]
fn mutated_models_load_or_fail_cleanly() {
    let cases = fuzz_setting().0;
    let dir = tempfile::tempdir().unwrap();
    let mut bases: Vec<Base> = small_models()
        .into_iter()
        .map(|(n, b)| Base::new(n.to_string(), b))
        .collect();
    // The synth command's tiny shapes, one layer each: full-width tensors
    // (2 MiB files), fewer cases.
    let tiny = ["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"];
    for shape in tiny {
        let opts =
            SynthOptions::new(shapes::by_name(shape).unwrap(), GgmlType::Q8_0, 3).with_layers(1);
        bases.push(Base::new(shape.to_string(), synth_bytes(&opts)));
    }
    // Record panics instead of printing them: every panicking case is
    // listed at the end.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| info.payload().downcast_ref::<&str>().copied())
            .unwrap_or("?");
        let at = info.location().map(|l| l.to_string()).unwrap_or_default();
        *LAST_PANIC.lock().unwrap() = Some(format!("{at}: {msg}"));
    }));
    let (mut run, mut ok, mut panics) = (0, 0, Vec::new());
    for (b, base) in bases.iter().enumerate() {
        let n = if b < 3 { cases } else { cases / 8 };
        let (r, o, p) = fuzz_base(b, base, n, dir.path());
        eprintln!(
            "{}: {r} mutations, {o} loaded, {} panicked",
            base.name,
            p.len()
        );
        run += r;
        ok += o;
        panics.extend(p);
    }
    std::panic::set_hook(hook);
    assert!(
        panics.is_empty(),
        "{} mutations panicked:\n{}",
        panics.len(),
        panics.join("\n")
    );
    // The mutations must reach both outcomes: most fail, some still load.
    assert!(run > cases, "only {run} mutations could be encoded");
    assert!(
        ok > 0,
        "no mutation loaded: the mutations only test the header"
    );
    assert!(
        ok < run,
        "every mutation loaded: the mutations change nothing"
    );
}

/// `base` with metadata `edits` applied (`{arch}` in a key is the
/// architecture's name), loaded.
fn load_edited(arch: &str, edits: &[(&str, Value)]) -> Result<(), String> {
    let (_, bytes) = small_models()
        .into_iter()
        .find(|(a, _)| *a == arch)
        .expect("a small model of arch");
    let base = Base::new(arch.into(), bytes);
    let mut meta = base.meta.clone();
    for (k, v) in edits {
        meta.set(k.replace("{arch}", arch), v.clone());
    }
    let bytes = encode(&meta, &base.tensors).expect("encodes");
    let dir = tempfile::tempdir().unwrap();
    load(&bytes, dir.path())
}

/// Head sizes whose products overflow `usize` are refused, not multiplied:
/// two heads of 2^63 dims (the query projection's rows would be 2^64).
#[test]
fn overflowing_attention_sizes_are_an_error() {
    let big = Value::U64(1 << 63);
    let e = load_edited(
        "qwen3moe",
        &[
            ("{arch}.attention.key_length", big.clone()),
            ("{arch}.attention.value_length", big),
        ],
    );
    assert!(e.is_err());
    // The gated query of the hybrids has twice the rows: 2 * 2 * 2^62.
    let big = Value::U64(1 << 62);
    let e = load_edited(
        "qwen3next",
        &[
            ("{arch}.attention.key_length", big.clone()),
            ("{arch}.attention.value_length", big),
        ],
    );
    assert!(e.is_err());
}

/// Delta-net sizes whose products overflow are refused: a key head dim of
/// 2^63 makes `Ssm::key_dim` (two key heads) or `Ssm::conv_dim` (one) overflow.
#[test]
fn overflowing_delta_net_sizes_are_an_error() {
    for groups in [1u32, 2] {
        let e = load_edited(
            "qwen35moe",
            &[
                ("{arch}.ssm.state_size", Value::U64(1 << 63)),
                ("{arch}.ssm.group_count", Value::U32(groups)),
            ],
        );
        assert!(e.is_err(), "{groups} key heads");
    }
}
