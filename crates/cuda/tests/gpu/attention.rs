//! Attention on the GPU: head shapes, the KV cache types, the opt-in fast passes.

use super::*;

/// The two slices hold the same bits, element by element.
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

/// The attention kernel's paths by head dim (q in registers up to 128, in
/// shared memory above; the value pass's thread groups depend on it too) at
/// the real models' shapes, which the tiny models (head dim 64) do not reach:
/// the row contract byte for byte and the CPU backend within the f32 bar;
/// the score passes and the value passes' two forms byte-equal to each other.
#[test]
fn attention_at_the_real_models_head_shapes() {
    if !gpu() {
        return;
    }
    let cpu = Cpu::new(2);
    // (query heads, KV heads, head dim): qwen3moe-30b-a3b, qwen35moe-35b-a3b,
    // a group of 16, and a head dim whose thread groups do not divide the
    // 256-thread block (96).
    for (heads, kv_heads, head_dim) in [(32, 4, 128), (16, 2, 256), (16, 1, 128), (6, 3, 96)] {
        let (_dir, model) = attention_model(heads, kv_heads, head_dim);
        // Both score passes for head dims 65-128 (q in registers; q in
        // shared memory four keys a step), and the tensor-core passes.
        // And the tensor-core passes with each step's products added in fp32.
        for (q4, tc, acc) in [
            (false, false, false),
            (true, false, false),
            (false, true, false),
            (false, true, true),
        ] {
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            cuda.set_attention_q4(q4);
            cuda.set_switch("ATT_TC", tc).unwrap();
            cuda.set_switch("ATT_TC_ACC", acc).unwrap();
            let what =
                format!("heads {heads}/{kv_heads} x {head_dim}, q4 {q4}, tc {tc}, acc {acc}");
            // Every shape here has a tensor-core kernel: the switch reaches it.
            let kernel = cuda
                .attention_kernel(head_dim as usize, (heads / kv_heads) as usize, 64)
                .0;
            assert_eq!(
                kernel.starts_with("attention_tiles_tc"),
                tc,
                "{what}: {kernel}"
            );
            assert_eq!(kernel.ends_with("_acc"), acc, "{what}: {kernel}");
            if let Err(e) = block_ops_match(&cuda, &model, MS, 78) {
                panic!("{what}: {e}");
            }
            for m in [1, 7, 64, 300] {
                ops_close(&model, &cuda, &cpu, m, 1e-5, &what);
            }
            eprintln!("{what}: row-invariant for m in {MS:?}, within 1e-5 of the CPU");
        }
        // And the two score passes give the same bytes: whole forward passes
        // over 300 tokens (4 key tiles, the last one partial), chunks of 64.
        let toks = test_tokens(&model, 13);
        let mut a = Cuda::new(0, &model, false).unwrap();
        a.set_attention_q4(false);
        // The q4 score pass with the switches given, checked to reach `want`.
        let q4_arm = |switches: &[(&str, bool)], want: &str| {
            let mut c = Cuda::new(0, &model, false).unwrap();
            c.set_attention_q4(true);
            for &(name, on) in switches {
                c.set_switch(name, on).unwrap();
            }
            let got = c
                .attention_kernel(head_dim as usize, (heads / kv_heads) as usize, 64)
                .0;
            assert_eq!(got, want, "heads {heads}/{kv_heads} x {head_dim}");
            c
        };
        let b = q4_arm(&[("ATT_Q4P", false)], "attention_tiles_q4");
        // attention_tiles_q4's logits in chunks of 64, 7 and 1 (replay).
        let want: Vec<(usize, Vec<f32>)> = [64, 7, 1]
            .into_iter()
            .map(|chunk| (chunk, all_logits(&b, &model, &toks, chunk)))
            .collect();
        let la = all_logits(&a, &model, &toks, 64);
        assert!(
            same_bits(&la, &want[0].1),
            "heads {heads}/{kv_heads} x {head_dim}: the two score passes differ"
        );
        // And the session-10 forms (the value pass without per-key checks up
        // to the keys every pair sees, the score butterfly without selects
        // over permuted q rows; the default) give the bytes of the session-9
        // kernel (every key checked, selects), in chunks of 64 and of 7.
        let c = q4_arm(&[("ATT_VFULL", false)], "attention_tiles_q4_checked");
        for (chunk, lb) in &want[..2] {
            let lc = all_logits(&c, &model, &toks, *chunk);
            assert!(
                same_bits(lb, &lc),
                "heads {heads}/{kv_heads} x {head_dim} chunk {chunk}: the session-10 passes differ from the session-9 kernel"
            );
        }
        // attention_tiles_q4's f16-cache logits, for both lean arms below.
        let want_f16: Vec<(usize, Vec<f32>)> = [64, 1]
            .into_iter()
            .map(|chunk| (chunk, all_logits_kv(&b, &model, &toks, chunk, KvType::F16)))
            .collect();
        // Each lean arm against q4: the row contract, then every chunk's
        // logits with an f32 cache and with an f16 one.
        let lean_arm = |arm: &Cuda, name: &str, seed: u64| {
            if let Err(e) = block_ops_match(arm, &model, MS, seed) {
                panic!("heads {heads}/{kv_heads} x {head_dim}, {name}: {e}");
            }
            for (chunk, lb) in &want {
                let lp = all_logits(arm, &model, &toks, *chunk);
                assert!(
                    same_bits(lb, &lp),
                    "heads {heads}/{kv_heads} x {head_dim} chunk {chunk}: {name} differs from attention_tiles_q4"
                );
            }
            for (chunk, lb) in &want_f16 {
                let lp = all_logits_kv(arm, &model, &toks, *chunk, KvType::F16);
                assert!(
                    same_bits(lb, &lp),
                    "heads {heads}/{kv_heads} x {head_dim} chunk {chunk}, f16 cache: {name} differs from attention_tiles_q4"
                );
            }
        };
        // The lean form (attention_tiles_q4p: typed cache loads, tile
        // offsets, per-pair indices once a block, padded score rows, the
        // value loads eight keys ahead) gives the bytes of the session-10
        // one, batched in chunks of 64 and 7 and replayed; with an f16
        // cache too (its own instantiation).
        let p = q4_arm(
            &[("ATT_Q4P", true), ("ATT_Q4W", false)],
            "attention_tiles_q4p",
        );
        lean_arm(&p, "attention_tiles_q4p", 79);
        // And the wide form (attention_tiles_q4w: four dims of several pairs
        // a thread in the value pass; the default), the same way.
        let w = q4_arm(
            &[("ATT_Q4P", true), ("ATT_Q4W", true), ("ATT_P32", false)],
            "attention_tiles_q4w",
        );
        lean_arm(&w, "attention_tiles_q4w", 83);
        // And the wide form at 32 pairs a block (attention_tiles_q4w2, head
        // dims 128 and 256 with query groups dividing 16; the others keep
        // attention_tiles_q4w), the same way.
        let gs = heads / kv_heads;
        let want2 = if (head_dim == 128 || head_dim == 256) && 16 % gs == 0 {
            "attention_tiles_q4w2"
        } else {
            "attention_tiles_q4w"
        };
        let w2 = q4_arm(
            &[("ATT_Q4P", true), ("ATT_Q4W", true), ("ATT_P32", true)],
            want2,
        );
        lean_arm(&w2, want2, 89);
        // Calls of at most 16 pairs (decode) take the 16-pair kernel.
        if want2 == "attention_tiles_q4w2" {
            let mut st = w2.new_state(&model, 400, KvType::F32).unwrap();
            forward(&model, &w2, &mut st, &toks[..64], Logits::Last).unwrap();
            assert_eq!(w2.last_attention_kernel(), want2, "a 64-row call");
            forward(&model, &w2, &mut st, &toks[64..65], Logits::Last).unwrap();
            assert_eq!(
                w2.last_attention_kernel(),
                "attention_tiles_q4w",
                "a one-row call"
            );
        }
        // And four keys a score step above head dim 128 (`ATT_KB4`,
        // attention_tiles_q4w2k4), the same way.
        if want2 == "attention_tiles_q4w2" && head_dim > 128 {
            let k4 = q4_arm(
                &[
                    ("ATT_Q4P", true),
                    ("ATT_Q4W", true),
                    ("ATT_P32", true),
                    ("ATT_KB4", true),
                ],
                "attention_tiles_q4w2k4",
            );
            lean_arm(&k4, "attention_tiles_q4w2k4", 97);
        }
    }
}

