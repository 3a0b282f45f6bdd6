//! Attention on the GPU: the real models' head shapes, the reference kernel,
//! the f16 KV cache, row groups, the opt-in fast passes.

use super::*;

/// A one-layer f32 model of tiny-qwen3moe's shape with attention of the
/// given heads and head dim (the real models' attention shapes).
fn attention_model(heads: u32, kv_heads: u32, head_dim: u32) -> (tempfile::TempDir, Model) {
    let shape = shapes::Shape {
        heads,
        kv_heads,
        head_dim,
        layers: 1,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    };
    synth_shape(shape, GgmlType::F32, 4)
}

/// Random inputs for `Cuda::attention_host`: `m` rows of q at positions
/// `pos ..` and the cache's k and v for positions `0 .. pos + m`, for
/// `heads` = (query heads, KV heads, head dim).
fn attention_inputs(
    heads: (usize, usize, usize),
    pos: usize,
    m: usize,
    seed: u64,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (hq, hkv, hd) = heads;
    let mut rng = Rng::new(seed);
    let mut fill = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.range(-2.0, 2.0)).collect() };
    let q = fill(m * hq * hd);
    let k = fill((pos + m) * hkv * hd);
    let v = fill((pos + m) * hkv * hd);
    (q, k, v)
}

/// The attention kernels' paths by head dim (lean code at 128 and 256, the
/// plain tile kernel's otherwise; the value pass's thread groups) at
/// the real models' shapes, which the tiny models (head dim 64) do not reach,
/// with the default kernels and the fast (tensor-core) ones: the kernel each
/// call size takes, the row contract byte for byte and the CPU backend
/// within the f32 bar. The default kernels (16 and 32 pairs a block) give
/// the bytes of the reference kernel (`attention_tiles`) with f32 and f16
/// caches over one to three key tiles, and whole forward passes over 300
/// tokens give the same bytes batched (chunks of 64 and 7) and replayed.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn attention_at_the_real_models_head_shapes() {
    if !gpu() {
        return;
    }
    let cpu = Cpu::new(2);
    // (query heads, KV heads, head dim): qwen3moe-30b-a3b, qwen35moe-35b-a3b,
    // a group of 16 (the largest the backend takes), and a head dim whose
    // thread groups do not divide the 256-thread block (96).
    for (heads, kv_heads, head_dim) in [(32, 4, 128), (16, 2, 256), (16, 1, 128), (6, 3, 96)] {
        let (_dir, model) = attention_model(heads, kv_heads, head_dim);
        let (hq, hkv, hd) = (heads as usize, kv_heads as usize, head_dim as usize);
        let gs = hq / hkv;
        // The 32-pair kernel takes head dims 128 and 256 with query groups
        // dividing 16, for calls of more than 16 pairs.
        let wide = (hd == 128 || hd == 256) && 16 % gs == 0;
        for fast in [false, true] {
            let opts = CudaOptions {
                fast_attention: fast,
                ..Default::default()
            };
            let cuda = Cuda::with_options(0, &model, false, opts).unwrap();
            let what = format!("heads {heads}/{kv_heads} x {head_dim}, fast {fast}");
            // The flash kernel takes head dims 64, 128 and 256 with query
            // groups dividing 128; other shapes keep the exact kernels.
            let flash = fast && matches!(hd, 64 | 128 | 256) && 128 % gs == 0;
            for rows in [1, 2, 3, 64] {
                let want = if flash {
                    match hd {
                        128 => "attention_flash_128",
                        _ => "attention_flash_256",
                    }
                } else if wide && rows * gs > 16 {
                    "attention_tiles_q4w2"
                } else {
                    "attention_tiles_q4w"
                };
                assert_eq!(
                    cuda.attention_kernel(hd, gs, rows),
                    want,
                    "{what}, {rows} rows"
                );
            }
            if let Err(e) = block_ops_match(&cuda, &model, MS, 78) {
                panic!("{what}: {e}");
            }
            let mixer_tol = if flash { FLASH_TOL } else { 1e-5 };
            for m in [1, 7, 64, 300, 600] {
                ops_close_mixer(&model, &cuda, &cpu, m, 1e-5, mixer_tol, &what, KvType::F32);
            }
            eprintln!(
                "{what}: row-invariant for m in {MS:?}, attention within {mixer_tol:e} of the CPU"
            );
        }
        let cuda = Cuda::new(0, &model, false).unwrap();
        let what = format!("heads {heads}/{kv_heads} x {head_dim}");
        // The default kernels against the reference on the same rows and
        // cache: decode rows, calls of 16 pairs or fewer and of more, one
        // key tile or several (the last one partial).
        for f16 in [false, true] {
            for (i, (pos, m)) in [
                (0, 1),
                (0, 7),
                (0, 64),
                (300, 1),
                (300, 3),
                (250, 300),
                (511, 40),
            ]
            .into_iter()
            .enumerate()
            {
                let (q, k, v) = attention_inputs((hq, hkv, hd), pos, m, 90 + i as u64);
                let got = cuda
                    .attention_host(&q, &k, &v, (hq, hkv, hd), pos, f16, false)
                    .unwrap();
                let kernel = cuda.last_attention_kernel();
                let want = cuda
                    .attention_host(&q, &k, &v, (hq, hkv, hd), pos, f16, true)
                    .unwrap();
                assert_eq!(cuda.last_attention_kernel(), "attention_tiles");
                assert_eq!(got.len(), want.len());
                assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite");
                assert!(
                    same_bits(&got, &want),
                    "{what}, f16 {f16}, {m} rows at {pos}: {kernel} differs from attention_tiles"
                );
            }
        }
        eprintln!("{what}: the default kernels == attention_tiles (f32 and f16 caches)");
        let toks = test_tokens(&model, 13);
        for kv in [KvType::F32, KvType::F16] {
            let replay = all_logits_kv(&cuda, &model, &toks, 1, kv);
            assert!(replay.iter().all(|v| v.is_finite()), "{what}: non-finite");
            for chunk in [64, 7] {
                let batched = all_logits_kv(&cuda, &model, &toks, chunk, kv);
                assert_eq!(batched.len(), replay.len());
                assert!(
                    same_bits(&batched, &replay),
                    "{what} {kv:?} chunk {chunk}: batched != replay"
                );
            }
        }
        // Calls of at most 16 pairs (decode) take the 16-pair kernel.
        if wide {
            let mut st = cuda.new_state(&model, 400, KvType::F32).unwrap();
            forward(&model, &cuda, &mut st, &toks[..64], Logits::Last).unwrap();
            assert_eq!(
                cuda.last_attention_kernel(),
                "attention_tiles_q4w2",
                "{what}: a 64-row call"
            );
            forward(&model, &cuda, &mut st, &toks[64..65], Logits::Last).unwrap();
            assert_eq!(
                cuda.last_attention_kernel(),
                "attention_tiles_q4w",
                "{what}: a one-row call"
            );
        }
    }
}

/// Attention of host rows refuses the shapes the kernels do not take and
/// inputs of the wrong sizes, naming them.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn attention_host_refuses_bad_shapes() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 3);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let (q, k, v) = attention_inputs((4, 1, 512), 0, 1, 1);
    let e = cuda
        .attention_host(&q, &k, &v, (4, 1, 512), 0, false, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("head dims up to 256"), "{e}");
    let (q, k, v) = attention_inputs((4, 1, 64), 3, 2, 1);
    let e = cuda
        .attention_host(&q, &k, &v, (4, 1, 64), 2, false, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("2 positions"), "{e}");
}

/// `CudaOptions::fast_attention` (`--attention fast`): the backend takes the
/// flash kernel (f16 tensor cores) where the shape allows, says so in its
/// name, and batched prefill still equals replay byte for byte (300
/// tokens, chunks of 64 and of 7, on every tiny shape).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn fast_attention_option_takes_the_tensor_core_passes() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 17);
        let fast = CudaOptions {
            fast_attention: true,
            ..Default::default()
        };
        let cuda = Cuda::with_options(0, &model, false, fast).unwrap();
        assert_eq!(cuda.attention_kernel(128, 8, 64), "attention_flash_128");
        assert_eq!(cuda.attention_kernel(256, 8, 1), "attention_flash_256");
        assert_eq!(cuda.attention_kernel(96, 2, 64), "attention_tiles_q4w");
        assert!(cuda.name().contains("fast attention"), "{}", cuda.name());
        let exact = Cuda::new(0, &model, false).unwrap();
        assert_eq!(exact.attention_kernel(128, 8, 64), "attention_tiles_q4w2");
        assert!(!exact.name().contains("fast attention"));
        let toks = test_tokens(&model, 3);
        let replay = all_logits(&cuda, &model, &toks, 1);
        assert!(replay.iter().all(|v| v.is_finite()), "{shape}: non-finite");
        for chunk in [64, 7] {
            let batched = all_logits(&cuda, &model, &toks, chunk);
            assert!(
                same_bits(&batched, &replay),
                "{shape} chunk {chunk}: fast attention batched != replay"
            );
        }
        eprintln!("{shape}: fast attention, batched == replay over 300 tokens (chunks 64 and 7)");
        // Past two split boundaries (512 and 1,024 keys), both caches (an
        // f16 cache's tiles are copied a tile ahead, an f32 cache's
        // converted in place): the fold of the splits in the blocks equals
        // decode's split partials and combine.
        let mut rng = Rng::new(31);
        let long: Vec<u32> = (0..1100)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        for kv in [KvType::F32, KvType::F16] {
            let replay = all_logits_kv(&cuda, &model, &long, 1, kv);
            assert!(replay.iter().all(|v| v.is_finite()), "{shape}: non-finite");
            for chunk in [512, 100] {
                let batched = all_logits_kv(&cuda, &model, &long, chunk, kv);
                assert!(
                    same_bits(&batched, &replay),
                    "{shape} {kv:?} chunk {chunk}: fast attention batched != replay over 1,100 tokens"
                );
            }
        }
        eprintln!(
            "{shape}: fast attention, batched == replay over 1,100 tokens (f32 and f16 caches)"
        );
    }
}