/// `CudaOptions::fast_attention` (`--attention fast`): the backend takes the
/// tensor-core passes with fp32 accumulation where the shape allows, says so
/// in its name, and batched prefill still equals replay byte for byte (300
/// tokens, chunks of 64 and of 7, on every tiny shape).
#[test]
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
        assert_eq!(
            cuda.attention_kernel(128, 8, 64).0,
            "attention_tiles_tc_acc"
        );
        assert!(cuda.name().contains("fast attention"), "{}", cuda.name());
        let exact = Cuda::new(0, &model, false).unwrap();
        assert_eq!(exact.attention_kernel(128, 8, 64).0, "attention_tiles_q4w2");
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
/// f32 (the CUDA-core and the tensor-core passes, at
/// the real models' head shapes), and whole forward passes over 300 tokens
/// (two key tiles) byte-equal batched (chunks of 64) and replayed, on every
/// tiny shape.
#[test]
fn f16_kv_cache_on_the_gpu() {
    if !gpu() {
        return;
    }
    let cpu = Cpu::new(2);
    for (heads, kv_heads, head_dim) in [(32, 4, 128), (16, 2, 256)] {
        let (_dir, model) = attention_model(heads, kv_heads, head_dim);
        for tc in [false, true] {
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            cuda.set_switch("ATT_TC", tc).unwrap();
            let what = format!("f16 KV, heads {heads}/{kv_heads} x {head_dim}, tc {tc}");
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

/// An attention layer's head norms, RoPE and KV write in one launch
/// (`qk_norm_rope_kv`) against rms_norm_small, rope (twice) and kv_write:
/// the same logits bytes at every position (f32 and f16 caches; gated and
/// ungated attention; the real models' head shapes), and fewer launches.
#[test]
fn fused_head_norms_rope_and_kv_write_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    let mut models: Vec<(String, tempfile::TempDir, Model)> = SHAPES
        .iter()
        .map(|s| {
            let (d, m) = synth(s, GgmlType::Q4_K, 37);
            (s.to_string(), d, m)
        })
        .collect();
    for (h, kv, hd) in [(32u32, 4u32, 128u32), (16, 2, 256)] {
        let (d, m) = attention_model(h, kv, hd);
        models.push((format!("attention {h}/{kv} x {hd}"), d, m));
    }
    for (what, _d, model) in &models {
        for kv in [KvType::F32, KvType::F16] {
            let what = format!("{what} {kv:?}");
            let (on, off) = fusion_arms(model, "QK_FUSE", 5, kv, &what);
            assert!(on < off, "{what}: {on} launches fused, {off} apart");
            eprintln!(
                "{what}: qk_norm_rope_kv == norms + rope + kv_write; launches {on} against {off}"
            );
        }
    }
}

/// One decode row's attention tile in compact code (`attention_one`)
/// against attention_tiles_q4: the same logits bytes at every position (300
/// tokens: two key tiles), replayed and in chunks, f32 and f16 caches, on
/// every tiny shape and the real models' head shapes; the compact kernel is
/// the one a replayed step launched, and prefill chunks keep the tile kernel.
#[test]
fn compact_decode_attention_equals_the_tile_kernel() {
    if !gpu() {
        return;
    }
    let mut models: Vec<(String, tempfile::TempDir, Model)> = SHAPES
        .iter()
        .map(|s| {
            let (d, m) = synth(s, GgmlType::Q4_K, 61);
            (s.to_string(), d, m)
        })
        .collect();
    for (h, kv, hd) in [
        (32u32, 4u32, 128u32),
        (16, 2, 256),
        (16, 1, 128),
        (4, 1, 256),
    ] {
        let (d, m) = attention_model(h, kv, hd);
        models.push((format!("attention {h}/{kv} x {hd}"), d, m));
    }
    for (what, _d, model) in &models {
        for kv in [KvType::F32, KvType::F16] {
            let what = format!("{what} {kv:?}");
            fusion_arms(model, "ATT_ONE", 31, kv, &what);
            let (on, _off) = switch_arms(model, "ATT_ONE");
            let toks = test_tokens(model, 31);
            all_logits_kv(&on, model, &toks[..3], 3, kv);
            assert_ne!(
                on.last_attention_kernel(),
                "attention_one",
                "{what}: a 3-row chunk"
            );
            all_logits_kv(&on, model, &toks[..3], 1, kv);
            assert_eq!(
                on.last_attention_kernel(),
                "attention_one",
                "{what}: one row"
            );
            eprintln!("{what}: attention_one == attention_tiles_q4 (replay, chunks 64 and 7)");
        }
    }
}