/// The largest relative L2 distance, over two calls in a row, between layer
/// 0's attention on the GPU with a `gpu_kv` cache and on the CPU with a
/// `cpu_kv` cache, on the same random rows.
fn attention_distance(
    model: &Model,
    cuda: &Cuda,
    cpu: &Cpu,
    m: usize,
    gpu_kv: KvType,
    cpu_kv: KvType,
) -> f64 {
    let d = model.hp.n_embd;
    let Mixer::Attention(a) = &model.w.layers[0].mixer else {
        panic!("layer 0 is not attention");
    };
    let mut rng = Rng::new(11 + m as u64);
    let x: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
    let xg = cuda.upload(&x).unwrap();
    let mut sg = cuda.new_state(model, 2 * m, gpu_kv).unwrap();
    let mut sc = cpu.new_state(model, 2 * m, cpu_kv).unwrap();
    let mut worst = 0f64;
    for _ in 0..2 {
        let mut g = cuda.upload(&vec![f32::NAN; m * d]).unwrap();
        let mut c = vec![f32::NAN; m * d];
        cuda.attention(model, 0, a, &xg, &mut sg, &mut g).unwrap();
        cpu.attention(model, 0, a, &x, &mut sc, &mut c).unwrap();
        cuda.advance(&mut sg, m);
        cpu.advance(&mut sc, m);
        worst = worst.max(rel_l2(&cuda.download(&g).unwrap(), &c));
    }
    worst
}

/// The f16 KV cache (`--kv-type f16`): attention layers within `F16_KV_TOL`
/// of the CPU on halves, and several times closer to it than to the CPU on
/// f32 (the default and the fast passes, at the real models' head shapes),
/// and whole forward passes over 300 tokens (two key tiles) byte-equal
/// batched (chunks of 64) and replayed, on every tiny shape.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn f16_kv_cache_on_the_gpu() {
    if !gpu() {
        return;
    }
    let cpu = Cpu::new(2);
    for (heads, kv_heads, head_dim) in [(32, 4, 128), (16, 2, 256)] {
        let (_dir, model) = attention_model(heads, kv_heads, head_dim);
        for fast in [false, true] {
            let opts = CudaOptions {
                fast_attention: fast,
                ..Default::default()
            };
            let cuda = Cuda::with_options(0, &model, false, opts).unwrap();
            let what = format!("f16 KV, heads {heads}/{kv_heads} x {head_dim}, fast {fast}");
            if fast {
                // The flash kernel rounds q and the probabilities too: its own
                // bar against the CPU on halves.
                for m in [1, 64, 300] {
                    ops_close_mixer(&model, &cuda, &cpu, m, 1e-5, FLASH_TOL, &what, KvType::F16);
                }
                continue;
            }
            for m in [1, 64, 300] {
                ops_close_kv(&model, &cuda, &cpu, m, 1e-5, &what, KvType::F16);
                let same = attention_distance(&model, &cuda, &cpu, m, KvType::F16, KvType::F16);
                let other = attention_distance(&model, &cuda, &cpu, m, KvType::F16, KvType::F32);
                eprintln!(
                    "{what} m={m}: GPU on halves vs CPU on halves {same:.2e}, vs CPU on f32 {other:.2e}"
                );
                assert!(
                    4.0 * same <= other,
                    "{what} m={m}: the GPU's halves are not the CPU's ({same:.3e} against {other:.3e})"
                );
            }
            eprintln!("{what}: within the bars of the CPU on halves");
        }
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 12);
        let cuda = Cuda::new(0, &model, false).unwrap();
        let toks = test_tokens(&model, 5);
        let batched = all_logits_kv(&cuda, &model, &toks, 64, KvType::F16);
        let replay = all_logits_kv(&cuda, &model, &toks, 1, KvType::F16);
        assert!(batched.iter().all(|v| v.is_finite()), "{shape}: non-finite");
        assert!(
            same_bits(&batched, &replay),
            "{shape}: f16 KV batched != replay"
        );
        eprintln!("{shape}: f16 KV, 300 tokens, chunks of 64 byte-equal to replay");
    }
}

/// Attention rows run in groups when their partials would pass the cap:
/// logits at every position byte-equal with the default cap, with one row
/// per group, and with groups of a few rows, over 300 tokens (two key tiles).
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn attention_row_groups_equal_one_call() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 6);
        let mut cuda = Cuda::new(0, &model, false).unwrap();
        let mut rng = Rng::new(8);
        let tokens: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        let whole = all_logits(&cuda, &model, &tokens, 64);
        for cap in [1usize, 20_000] {
            cuda.set_attention_partials(cap);
            let grouped = all_logits(&cuda, &model, &tokens, 64);
            assert!(
                same_bits(&whole, &grouped),
                "{shape}: attention in row groups (cap {cap} bytes) differs"
            );
        }
        eprintln!("{shape}: attention in row groups == one call");
    }
}

/// The flash kernel against transformers: the Hugging Face fixtures (tiny
/// random-weight models of the attention architectures in f32, logits of
/// every position) within `HF_BAR_F16_KV` (2e-3 of the largest logit, what
/// llama.cpp's f16 attention measures on such models) with f32 and f16 KV
/// caches, the model's whole forward on the fast passes.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn flash_attention_meets_the_hugging_face_bar() {
    if !gpu() {
        return;
    }
    use samesum_engine::conformance::{HF_BAR_F16_KV, fixture_error_kv, fixtures_dir};
    let dir = fixtures_dir();
    for name in ["qwen3moe", "qwen3moe-yarn", "qwen35moe", "qwen3next"] {
        let model = Model::load(dir.join(format!("{name}.gguf"))).expect("fixture");
        let opts = CudaOptions {
            fast_attention: true,
            ..Default::default()
        };
        let cuda = Cuda::with_options(0, &model, false, opts).unwrap();
        let json = std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("manifest");
        for kv in [KvType::F32, KvType::F16] {
            let worst = fixture_error_kv(
                &cuda,
                &model,
                &json,
                &dir.join(format!("{name}.logits")),
                kv,
            )
            .unwrap_or_else(|e| panic!("{name}: {e}"));
            eprintln!(
                "{name}, flash attention, {kv:?} KV: max|diff|/max|ref| = {worst:.2e} (bar {HF_BAR_F16_KV:e})"
            );
            assert!(
                worst <= HF_BAR_F16_KV,
                "{name}, flash attention, {kv:?} KV: max|diff|/max|ref| = {worst:.3e} > {HF_BAR_F16_KV:e}"
            );
        }
    }
}

/// A decode step of several sequences on the flash kernels (every
/// sequence's row in one launch of the head norms and KV write, the split
/// passes and the combine, each row's cache and position from a table):
/// each sequence's logits and state byte-equal to the same tokens alone, at
/// depths on both sides of the 512-key splits (prompts of 3 to 1,100
/// tokens), f16 and f32 caches, at the real models' head shapes and on the
/// tiny models.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn flash_decode_rows_of_several_sequences_equal_each_alone() {
    use samesum_engine::{Segment, forward_batch};
    if !gpu() {
        return;
    }
    let fast = CudaOptions {
        fast_attention: true,
        ..Default::default()
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut models: Vec<(String, tempfile::TempDir, Model)> = Vec::new();
    for (h, kvh, hd) in [(32u32, 4u32, 128u32), (16, 2, 256)] {
        let (d, m) = attention_model(h, kvh, hd);
        models.push((format!("heads {h}/{kvh} x {hd}"), d, m));
    }
    for shape in SHAPES {
        let (d, m) = synth(shape, GgmlType::Q4_K, 23);
        models.push((shape.to_string(), d, m));
    }
    for (what, _dir, model) in &models {
        let cuda = Cuda::with_options(0, model, false, fast).unwrap();
        let mut rng = Rng::new(41);
        let v = model.w.n_vocab as u64;
        let lens = [3usize, 511, 700, 1100];
        let steps = 5;
        let toks: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n + steps).map(|_| rng.below(v) as u32).collect())
            .collect();
        for kv in [KvType::F16, KvType::F32] {
            let [mut together, mut alone] =
                prefilled_twice(model, &cuda, &toks, &lens, 1100 + steps, kv);
            for k in 0..steps {
                let mut segs: Vec<Segment<'_, _>> = together
                    .iter_mut()
                    .enumerate()
                    .map(|(i, st)| Segment {
                        state: st,
                        tokens: &toks[i][lens[i] + k..lens[i] + k + 1],
                        want: Logits::Last,
                    })
                    .collect();
                let got = forward_batch(model, &cuda, &mut segs).unwrap();
                // The kernel the host launched last: the first step's (later
                // steps are recorded and replayed, which launch from the
                // recording, and the steps alone below launch their own).
                if k == 0
                    && model.hp.n_head_kv > 0
                    && model
                        .w
                        .layers
                        .iter()
                        .all(|l| matches!(l.mixer, Mixer::Attention(_)))
                {
                    assert_eq!(
                        cuda.last_attention_kernel(),
                        "attention_flash_dec_seqs",
                        "{what}: a step of several decode rows takes the one-launch kernels"
                    );
                }
                for (i, want) in got.iter().enumerate() {
                    let tok = &toks[i][lens[i] + k..lens[i] + k + 1];
                    let one = forward(model, &cuda, &mut alone[i], tok, Logits::Last).unwrap();
                    assert!(want.iter().all(|x| x.is_finite()), "{what}: non-finite");
                    assert_eq!(
                        bits(want),
                        bits(&one),
                        "{what} {kv:?}: step {k}, sequence {i} (depth {}) differs from alone",
                        lens[i] + k
                    );
                }
            }
            for i in 0..lens.len() {
                assert_eq!(
                    bits(&cuda.download_state(&together[i]).unwrap()),
                    bits(&cuda.download_state(&alone[i]).unwrap()),
                    "{what} {kv:?}: state of sequence {i}"
                );
            }
        }
        eprintln!("{what}: several sequences' decode rows == each alone (f16 and f32 caches)");
    }
}

/// A value past the largest finite half in the cache: prefill multiplies the
/// values of keys past each row's position by probabilities of exactly 0,
/// which decode never reads, so the cache keeps such a value finite (else 0
/// times infinity would make the earlier rows NaN in prefill alone). The
/// flash passes over an f32 cache, 64 rows in one call against each row
/// alone, byte for byte, with a row of values of 1e6 at the end.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn flash_rows_equal_alone_with_values_past_the_half_range() {
    if !gpu() {
        return;
    }
    let (_dir, model) = attention_model(32, 4, 128);
    let fast = CudaOptions {
        fast_attention: true,
        ..Default::default()
    };
    let cuda = Cuda::with_options(0, &model, false, fast).unwrap();
    let heads = (32, 4, 128);
    let (qw, kvw) = (32 * 128, 4 * 128);
    let m = 64;
    let (q, k, mut v) = attention_inputs(heads, 0, m, 77);
    for x in &mut v[(m - 1) * kvw..] {
        *x = 1e6;
    }
    let batched = cuda
        .attention_host(&q, &k, &v, heads, 0, false, false)
        .unwrap();
    assert!(
        batched.iter().all(|x| x.is_finite()),
        "batched rows not finite"
    );
    for r in 0..m {
        let one = cuda
            .attention_host(
                &q[r * qw..(r + 1) * qw],
                &k[..(r + 1) * kvw],
                &v[..(r + 1) * kvw],
                heads,
                r,
                false,
                false,
            )
            .unwrap();
        let same = one
            .iter()
            .zip(&batched[r * qw..(r + 1) * qw])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "row {r}: the 64-row call differs from the row alone");
    }
}

/// The flash prefill kernel against the decode kernel at every head shape
/// it takes (two m-tiles a warp at head dims 64 and 128, one at 256; query
/// groups of 8 and 16), f16 and f32 caches: each row of a call of many rows
/// (a row tile partly filled, a key split crossed) has the bytes of that row alone, which takes the decode
/// kernel and its fold of the splits.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn flash_prefill_rows_equal_each_row_alone_at_every_head_shape() {
    if !gpu() {
        return;
    }
    for heads in [(32, 4, 128), (16, 2, 256), (16, 1, 128), (8, 2, 64)] {
        let (hq, hkv, hd) = heads;
        let (_dir, model) = attention_model(hq as u32, hkv as u32, hd as u32);
        let fast = CudaOptions {
            fast_attention: true,
            ..Default::default()
        };
        let cuda = Cuda::with_options(0, &model, false, fast).unwrap();
        let (qw, kvw) = (hq * hd, hkv * hd);
        for f16 in [true, false] {
            for (i, (pos, m)) in [(0, 37), (900, 150)].into_iter().enumerate() {
                let (q, k, v) = attention_inputs(heads, pos, m, 300 + i as u64);
                let batched = cuda
                    .attention_host(&q, &k, &v, heads, pos, f16, false)
                    .unwrap();
                let kernel = cuda.last_attention_kernel();
                assert!(kernel.starts_with("attention_flash_"), "{kernel}");
                assert!(
                    batched.iter().all(|x| x.is_finite()),
                    "{heads:?}: not finite"
                );
                for r in 0..m {
                    let n = pos + r + 1;
                    let one = cuda
                        .attention_host(
                            &q[r * qw..(r + 1) * qw],
                            &k[..n * kvw],
                            &v[..n * kvw],
                            heads,
                            pos + r,
                            f16,
                            false,
                        )
                        .unwrap();
                    assert!(
                        same_bits(&one, &batched[r * qw..(r + 1) * qw]),
                        "{heads:?}, f16 {f16}, {m} rows at {pos}: row {r} ({kernel}) differs from the row alone"
                    );
                }
            }
        }
        eprintln!("{heads:?}: flash prefill rows == each row alone (f16 and f32 caches)");
    }
}

/// A step whose leading sequences are decode rows and whose later ones are
/// prompt chunks (or decode rows after a chunk): the leading rows take the
/// one-launch decode kernels, the rest their own calls, and every sequence
/// gets the bytes of a call of its own, on every tiny shape with the flash
/// attention.
#[test]
#[ignore = "needs a CUDA device (scripts/gpu.sh runs it with --include-ignored)"]
fn leading_decode_rows_beside_prompt_chunks_equal_each_alone() {
    use samesum_engine::{Segment, forward_batch};
    if !gpu() {
        return;
    }
    let fast = CudaOptions {
        fast_attention: true,
        ..Default::default()
    };
    // Rows of each of four sequences per step, and how many lead as decode
    // rows (one-launch) in it.
    let steps: [([usize; 4], usize); 5] = [
        ([1, 1, 1, 5], 3),
        ([1, 1, 7, 1], 2),
        ([1, 1, 1, 1], 4),
        ([2, 1, 1, 1], 0),
        ([1, 3, 1, 1], 0),
    ];
    let lens = [3usize, 511, 700, 40];
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 29);
        let cuda = Cuda::with_options(0, &model, false, fast).unwrap();
        let att_layers = model
            .w
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, Mixer::Attention(_)))
            .count();
        let mut rng = Rng::new(53);
        let v = model.w.n_vocab as u64;
        let total: Vec<usize> = (0..4)
            .map(|i| lens[i] + steps.iter().map(|s| s.0[i]).sum::<usize>())
            .collect();
        let toks: Vec<Vec<u32>> = total
            .iter()
            .map(|&n| (0..n).map(|_| rng.below(v) as u32).collect())
            .collect();
        let [mut together, mut alone] =
            prefilled_twice(&model, &cuda, &toks, &lens, 800, KvType::F16);
        let mut at = lens;
        for (k, (rows, lead)) in steps.iter().enumerate() {
            let before = cuda.one_launch_attention_rows();
            let mut segs: Vec<Segment<'_, _>> = together
                .iter_mut()
                .enumerate()
                .map(|(i, st)| Segment {
                    state: st,
                    tokens: &toks[i][at[i]..at[i] + rows[i]],
                    want: Logits::Last,
                })
                .collect();
            let got = forward_batch(&model, &cuda, &mut segs).unwrap();
            drop(segs);
            // Steps of all decode rows may run recorded (no launches to
            // count); the others run their leading rows in one launch.
            if rows.iter().any(|&n| n > 1) {
                assert_eq!(
                    cuda.one_launch_attention_rows() - before,
                    lead * att_layers,
                    "{shape}: step {k} ({rows:?}) ran {lead} leading rows in one launch a layer"
                );
            }
            for i in 0..4 {
                let t = &toks[i][at[i]..at[i] + rows[i]];
                let one = forward(&model, &cuda, &mut alone[i], t, Logits::Last).unwrap();
                assert!(
                    got[i].len() == one.len()
                        && got[i]
                            .iter()
                            .zip(&one)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{shape}: step {k} ({rows:?}), sequence {i} differs from alone"
                );
                at[i] += rows[i];
            }
        }
        eprintln!("{shape}: leading decode rows beside prompt chunks == each alone");
    }
}
