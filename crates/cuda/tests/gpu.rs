//! The CUDA backend on a GPU: the row contract for every block op (one m-row
//! call byte-equal to m one-row calls, NaN-poisoned outputs, fresh random
//! inputs), CUDA against the CPU backend per op, batched forward against replay,
//! and the Hugging Face fixtures. Every test skips where no CUDA device is
//! present, unless `SAMESUM_REQUIRE_GPU=1` (the GPU script sets it).

use samesum_cuda::tier::{RESERVE, TierSizes};
use samesum_cuda::{Cuda, CudaError, CudaOptions, TcKernel};
use samesum_engine::backend::{Backend, Norm};
use samesum_engine::conformance::{block_ops_match, forward_rows_match};
use samesum_engine::cpu::Cpu;
use samesum_engine::model::weights::Mixer;
use samesum_engine::{KvType, Logits, Model, forward};
use samesum_gguf::GgmlType;
use samesum_quant::rng::Rng;
use samesum_synth::{SynthOptions, shapes, write_model};
use std::path::PathBuf;

const MS: &[usize] = &[1, 2, 3, 5, 16, 17, 64, 100, 257];
const SHAPES: &[&str] = &["tiny-qwen3moe", "tiny-qwen3next", "tiny-qwen35moe"];

fn gpu() -> bool {
    let n = samesum_cuda::device_count();
    if n == 0 {
        assert!(
            std::env::var("SAMESUM_REQUIRE_GPU").as_deref() != Ok("1"),
            "SAMESUM_REQUIRE_GPU=1 but no CUDA device was found"
        );
        eprintln!("skipped: no CUDA device");
    }
    n > 0
}

/// The shapes of `names` (every one a known shape).
fn named_shapes(names: &[&str]) -> Vec<shapes::Shape> {
    names.iter().map(|n| shapes::by_name(n).unwrap()).collect()
}

fn synth(shape: &str, quant: GgmlType, seed: u64) -> (tempfile::TempDir, Model) {
    synth_shape(shapes::by_name(shape).unwrap(), quant, seed)
}

fn synth_shape(shape: shapes::Shape, quant: GgmlType, seed: u64) -> (tempfile::TempDir, Model) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    write_model(&SynthOptions::new(shape, quant, seed), &p, &mut |_, _| {}).unwrap();
    let m = Model::load(&p).unwrap();
    (dir, m)
}

/// `m` random activation rows for `w` (normal, times 0.5) and, for an expert
/// stack, each row's expert: row r unused (-1) where r % every.0 == every.1,
/// else a random expert.
fn random_rows(
    rng: &mut Rng,
    w: &samesum_engine::model::weights::Matrix,
    m: usize,
    every: (usize, usize),
) -> (Vec<f32>, Option<Vec<i32>>) {
    let x: Vec<f32> = (0..m * w.cols).map(|_| rng.normal() * 0.5).collect();
    let ids = (w.n_mats > 1).then(|| {
        (0..m)
            .map(|r| {
                if r % every.0 == every.1 {
                    -1
                } else {
                    (rng.next_u64() % w.n_mats as u64) as i32
                }
            })
            .collect()
    });
    (x, ids)
}

/// Rows as the expert plan places them in wide calls: each matrix's rows
/// together (matrices in a random order, 1 to 70 rows each), then -1 rows
/// up to a multiple of 32, so tiles end in padding of 1 to 31 rows.
fn padded_plan_rows(
    rng: &mut Rng,
    w: &samesum_engine::model::weights::Matrix,
) -> (Vec<f32>, Vec<i32>) {
    let mut ids = Vec::new();
    let mut order: Vec<i32> = (0..w.n_mats as i32).collect();
    for i in (1..order.len()).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    for &e in order.iter().take(6) {
        let c = 1 + (rng.next_u64() % 70) as usize;
        ids.extend(std::iter::repeat_n(e, c));
        ids.resize(ids.len().div_ceil(32) * 32, -1);
    }
    let x: Vec<f32> = (0..ids.len() * w.cols)
        .map(|_| rng.normal() * 0.5)
        .collect();
    (x, ids)
}

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

/// 300 fixed tokens of `model`'s vocabulary (two key tiles), varied by `salt`.
fn test_tokens(model: &Model, salt: u32) -> Vec<u32> {
    (0..300u32)
        .map(|i| (i * 7919 + salt) % model.w.n_vocab as u32)
        .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.iter().zip(b).all(|(p, q)| p.to_bits() == q.to_bits())
}

/// Two backends on `model`: switch `name` on in the first, off in the second.
fn switch_arms(model: &Model, name: &str) -> (Cuda, Cuda) {
    let mut on = Cuda::new(0, model, false).unwrap();
    on.set_switch(name, true).unwrap();
    let mut off = Cuda::new(0, model, false).unwrap();
    off.set_switch(name, false).unwrap();
    (on, off)
}

/// The arms' logits at every position, the prompt fed in chunks of each of
/// `chunks`, hold the same bits (`what` names the comparison); returns the
/// first arm's logits per chunk size.
fn assert_same_logits(
    on: &Cuda,
    off: &Cuda,
    model: &Model,
    toks: &[u32],
    chunks: &[usize],
    what: &str,
) -> Vec<Vec<f32>> {
    chunks
        .iter()
        .map(|&chunk| {
            let p = all_logits(on, model, toks, chunk);
            let q = all_logits(off, model, toks, chunk);
            assert!(same_bits(&p, &q), "chunk {chunk}: {what}");
            p
        })
        .collect()
}

fn repo() -> PathBuf {
    std::env::var_os("SAMESUM_REPO")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../.."))
}

#[test]
fn every_block_op_obeys_the_row_contract_on_the_gpu() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        for quant in [
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
            GgmlType::BF16,
            GgmlType::F16,
            GgmlType::F32,
        ] {
            let (_d, model) = synth(shape, quant, 9);
            let cuda = Cuda::new(0, &model, false).unwrap();
            if let Err(e) = block_ops_match(&cuda, &model, MS, 77) {
                panic!("{shape} {quant:?}: {e}");
            }
            eprintln!("{shape} {quant:?}: every block op row-invariant for m in {MS:?}");
        }
    }
}

/// The one-row decode kernels (`mm_*_1`) against the 16-row tile kernels, byte
/// for byte: every quantized matrix of a layer and the head, every format,
/// m = 1..16 with and without expert ids (unused -1 rows included), outputs
/// NaN-poisoned; and the fused GLU kernels against two matmuls and silu_mul.
#[test]
fn one_row_kernels_equal_the_tile_kernels() {
    if !gpu() {
        return;
    }
    let (mut checked, mut glu_checked) = (0, 0);
    for quant in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
    ] {
        for shape in SHAPES {
            let (_d, model) = synth(shape, quant, 13);
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            let l0 = &model.w.layers[0];
            let mut mats = vec![&l0.moe.gate, &l0.moe.up, &l0.moe.down, &model.w.output];
            match &l0.mixer {
                Mixer::Attention(a) => mats.extend([&a.q, &a.k, &a.v, &a.o]),
                Mixer::Linear(d) => mats.push(&d.out),
            }
            let mut rng = Rng::new(31);
            for w in mats {
                if !matches!(
                    w.ty,
                    GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K | GgmlType::Q8_0
                ) {
                    continue;
                }
                for m in 1..=16 {
                    let (x, ids) = random_rows(&mut rng, w, m, (5, 2));
                    cuda.set_row_kernels(true);
                    let one = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
                    cuda.set_row_kernels(false);
                    let tile = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
                    assert!(
                        one.iter().all(|v| v.is_finite()),
                        "{shape} {}: non-finite",
                        w.name
                    );
                    assert!(
                        same_bits(&one, &tile),
                        "{shape} {} {:?} m={m}: one-row kernel != tile kernel",
                        w.name,
                        w.ty
                    );
                    checked += 1;
                }
            }
            // The fused GLU (gate, up and silu_mul in one launch) against
            // two matmuls and silu_mul.
            let mut glus = vec![(&l0.moe.gate, &l0.moe.up)];
            if let Some(sh) = &l0.moe.shared {
                glus.push((&sh.gate, &sh.up));
            }
            for (g, u) in glus {
                for m in 1..=16 {
                    let (x, ids) = random_rows(&mut rng, g, m, (5, 2));
                    cuda.set_row_kernels(true);
                    cuda.set_fused_glu(true);
                    let fused = cuda.glu_host(g, u, &x, m, ids.as_deref()).unwrap();
                    cuda.set_fused_glu(false);
                    let apart = cuda.glu_host(g, u, &x, m, ids.as_deref()).unwrap();
                    assert!(
                        fused.iter().all(|v| v.is_finite()),
                        "{shape} {}: non-finite GLU",
                        g.name
                    );
                    assert!(
                        same_bits(&fused, &apart),
                        "{shape} {} {:?} m={m}: fused GLU != two matmuls and silu_mul",
                        g.name,
                        g.ty
                    );
                    glu_checked += 1;
                }
            }
        }
    }
    assert!(checked > 100, "too few cases: {checked}");
    assert!(glu_checked > 100, "too few GLU cases: {glu_checked}");
    eprintln!(
        "one-row matmul cases equal to the tile kernels: {checked}; fused GLU cases equal: {glu_checked}"
    );
}

/// The lane-row Q4_K kernels (a lane per weight row, `mm_q4_k_lane_*`)
/// against the warp-row kernels they replace, byte for byte: plain rows with
/// and without expert ids (unused rows among them), the fused GLU, and rows of
/// 18 blocks (4,608 columns: two of the kernel's 16-block chunks) and of 2
/// (the MoE down projection, where the block has two warps), on poisoned
/// outputs. The forward passes (decode against prefill) cover the grouped
/// projections and the MoE jobs.
#[test]
fn lane_row_matmuls_equal_the_warp_row_kernels() {
    if !gpu() {
        return;
    }
    let sh = shapes::Shape {
        hidden: 4608,
        expert_ff: 512,
        layers: 1,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    };
    let (_dir, model) = synth_shape(sh, GgmlType::Q4_K, 19);
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    let l0 = &model.w.layers[0];
    let mut mats = vec![&l0.moe.gate, &l0.moe.up, &l0.moe.down];
    if let Mixer::Attention(a) = &l0.mixer {
        mats.extend([&a.q, &a.k, &a.v, &a.o]);
    }
    let mut rng = Rng::new(41);
    let (mut checked, mut glus, mut blocks) = (0, 0, std::collections::BTreeSet::new());
    for w in mats {
        assert_eq!(w.ty, GgmlType::Q4_K, "{}", w.name);
        blocks.insert(w.cols / 256);
        for m in [1, 2, 3, 5, 8, 16] {
            let (x, ids) = random_rows(&mut rng, w, m, (3, 1));
            cuda.set_lane_rows(true);
            let lane = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
            cuda.set_lane_rows(false);
            let warp = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
            assert!(lane.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
            assert!(
                same_bits(&lane, &warp),
                "{} m={m}: lane rows != warp rows",
                w.name
            );
            checked += 1;
        }
    }
    for m in [1, 2, 7, 16] {
        let (x, ids) = random_rows(&mut rng, &l0.moe.gate, m, (4, 2));
        cuda.set_lane_rows(true);
        let lane = cuda
            .glu_host(&l0.moe.gate, &l0.moe.up, &x, m, ids.as_deref())
            .unwrap();
        cuda.set_lane_rows(false);
        let warp = cuda
            .glu_host(&l0.moe.gate, &l0.moe.up, &x, m, ids.as_deref())
            .unwrap();
        assert!(lane.iter().all(|v| v.is_finite()), "non-finite GLU");
        assert!(same_bits(&lane, &warp), "m={m}: lane GLU != warp GLU");
        glus += 1;
    }
    assert!(
        blocks.contains(&18) && blocks.contains(&2),
        "block counts covered: {blocks:?}"
    );
    cuda.set_lane_rows(true);
    eprintln!("lane-row cases equal to the warp-row kernels: {checked} matmuls, {glus} GLUs");
}

/// A layer's input projections in one launch (`mm_*_multi_1`: attention q, k,
/// v; delta-net qkv, z, beta, alpha) against one matmul each, byte for byte,
/// every format, one row and a few rows.
#[test]
fn grouped_input_projections_equal_separate_matmuls() {
    if !gpu() {
        return;
    }
    use samesum_engine::model::weights::{DeltaBa, DeltaInput};
    let mut groups = 0;
    for quant in [
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
    ] {
        for shape in SHAPES {
            let (_d, model) = synth(shape, quant, 29);
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            let mut rng = Rng::new(3);
            for lw in &model.w.layers {
                let ws: Vec<&samesum_engine::model::weights::Matrix> = match &lw.mixer {
                    Mixer::Attention(a) => vec![&a.q, &a.k, &a.v],
                    Mixer::Linear(d) => match (&d.input, &d.ba) {
                        (DeltaInput::Split { qkv, z }, DeltaBa::Split { beta, alpha }) => {
                            vec![qkv, z, beta, alpha]
                        }
                        _ => continue,
                    },
                };
                for m in [1usize, 2, 5] {
                    let x: Vec<f32> = (0..m * ws[0].cols).map(|_| rng.normal()).collect();
                    let one = cuda.mm_group_host(&ws, &x, m, true).unwrap();
                    let sep = cuda.mm_group_host(&ws, &x, m, false).unwrap();
                    for ((w, p), q) in ws.iter().zip(&one).zip(&sep) {
                        assert!(
                            p.iter().all(|v| v.is_finite()),
                            "{shape} {}: non-finite",
                            w.name
                        );
                        assert!(
                            same_bits(p, q),
                            "{shape} {} {:?} m={m}: grouped != separate",
                            w.name,
                            w.ty
                        );
                    }
                    groups += 1;
                }
            }
        }
    }
    assert!(groups > 20, "too few groups: {groups}");
    eprintln!("{groups} grouped input projections equal to separate matmuls");
}

/// The MoE block with its rows gathered as Q8_K blocks (each token row
/// quantized once) against gathering f32 rows and quantizing those, byte for
/// byte, at decode and prefill sizes, with the fused GLU on and off.
#[test]
fn quantized_gather_equals_f32_gather() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 17);
        let mut cuda = Cuda::new(0, &model, false).unwrap();
        let dm = model.hp.n_embd;
        let mut rng = Rng::new(8);
        for m in [1, 2, 5, 17, 64, 300] {
            let x: Vec<f32> = (0..m * dm).map(|_| rng.normal()).collect();
            let xd = cuda.upload(&x).unwrap();
            let mut outs = Vec::new();
            for (q, glu) in [(true, true), (false, false), (true, false)] {
                cuda.set_quantized_gather(q);
                cuda.set_fused_glu(glu);
                let mut y = cuda.upload(&vec![f32::NAN; m * dm]).unwrap();
                cuda.moe(&model, &model.w.layers[0].moe, &xd, &mut y)
                    .unwrap();
                outs.push(cuda.download(&y).unwrap());
            }
            assert!(
                outs[0].iter().all(|v| v.is_finite()),
                "{shape} m={m}: non-finite"
            );
            for o in &outs[1..] {
                assert!(
                    same_bits(o, &outs[0]),
                    "{shape} m={m}: the quantized gather changed the MoE output"
                );
            }
        }
        eprintln!("{shape}: quantized gather == f32 gather, m up to 300");
    }
}

/// The register-tiled float kernel (prefill's routers and gates) against the
/// per-row float kernel and against one-row calls, byte for byte, for many m,
/// on the routers of every tiny shape and a wider one (768 columns: the
/// kernel's two-step loop ends on a half step), poisoned outputs.
#[test]
fn float_tile_matmuls_equal_the_row_kernel_and_single_rows() {
    if !gpu() {
        return;
    }
    let mut shapes_: Vec<shapes::Shape> = named_shapes(SHAPES);
    shapes_.push(shapes::Shape {
        hidden: 768,
        layers: 1,
        experts: 64,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    });
    // The wide kernel's last stage of 128 columns a quarter full, and a
    // router of 40 rows (the tiny shapes' routers of at most 8 rows take
    // mm_f32_few): a second block of 32 rows mostly past the matrix.
    shapes_.push(shapes::Shape {
        hidden: 800,
        layers: 1,
        experts: 40,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    });
    let mut checked = 0;
    for sh in &shapes_ {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("m.gguf");
        write_model(
            &SynthOptions::new(sh.clone(), GgmlType::Q8_0, 13),
            &p,
            &mut |_, _| {},
        )
        .unwrap();
        let model = Model::load(&p).unwrap();
        let mut cuda = Cuda::new(0, &model, false).unwrap();
        let router = &model.w.layers[0].moe.router;
        assert_eq!(
            router.ty,
            GgmlType::F32,
            "{}: the router is not f32",
            sh.name
        );
        // The shared expert's one-row input gate (mm_f32_few under the
        // wide switch) where the shape has one.
        let mut mats = vec![router];
        let mut l0 = model.w.layers[0].moe.shared.iter();
        mats.extend(l0.next().map(|s| &s.gate_inp));
        let mut rng = Rng::new(17);
        for (w, m) in mats
            .iter()
            .flat_map(|w| [17, 24, 33, 100, 257].map(|m| (*w, m)))
        {
            let (x, _) = random_rows(&mut rng, w, m, (7, 3));
            cuda.set_float_tiles(true);
            cuda.set_switch("F32_WIDE", true).unwrap();
            let tile = cuda.matmul_host(w, &x, m, None, true).unwrap();
            cuda.set_switch("F32_WIDE", false).unwrap();
            let narrow = cuda.matmul_host(w, &x, m, None, true).unwrap();
            cuda.set_float_tiles(false);
            let row = cuda.matmul_host(w, &x, m, None, true).unwrap();
            assert!(
                tile.iter().all(|v| v.is_finite()),
                "{}: non-finite",
                sh.name
            );
            assert!(
                same_bits(&tile, &row),
                "{} m={m}: wide tiles != per-row float kernel",
                sh.name
            );
            assert!(
                same_bits(&narrow, &row),
                "{} m={m}: 4 x 16 tiles != per-row float kernel",
                sh.name
            );
            cuda.set_float_tiles(true);
            cuda.set_switch("F32_WIDE", true).unwrap();
            for r in [0, m / 2, m - 1] {
                let one = cuda
                    .matmul_host(w, &x[r * w.cols..(r + 1) * w.cols], 1, None, true)
                    .unwrap();
                assert!(
                    same_bits(&one, &tile[r * w.rows..(r + 1) * w.rows]),
                    "{} m={m} row {r}: one-row call differs",
                    sh.name
                );
            }
            checked += 1;
        }
    }
    eprintln!("float tile matmul cases equal: {checked}");
}

/// The tensor-core matmul tiles against the dp4a kernels and against one-row
/// calls, byte for byte: expert stacks and plain matrices, rows of several
/// experts in one tile (unsorted, with unused -1 rows), many m.
#[test]
fn tensor_core_matmuls_equal_the_dp4a_kernels_and_single_rows() {
    if !gpu() {
        return;
    }
    let (mut checked, mut live_skipped) = (0, 0);
    // The tiny shapes have 256 columns (one weight block per row); a wider
    // one runs the kernels' block loop over several blocks (odd and even).
    let mut shapes_: Vec<shapes::Shape> = named_shapes(SHAPES);
    shapes_.push(shapes::Shape {
        hidden: 768,
        expert_ff: 512,
        layers: 1,
        ..shapes::by_name("tiny-qwen3moe").unwrap()
    });
    for quant in [GgmlType::Q4_K, GgmlType::Q5_K] {
        for sh in &shapes_ {
            let shape = format!("{} x{}", sh.name, sh.hidden);
            let dir = tempfile::tempdir().unwrap();
            let p = dir.path().join("m.gguf");
            write_model(
                &SynthOptions::new(sh.clone(), quant, 11),
                &p,
                &mut |_, _| {},
            )
            .unwrap();
            let model = Model::load(&p).unwrap();
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            // Tensor cores for every matrix, however few its rows.
            cuda.set_switch("TC_SMALL", false).unwrap();
            // Async32 seven times: the mins sums on tensor cores (TC_MINS),
            // with padding groups skipped (TC_GROUPS), that at 8 warps a
            // block (TC_W8, Q4_K) or leaving rows of id -1 unwritten
            // (LIVE_ROWS, Q4_K), both of those with the copy offsets in
            // shared memory (TC_WSMEM, Q4_K), and by dp2a.
            for (tk, mins, groups, w8, live, ws) in [
                (TcKernel::Plain, true, false, false, false, false),
                (TcKernel::Pipelined, true, false, false, false, false),
                (TcKernel::Async, true, false, false, false, false),
                (TcKernel::Async32, true, false, false, false, false),
                (TcKernel::Async32, true, true, false, false, false),
                (TcKernel::Async32, true, true, true, false, false),
                (TcKernel::Async32, true, true, false, true, false),
                (TcKernel::Async32, true, true, false, false, true),
                (TcKernel::Async32, true, true, false, true, true),
                (TcKernel::Async32, false, false, false, false, false),
            ] {
                cuda.set_tc_kernel(tk);
                cuda.set_switch("TC_MINS", mins).unwrap();
                cuda.set_switch("TC_GROUPS", groups).unwrap();
                cuda.set_switch("TC_W8", w8).unwrap();
                cuda.set_switch("LIVE_ROWS", live).unwrap();
                cuda.set_switch("TC_WSMEM", ws).unwrap();
                let kind =
                    format!("{tk:?} mins-mma={mins} groups={groups} w8={w8} live={live} ws={ws} ");
                let moe = &model.w.layers[0].moe;
                let mats: Vec<&samesum_engine::model::weights::Matrix> = vec![&moe.gate, &moe.down]
                    .into_iter()
                    .chain(match &model.w.layers[0].mixer {
                        Mixer::Attention(a) => vec![&a.q],
                        Mixer::Linear(d) => vec![&d.out],
                    })
                    .filter(|w| w.ty == quant)
                    .collect();
                assert!(!mats.is_empty(), "{shape}: no {quant:?} matrix to test");
                let mut rng = Rng::new(5);
                for w in mats {
                    // Random rows at several m, and for expert stacks the
                    // plan's layout (tiles ending in padding).
                    let mut cases: Vec<(Vec<f32>, Option<Vec<i32>>)> = [17, 33, 64, 100, 257]
                        .iter()
                        .map(|&m| random_rows(&mut rng, w, m, (7, 3)))
                        .collect();
                    if w.n_mats > 1 {
                        let (x, ids) = padded_plan_rows(&mut rng, w);
                        cases.push((x, Some(ids)));
                    }
                    for (x, ids) in cases {
                        let m = x.len() / w.cols;
                        let mut tc = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
                        let dp = cuda.matmul_host(w, &x, m, ids.as_deref(), false).unwrap();
                        // With LIVE_ROWS the 32-row Q4_K kernel leaves rows
                        // of id -1 as they were (NaN; other kernels write
                        // their zeros): such a row is all NaN or all zeros,
                        // and every other row is as the dp4a kernels'.
                        if live {
                            for r in 0..m {
                                if ids.as_ref().is_none_or(|v| v[r] >= 0) {
                                    continue;
                                }
                                let row = &mut tc[r * w.rows..(r + 1) * w.rows];
                                if row.iter().all(|v| v.is_nan()) {
                                    live_skipped += 1;
                                    row.fill(0.0);
                                }
                            }
                        }
                        assert!(tc.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
                        assert!(
                            same_bits(&tc, &dp),
                            "{} m={m}: {kind}tensor cores != dp4a",
                            w.name
                        );
                        for r in [0, m / 2, m - 1] {
                            let one = cuda
                                .matmul_host(
                                    w,
                                    &x[r * w.cols..(r + 1) * w.cols],
                                    1,
                                    ids.as_ref().map(|v| &v[r..r + 1]),
                                    true,
                                )
                                .unwrap();
                            assert!(
                                same_bits(&one, &tc[r * w.rows..(r + 1) * w.rows]),
                                "{} m={m} row {r}: one-row call differs",
                                w.name
                            );
                        }
                        checked += 1;
                    }
                }
            }
        }
    }
    // The live arm did leave rows unwritten (the plan-layout cases take the
    // 32-row kernel).
    assert!(live_skipped > 0, "LIVE_ROWS left no row of id -1 unwritten");
    eprintln!("tensor-core matmul cases equal: {checked}; rows left unwritten: {live_skipped}");
}

/// Several Q4_K matrices in one tensor-core launch (`TC_JOBS`:
/// `mm_tc_q4_k_async32g_jobs`) against one launch each, byte for byte, with
/// poisoned outputs: a delta net's four input projections (beta and alpha
/// of a few rows beside the wide ones), attention's q, k and v, the shared
/// expert's gate and up, and the routed experts' gate and up on the plan's
/// layout (tiles of one expert ending in padding rows); and the logits with
/// the switch on and off. The jobs kernels with their copy offsets in shared
/// memory (`TC_WSMEM`) against the default jobs kernels the same way.
#[test]
fn tensor_core_jobs_equal_one_launch_each() {
    if !gpu() {
        return;
    }
    use samesum_engine::model::weights::{DeltaBa, DeltaInput, Matrix};
    let mut checked = 0;
    for name in ["tiny-qwen35moe", "tiny-qwen3moe"] {
        let sh = shapes::by_name(name).unwrap();
        let (_d, model) = synth_shape(sh, GgmlType::Q4_K, 61);
        let mut cuda = Cuda::new(0, &model, false).unwrap();
        let mut groups: Vec<(Vec<&Matrix>, bool)> = Vec::new();
        for layer in &model.w.layers {
            match &layer.mixer {
                Mixer::Attention(a) => groups.push((vec![&a.q, &a.k, &a.v], false)),
                Mixer::Linear(dn) => {
                    if let (DeltaInput::Split { qkv, z }, DeltaBa::Split { beta, alpha }) =
                        (&dn.input, &dn.ba)
                    {
                        groups.push((vec![qkv, z, beta, alpha], false));
                    }
                }
            }
            if let Some(sh) = &layer.moe.shared {
                groups.push((vec![&sh.gate, &sh.up], false));
            }
            groups.push((vec![&layer.moe.gate, &layer.moe.up], true));
        }
        assert!(groups.iter().any(|(ws, _)| ws.len() == 4) || name != "tiny-qwen35moe");
        let mut rng = Rng::new(67);
        for (ws, experts) in &groups {
            let w0 = ws[0];
            let cases: Vec<(Vec<f32>, Option<Vec<i32>>)> = if *experts {
                (0..2)
                    .map(|_| {
                        let (x, ids) = padded_plan_rows(&mut rng, w0);
                        (x, Some(ids))
                    })
                    .collect()
            } else {
                [64, 100, 257]
                    .iter()
                    .map(|&m| random_rows(&mut rng, w0, m, (7, 3)))
                    .collect()
            };
            for (x, ids) in cases {
                let m = x.len() / w0.cols;
                cuda.set_switch("TC_JOBS", true).unwrap();
                let joint = cuda
                    .tc_jobs_host(ws, &x, m, ids.as_deref())
                    .unwrap()
                    .unwrap_or_else(|| panic!("{name} {} m={m}: no joint launch", w0.name));
                // The jobs kernels with the copy offsets in shared memory
                // (`TC_WSMEM`): the same bytes as the default jobs kernels.
                cuda.set_switch("TC_WSMEM", true).unwrap();
                let joint_ws = cuda
                    .tc_jobs_host(ws, &x, m, ids.as_deref())
                    .unwrap()
                    .unwrap_or_else(|| panic!("{name} {} m={m}: no joint launch", w0.name));
                cuda.set_switch("TC_WSMEM", false).unwrap();
                for (w, (a, b)) in ws.iter().zip(joint.iter().zip(&joint_ws)) {
                    assert!(
                        same_bits(a, b),
                        "{name} {} m={m}: TC_WSMEM differs from the jobs kernel",
                        w.name
                    );
                }
                cuda.set_switch("TC_JOBS", false).unwrap();
                assert!(
                    cuda.tc_jobs_host(ws, &x, m, ids.as_deref())
                        .unwrap()
                        .is_none(),
                    "the switch is off"
                );
                for (w, y) in ws.iter().zip(&joint) {
                    assert!(y.iter().all(|v| v.is_finite()), "{}: non-finite", w.name);
                    let one = cuda.matmul_host(w, &x, m, ids.as_deref(), true).unwrap();
                    assert!(
                        same_bits(y, &one),
                        "{name} {} m={m}: the joint launch differs from its own launch",
                        w.name
                    );
                }
                checked += 1;
            }
        }
    }
    eprintln!("tensor-core joint launch cases equal: {checked}");
    assert_switch_keeps_logits(
        named_shapes(SHAPES),
        |s| s.name.to_string(),
        (71, 73),
        "TC_JOBS",
        &[300],
        "joint and separate tensor-core launches",
    );
    assert_switch_keeps_logits(
        named_shapes(SHAPES),
        |s| s.name.to_string(),
        (79, 83),
        "TC_WSMEM",
        &[300],
        "the jobs kernels with their copy offsets in shared memory",
    );
}

/// The one-launch expert plan (small calls) against the three-kernel plan
/// and a plain host reference, on random routings with skipped (-1) ids:
/// places padded per expert, pairs in token order, unused places -1.
/// Routing and the plan in one launch (decode sizes) against `route` and the
/// three-kernel plan: softmaxed logits, ids, weights and places, byte for
/// byte, with ties among the logits.
#[test]
fn the_one_launch_route_and_plan_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(4);
    let mut cases = 0;
    // With block routing, m <= 4 (e <= 1024) routes each row with the whole
    // block (ranks); otherwise (the default, and larger m) a row per warp
    // (argmax rounds, the ids handed to the plan in shared memory); all
    // against `route` and the three-kernel plan.
    let mut nans = 0;
    // Modes: one row by route_plan_one (the default), by route_plan_small's
    // warp path, by the whole block, by route_plan_one_r (`ROUTE_REGS`: the
    // row in registers for e <= 256, route_plan_one's code past that and
    // for rows with a NaN).
    let mut regs = 0;
    for (mode, e) in [0, 1, 2, 3]
        .into_iter()
        .flat_map(|b| [8usize, 128, 200, 256, 512, 1024].map(|e| (b, e)))
    {
        cuda.set_route_one(mode == 0 || mode == 3);
        cuda.set_block_route(mode == 2);
        cuda.set_switch("ROUTE_REGS", mode == 3).unwrap();
        let want = if mode == 3 {
            "route_plan_one_r"
        } else {
            "route_plan_one"
        };
        assert_eq!(cuda.route_kernels().1, want);
        // k = 32, the most one warp routes, on the one-row kernels.
        let ks: &[usize] = if mode == 0 || mode == 3 {
            &[1, 2, 8, 32]
        } else {
            &[1, 2, 8]
        };
        for &k in ks {
            for m in [1usize, 2, 3, 4, 16, 32] {
                if m * k > 256 || k > e || (k == 32 && m > 1) {
                    continue;
                }
                for pad in [1usize, 16] {
                    // Logits on a coarse grid, so equal values (ties) occur.
                    let mut lg: Vec<f32> = (0..m * e)
                        .map(|_| (rng.below(16) as f32 - 8.0) * 0.25)
                        .collect();
                    // Some rows hold a NaN (the block path falls back to the
                    // argmax rounds there).
                    if rng.below(4) == 0 {
                        lg[rng.below((m * e) as u64) as usize] = f32::NAN;
                        nans += 1;
                    }
                    let one = cuda.route_plan_host(&lg, m, k, pad, true).unwrap();
                    let sep = cuda.route_plan_host(&lg, m, k, pad, false).unwrap();
                    let fb = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(fb(&one.0), fb(&sep.0), "e={e} k={k} m={m}: softmax");
                    assert_eq!(one.1, sep.1, "e={e} k={k} m={m}: ids");
                    // A row holding a NaN may name -1 (a skipped pick: the
                    // argmax rounds do not order NaNs; seen on the H200 in
                    // session 7 on both paths alike); other rows name experts.
                    for (r, row) in one.1.chunks(k).enumerate() {
                        let nan = lg[r * e..(r + 1) * e].iter().any(|v| v.is_nan());
                        let lo = if nan { -1 } else { 0 };
                        assert!(
                            row.iter().all(|&i| i >= lo && i < e as i32),
                            "e={e} k={k} m={m} row {r}: ids {row:?}"
                        );
                    }
                    assert_eq!(fb(&one.2), fb(&sep.2), "e={e} k={k} m={m}: weights");
                    // Rows without a NaN against the host: the k largest of
                    // the GPU's softmax, larger first and lower id among
                    // equals, weighed by their sum in that order (so a
                    // shortcut shared by both kernels is checked too).
                    for r in 0..m {
                        if lg[r * e..(r + 1) * e].iter().any(|v| v.is_nan()) {
                            continue;
                        }
                        let row = &one.0[r * e..(r + 1) * e];
                        let mut order: Vec<usize> = (0..e).collect();
                        order
                            .sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap().then(a.cmp(&b)));
                        let want: Vec<i32> = order[..k].iter().map(|&i| i as i32).collect();
                        assert_eq!(
                            &one.1[r * k..(r + 1) * k],
                            &want[..],
                            "e={e} k={k} m={m} row {r}: host top k"
                        );
                        let tot = order[..k]
                            .iter()
                            .fold(0.0f32, |t, &i| t + row[i])
                            .max(2f32.powi(-14));
                        for (s, &i) in order[..k].iter().enumerate() {
                            assert_eq!(
                                one.2[r * k + s].to_bits(),
                                (row[i] / tot).to_bits(),
                                "e={e} k={k} m={m} row {r} pick {s}: host weight"
                            );
                        }
                    }
                    // A skipped pick weighs nothing.
                    for (i, w) in one.1.iter().zip(&one.2) {
                        assert!(
                            *i >= 0 || *w == 0.0,
                            "e={e} k={k} m={m}: pick -1 weighs {w}"
                        );
                    }
                    assert_eq!(one.3, sep.3, "e={e} k={k} m={m} pad={pad}: placed rows");
                    assert_eq!(one.4, sep.4, "e={e} k={k} m={m} pad={pad}: placed experts");
                    assert_eq!(one.5, sep.5, "e={e} k={k} m={m} pad={pad}: slots");
                    cases += 1;
                    regs += usize::from(mode == 3 && m == 1 && e <= 256);
                }
            }
        }
    }
    assert!(
        cases > 100 && nans > 10,
        "too few cases: {cases} ({nans} with a NaN)"
    );
    assert!(regs > 20, "too few register-path cases: {regs}");
    eprintln!(
        "{cases} routings equal (one launch, route + plan), {nans} with a NaN logit, {regs} on route_plan_one_r's registers"
    );
}

#[test]
fn the_one_launch_plan_equals_the_three_kernel_plan() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(21);
    let mut cases = 0;
    for e in [8usize, 128, 256, 512, 2048] {
        for k in [1usize, 2, 8] {
            for n in [1usize, 2, 7, 8, 64, 100, 255, 256] {
                if n % k != 0 {
                    continue;
                }
                for pad in [1usize, 16] {
                    let ids: Vec<i32> = (0..n)
                        .map(|_| {
                            if rng.below(10) == 0 {
                                -1
                            } else {
                                // Half the routings crowd 4 experts (many pairs each).
                                let span = if rng.below(2) == 0 { e.min(4) } else { e };
                                rng.below(span as u64) as i32
                            }
                        })
                        .collect();
                    // Host reference.
                    let cap = n + e.min(n) * (pad - 1);
                    let want = samesum_cuda::backend::plan_reference(&ids, k, e, pad, cap);
                    let small = cuda.plan_host(&ids, k, e, pad, true).unwrap();
                    let three = cuda.plan_host(&ids, k, e, pad, false).unwrap();
                    assert_eq!(
                        three, want,
                        "three-kernel plan: e={e} k={k} n={n} pad={pad}"
                    );
                    assert_eq!(small, want, "one-launch plan: e={e} k={k} n={n} pad={pad}");
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} plans equal (one launch, three launches, host)");
}

/// Wide calls' plan in two launches (`PLAN_WIDE`: plan_count, then
/// `plan_place_wide`, which also takes plan_scan's offsets) against the
/// host reference and the three-kernel plan, on pair counts of wide calls
/// (300 to 4,097 rows of 1, 2 or 8 pairs: n from 300 to 32,776, so passes
/// of 8,192 pairs whole and cut, and a last run of 32 cut, n odd among
/// them), skipped (-1) ids, crowded experts (a third of the cases put every
/// pair on 4 experts), pads of 1, 16 and 32.
#[test]
fn the_wide_plan_equals_the_three_kernel_plan() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q8_0, 1);
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    let mut rng = Rng::new(31);
    let mut cases = 0;
    for e in [8usize, 128, 256, 512, 2048] {
        for k in [1usize, 2, 8] {
            for rows in [300usize, 1000, 1025, 2048, 4097] {
                let n = rows * k;
                for pad in [1usize, 16, 32] {
                    let crowd = rng.below(3) == 0;
                    let ids: Vec<i32> = (0..n)
                        .map(|_| {
                            if rng.below(10) == 0 {
                                -1
                            } else {
                                let span = if crowd { e.min(4) } else { e };
                                rng.below(span as u64) as i32
                            }
                        })
                        .collect();
                    let cap = n + e.min(n) * (pad - 1);
                    let want = samesum_cuda::backend::plan_reference(&ids, k, e, pad, cap);
                    cuda.set_switch("PLAN_WIDE", true).unwrap();
                    let wide = cuda.plan_host(&ids, k, e, pad, false).unwrap();
                    cuda.set_switch("PLAN_WIDE", false).unwrap();
                    let three = cuda.plan_host(&ids, k, e, pad, false).unwrap();
                    assert_eq!(wide, want, "wide plan: e={e} k={k} n={n} pad={pad}");
                    assert_eq!(
                        three, want,
                        "three-kernel plan: e={e} k={k} n={n} pad={pad}"
                    );
                    cases += 1;
                }
            }
        }
    }
    eprintln!("{cases} wide plans equal (two launches, three launches, host)");
}

fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-300)).sqrt()
}

/// Each block op on the GPU against the CPU backend on the same inputs.
fn ops_close(model: &Model, cuda: &Cuda, cpu: &Cpu, m: usize, tol: f64, what: &str) {
    ops_close_kv(model, cuda, cpu, m, tol, what, KvType::F32)
}

/// The bar for an attention layer and its state with an f16 KV cache on both
/// backends. Each backend rounds its own f32 K and V to halves; where the two
/// f32 values (about 1e-7 apart, relative) straddle a rounding boundary, the
/// halves differ by one half ulp (2^-11 relative). A fraction of about
/// 1e-7 / 2^-11 = 2e-4 of the elements flip, so the expected distance is
/// sqrt(2e-4) * 2^-11 = 7e-6, against 1e-5 for the f32 cache's bar: the
/// first GPU run measured 1.06e-5 at m = 300. The bar is 5e-5, and
/// `f16_kv_cache_on_the_gpu` also asserts that the GPU is several times
/// closer to the CPU on halves than to the CPU on f32 (rounding to halves
/// moves an output by ~2e-4), so a GPU that did not round, or rounded
/// otherwise, still fails.
const F16_KV_TOL: f64 = 5e-5;

/// `ops_close` with a KV cache of `kv` on both backends (with an f16 cache,
/// the attention layers and their states against `F16_KV_TOL`).
fn ops_close_kv(model: &Model, cuda: &Cuda, cpu: &Cpu, m: usize, tol: f64, what: &str, kv: KvType) {
    let mixer_tol = if kv == KvType::F16 {
        tol.max(F16_KV_TOL)
    } else {
        tol
    };
    let d = model.hp.n_embd;
    let mut rng = Rng::new(5 + m as u64);
    let x: Vec<f32> = (0..m * d).map(|_| rng.range(-2.0, 2.0)).collect();
    let xg = cuda.upload(&x).unwrap();
    let nan = |n: usize| cuda.upload(&vec![f32::NAN; n]).unwrap();
    let report_tol = |op: String, got: Vec<f32>, want: Vec<f32>, tol: f64| {
        assert_eq!(got.len(), want.len(), "{what} {op}");
        let r = rel_l2(&got, &want);
        assert!(r <= tol, "{what} {op} m={m}: relative L2 {r:.3e} > {tol:e}");
        eprintln!("{what} {op} m={m}: relative L2 {r:.2e}");
    };
    let report = |op: String, got: Vec<f32>, want: Vec<f32>| report_tol(op, got, want, tol);
    let toks: Vec<u32> = (0..m)
        .map(|_| rng.below(model.w.n_vocab as u64) as u32)
        .collect();
    let mut eg = nan(m * d);
    cuda.embed(model, &toks, &mut eg).unwrap();
    let mut ec = vec![f32::NAN; m * d];
    cpu.embed(model, &toks, &mut ec).unwrap();
    report("embed".into(), cuda.download(&eg).unwrap(), ec);
    for (l, lw) in model.w.layers.iter().enumerate() {
        let mut g = nan(m * d);
        cuda.rms_norm(model, Norm::Attn(l), &xg, &mut g).unwrap();
        let mut c = vec![0f32; m * d];
        cpu.rms_norm(model, Norm::Attn(l), &x, &mut c).unwrap();
        report(format!("layer {l} norm"), cuda.download(&g).unwrap(), c);
        // The mixer twice in a row (the second call reads the state the first wrote).
        let mut sg = cuda.new_state(model, 2 * m, kv).unwrap();
        let mut sc = cpu.new_state(model, 2 * m, kv).unwrap();
        for call in 0..2 {
            let mut g = nan(m * d);
            let mut c = vec![0f32; m * d];
            match &lw.mixer {
                Mixer::Attention(a) => {
                    cuda.attention(model, l, a, &xg, &mut sg, &mut g).unwrap();
                    cpu.attention(model, l, a, &x, &mut sc, &mut c).unwrap();
                }
                Mixer::Linear(dn) => {
                    cuda.delta_net(model, l, dn, &xg, &mut sg, &mut g).unwrap();
                    cpu.delta_net(model, l, dn, &x, &mut sc, &mut c).unwrap();
                }
            }
            cuda.advance(&mut sg, m);
            cpu.advance(&mut sc, m);
            report_tol(
                format!("layer {l} mixer call {call}"),
                cuda.download(&g).unwrap(),
                c,
                mixer_tol,
            );
        }
        report_tol(
            format!("layer {l} state"),
            cuda.download_state(&sg).unwrap(),
            cpu.download_state(&sc).unwrap(),
            mixer_tol,
        );
        let mut g = nan(m * d);
        cuda.moe(model, &lw.moe, &xg, &mut g).unwrap();
        let mut c = vec![0f32; m * d];
        cpu.moe(model, &lw.moe, &x, &mut c).unwrap();
        report(format!("layer {l} moe"), cuda.download(&g).unwrap(), c);
    }
    let rows: Vec<usize> = (0..m).collect();
    report(
        "logits".into(),
        cuda.logits(model, &xg, &rows).unwrap(),
        cpu.logits(model, &x, &rows).unwrap(),
    );
}

#[test]
fn every_block_op_matches_the_cpu_backend() {
    if !gpu() {
        return;
    }
    let cpu = Cpu::new(2);
    for shape in SHAPES {
        // f32 weights: both sides compute in f32 from the same inputs.
        // Quantized and half-precision weights: the first matmul of an op sees the
        // same quantized activations on both sides, later ones inputs that differ
        // in the last bits, which can move an activation's rounding.
        for (quant, tol) in [
            (GgmlType::F32, 1e-5),
            (GgmlType::BF16, 1e-2),
            (GgmlType::F16, 1e-2),
            (GgmlType::Q8_0, 1e-2),
            (GgmlType::Q4_K, 1e-2),
        ] {
            let (_d, model) = synth(shape, quant, 3);
            let cuda = Cuda::new(0, &model, false).unwrap();
            for m in [1, 7, 64] {
                ops_close(&model, &cuda, &cpu, m, tol, &format!("{shape} {quant:?}"));
            }
        }
    }
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

/// The delta rule's cp.async-staged kernels (`delta_cols_async_*`, the
/// default, and with `SAMESUM_CUDA_DELTA_PIPE=1`) against the plain ones
/// (`SAMESUM_CUDA_DELTA_ASYNC=0`): every
/// position's logits byte-equal over 300 tokens in chunks of 64 and of 7
/// (full and partial row groups, one group and several in a call), and
/// byte-equal to their own replay, at key head dims 64 (the tiny shapes),
/// 128 (qwen35moe-35b-a3b) and 256 (eight-row groups).
#[test]
fn staged_delta_rule_equals_the_plain_one() {
    if !gpu() {
        return;
    }
    for shape in delta_head_dim_shapes() {
        let dk = shape.delta.unwrap().key_head_dim;
        let what = format!("{} dk {dk}", shape.name);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 13);
        let mut plain = Cuda::new(0, &model, false).unwrap();
        plain.set_switch("DELTA_ASYNC", false).unwrap();
        let toks = test_tokens(&model, 11);
        let want: Vec<Vec<f32>> = [64, 7]
            .iter()
            .map(|&chunk| all_logits(&plain, &model, &toks, chunk))
            .collect();
        for pipe in [false, true] {
            let mut staged = Cuda::new(0, &model, false).unwrap();
            staged.set_switch("DELTA_ASYNC", true).unwrap();
            staged.set_switch("DELTA_PIPE", pipe).unwrap();
            let replay = all_logits(&staged, &model, &toks, 1);
            assert!(replay.iter().all(|v| v.is_finite()), "{what}: non-finite");
            for (chunk, a) in [64, 7].into_iter().zip(&want) {
                let b = all_logits(&staged, &model, &toks, chunk);
                assert!(
                    same_bits(a, &b),
                    "{what} pipe {pipe} chunk {chunk}: staged != plain"
                );
                assert!(
                    same_bits(&b, &replay),
                    "{what} pipe {pipe} chunk {chunk}: staged batched != its replay"
                );
            }
        }
        eprintln!(
            "{what}: staged delta rule (pipelined or not) == plain == replay, chunks 64 and 7"
        );
    }
}

/// The delta rule's full 16-row groups as straight-line code
/// (`DELTA_UNROLL`, `delta_cols_async_unroll_*`) and with the k dot's
/// partials summed through shared memory (`DELTA_XCHG`,
/// `delta_cols_async_xchg_*`), and with each full group's last row taking
/// the next full group's first k and decay (`DELTA_CARRY`,
/// `delta_cols_async_carry_*`), and with three staging buffers (`DELTA_TRI`,
/// `delta_cols_async_tri_*`), against the pipelined loop: the same logits
/// bytes at key head dims 64 and 128 in chunks of 64 (four full groups a
/// call), 300 (18 full groups and a partial one) and 7 (partial groups
/// only), and replayed (every decode call is one partial group), with the
/// kernel each arm takes checked by name.
#[test]
fn unrolled_delta_rows_equal_the_pipelined_loop() {
    if !gpu() {
        return;
    }
    for shape in delta_head_dim_shapes() {
        let dk = shape.delta.unwrap().key_head_dim as usize;
        if dk != 64 && dk != 128 {
            continue;
        }
        let what = format!("{} dk {dk}", shape.name);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 29);
        let toks = test_tokens(&model, 31);
        let mut looped = Cuda::new(0, &model, false).unwrap();
        looped.set_switch("DELTA_UNROLL", false).unwrap();
        assert_eq!(
            looped.delta_kernel(dk, 64),
            Some(if dk == 64 {
                "delta_cols_async_pipe_64"
            } else {
                "delta_cols_async_pipe_128"
            })
        );
        let want: Vec<Vec<f32>> = [1, 64, 300, 7]
            .iter()
            .map(|&chunk| all_logits(&looped, &model, &toks, chunk))
            .collect();
        assert!(want[0].iter().all(|v| v.is_finite()), "{what}: non-finite");
        for kind in ["unroll", "xchg", "carry", "tri"] {
            let mut arm = Cuda::new(0, &model, false).unwrap();
            arm.set_switch("DELTA_UNROLL", true).unwrap();
            arm.set_switch("DELTA_XCHG", kind == "xchg").unwrap();
            arm.set_switch("DELTA_CARRY", kind == "carry").unwrap();
            arm.set_switch("DELTA_TRI", kind == "tri").unwrap();
            let name = arm.delta_kernel(dk, 64).unwrap();
            assert_eq!(
                arm.delta_kernel(dk, 1),
                looped.delta_kernel(dk, 1),
                "decode-sized calls keep the loop's kernel"
            );
            assert_eq!(name, format!("delta_cols_async_{kind}_{dk}"));
            for (chunk, a) in [1, 64, 300, 7].into_iter().zip(&want) {
                let b = all_logits(&arm, &model, &toks, chunk);
                assert!(same_bits(a, &b), "{what} {name} chunk {chunk}: != the loop");
                assert!(
                    same_bits(&want[0], &b),
                    "{what} {name} chunk {chunk}: != replay"
                );
            }
        }
        eprintln!(
            "{what}: unrolled, exchanged and carried delta rows == the pipelined loop == replay"
        );
    }
}

/// The delta-net shapes at every head dim the kernels specialize: the tiny
/// shapes (64) and tiny-qwen35moe at the real models' 128 and 256.
fn delta_head_dim_shapes() -> Vec<shapes::Shape> {
    let tiny = shapes::by_name("tiny-qwen35moe").unwrap();
    let mut cases = vec![shapes::by_name("tiny-qwen3next").unwrap(), tiny.clone()];
    for dk in [128, 256] {
        cases.push(shapes::Shape {
            delta: Some(shapes::DeltaNet {
                key_head_dim: dk,
                value_head_dim: dk,
                ..tiny.delta.unwrap()
            }),
            ..tiny.clone()
        });
    }
    cases
}

/// Every tiny shape, and the named ones with experts (and shared experts)
/// 768 wide: three 256-blocks a GLU row.
fn wide_glu_shapes(names: &[&str]) -> Vec<shapes::Shape> {
    let mut shapes: Vec<shapes::Shape> =
        SHAPES.iter().map(|s| shapes::by_name(s).unwrap()).collect();
    for s in names {
        let base = shapes::by_name(s).unwrap();
        shapes.push(shapes::Shape {
            expert_ff: 768,
            shared_ff: if base.shared_ff > 0 { 768 } else { 0 },
            ..base
        });
    }
    shapes
}

/// On each shape (`label` names it; weights from `seeds.0`, the prompt from
/// `seeds.1`), switch `switch` on and off give the same logits bytes at
/// every position, the prompt fed in chunks of each of `chunks`; `what`
/// says what the arms are.
fn assert_switch_keeps_logits(
    cases: Vec<shapes::Shape>,
    label: impl Fn(&shapes::Shape) -> String,
    seeds: (u64, u32),
    switch: &str,
    chunks: &[usize],
    what: &str,
) {
    for shape in cases {
        let name = label(&shape);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, seeds.0);
        let (on, off) = switch_arms(&model, switch);
        let toks = test_tokens(&model, seeds.1);
        assert_same_logits(
            &on,
            &off,
            &model,
            &toks,
            chunks,
            &format!("{name}: {what} differ"),
        );
        eprintln!("{name}: {what} equal, chunks {chunks:?}");
    }
}

/// Prefill's causal conv with a thread per channel and 16 rows (`conv_tile`,
/// `CONV_TILE`) against conv_rows: the same logits bytes for chunks that
/// start inside a 16-row group, span several, or end part way through one
/// (the tiny delta-net shapes' conv has 4 taps, the tile kernel's case).
#[test]
fn tiled_conv_equals_the_row_kernel() {
    if !gpu() {
        return;
    }
    let cases = named_shapes(&["tiny-qwen3next", "tiny-qwen35moe"]);
    for sh in &cases {
        let conv = sh.delta.unwrap().conv_kernel;
        assert_eq!(conv, 4, "{}: the tile kernel's conv size", sh.name);
    }
    assert_switch_keeps_logits(
        cases,
        |s| s.name.to_string(),
        (23, 29),
        "CONV_TILE",
        &[17, 64, 300],
        "conv_tile and conv_rows",
    );
}

/// Wide calls of plain matrices under 128 rows on the dp4a kernels
/// (`TC_SMALL`; the delta nets' beta and alpha) against tensor cores: the
/// same logits bytes.
#[test]
fn small_matrices_on_dp4a_keep_the_logits() {
    if !gpu() {
        return;
    }
    let cases = named_shapes(&["tiny-qwen3next", "tiny-qwen35moe"]);
    for sh in &cases {
        let hv = sh.delta.unwrap().value_heads;
        assert!(hv < 128, "{}: beta has {hv} rows", sh.name);
    }
    assert_switch_keeps_logits(
        cases,
        |s| s.name.to_string(),
        (47, 53),
        "TC_SMALL",
        &[17, 64, 300],
        "dp4a and tensor-core small matrices",
    );
}

/// The 8-warp tensor-core kernel (`TC_W8`) against the 4-warp one: the same
/// logits bytes in prefill (chunks of 300 take 32-row tiles on every tiny
/// shape's experts and projections).
#[test]
fn eight_warp_tensor_core_tiles_keep_the_logits() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        named_shapes(SHAPES),
        |s| s.name.to_string(),
        (79, 83),
        "TC_W8",
        &[64, 300],
        "8-warp and 4-warp tensor-core tiles",
    );
}

/// The GLU output's products and Q8_K blocks a warp per 256-block
/// (`silu_mul_q8k_w`, `SILU_WARP`) against a block per row: the same logits
/// bytes in wide calls, at expert widths of one 256-block and of three.
#[test]
fn warp_glu_quantization_equals_the_row_kernel() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]),
        |s| format!("{} expert_ff {}", s.name, s.expert_ff),
        (41, 43),
        "SILU_WARP",
        &[17, 64, 300],
        "silu_mul_q8k_w and silu_mul_q8k",
    );
}

/// The GLU's products quantized from registers without storing them
/// (`silu_mul_q8k_wr`, `SILU_REGS`) against silu_mul_q8k_w, which stores
/// them and quantizes what it stored: the same logits bytes in wide calls,
/// at expert widths of one 256-block and of three.
#[test]
fn register_glu_quantization_equals_the_stored_rows() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]),
        |s| format!("{} expert_ff {}", s.name, s.expert_ff),
        (59, 61),
        "SILU_REGS",
        &[17, 64, 300],
        "silu_mul_q8k_wr and silu_mul_q8k_w",
    );
}

/// Wide routed calls that leave the rows with no expert unwritten
/// (`LIVE_ROWS`: the tensor-core `_live` kernels and `silu_mul_q8k_wl`)
/// against writing every row: the same logits bytes (chunks of 17 already
/// pad each expert's rows to the tensor-core tile), at expert widths of one
/// 256-block and of three.
#[test]
fn live_rows_keep_the_logits() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]),
        |s| format!("{} expert_ff {}", s.name, s.expert_ff),
        (89, 97),
        "LIVE_ROWS",
        &[17, 64, 300],
        "live rows and every row",
    );
}

/// The MoE combine as an op (`moe_combine_host`): four columns a thread
/// (`COMBINE_VEC`) against a thread a column, and each row of an m-row call
/// against that row alone, byte for byte, outputs NaN-poisoned; routed
/// rows with skipped (-1) slots, with and without a shared expert, widths
/// that take the four-column kernel and one that does not (10). Without a
/// shared expert, also against a host reference (f32 fmas in slot order:
/// the kernel's function, so a wrong order or a dropped term fails).
#[test]
fn moe_combine_rows_equal_single_rows_and_both_kernels() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let (vec4, col) = switch_arms(&model, "COMBINE_VEC");
    let mut rng = Rng::new(73);
    let mut cases = 0;
    for d in [4usize, 10, 256, 2048] {
        for k in [1usize, 2, 6, 8, 10] {
            for m in [1usize, 2, 3, 17, 64] {
                for shared in [false, true] {
                    let n_out = m * k + 5;
                    let out: Vec<f32> = (0..n_out * d).map(|_| rng.normal()).collect();
                    let slot: Vec<i32> = (0..m * k)
                        .map(|_| {
                            if rng.below(7) == 0 {
                                -1
                            } else {
                                rng.below(n_out as u64) as i32
                            }
                        })
                        .collect();
                    let wts: Vec<f32> = (0..m * k).map(|_| rng.range(0.0, 1.0)).collect();
                    let ys: Vec<f32> = (0..m * d).map(|_| rng.normal()).collect();
                    let gi: Vec<f32> = (0..m).map(|_| rng.normal()).collect();
                    let sh = shared.then_some((&ys[..], &gi[..]));
                    let what = format!("d {d} k {k} m {m} shared {shared}");
                    let a = vec4
                        .moe_combine_host(&out, &slot, &wts, sh, m, k, d)
                        .unwrap();
                    let b = col
                        .moe_combine_host(&out, &slot, &wts, sh, m, k, d)
                        .unwrap();
                    assert!(
                        a.iter().all(|v| v.is_finite()),
                        "{what}: a poisoned output stayed"
                    );
                    assert!(same_bits(&a, &b), "{what}: moe_combine4 != moe_combine");
                    for r in 0..m {
                        let one = vec4
                            .moe_combine_host(
                                &out,
                                &slot[r * k..(r + 1) * k],
                                &wts[r * k..(r + 1) * k],
                                shared.then_some((&ys[r * d..(r + 1) * d], &gi[r..r + 1])),
                                1,
                                k,
                                d,
                            )
                            .unwrap();
                        assert!(
                            same_bits(&one, &a[r * d..(r + 1) * d]),
                            "{what}: row {r} alone differs"
                        );
                    }
                    if !shared {
                        let want: Vec<f32> = (0..m * d)
                            .map(|i| {
                                let (r, c) = (i / d, i % d);
                                (0..k).fold(0.0f32, |acc, s| match slot[r * k + s] {
                                    -1 => acc,
                                    at => wts[r * k + s].mul_add(out[at as usize * d + c], acc),
                                })
                            })
                            .collect();
                        assert!(same_bits(&a, &want), "{what}: not the slot-order sums");
                    }
                    cases += 1;
                }
            }
        }
    }
    // Sizes or slots that disagree are an error, not a launch.
    let (out, wts) = (vec![1.0f32; 4 * 8], vec![0.5f32; 2]);
    assert!(
        vec4.moe_combine_host(&out, &[0, 1], &wts, None, 1, 2, 8)
            .is_ok()
    );
    assert!(
        vec4.moe_combine_host(&out, &[0, 4], &wts, None, 1, 2, 8)
            .is_err()
    );
    assert!(
        vec4.moe_combine_host(&out, &[0], &wts, None, 1, 2, 8)
            .is_err()
    );
    assert!(
        vec4.moe_combine_host(&out[..7], &[0, 1], &wts, None, 1, 2, 8)
            .is_err()
    );
    assert!(
        vec4.moe_combine_host(&out, &[0, 1], &wts, Some((&out[..7], &wts[..1])), 1, 2, 8)
            .is_err()
    );
    eprintln!("moe_combine4 == moe_combine == single rows on {cases} cases");
}

/// Wide calls' MoE combine four columns a thread (`moe_combine4`,
/// `COMBINE_VEC`) against a thread a column: the same logits bytes with and
/// without a shared expert (tiny-qwen3moe has none), at 2 experts a token
/// (a part-filled group of four slots) and at 6 (a full group, then a
/// part-filled one).
#[test]
fn four_column_combine_equals_the_column_kernel() {
    if !gpu() {
        return;
    }
    let mut cases = named_shapes(SHAPES);
    for name in ["tiny-qwen3moe", "tiny-qwen35moe"] {
        cases.push(shapes::Shape {
            experts_used: 6,
            ..shapes::by_name(name).unwrap()
        });
    }
    assert!(cases.iter().all(|s| s.hidden % 4 == 0));
    assert!(cases.iter().any(|s| s.shared_ff == 0) && cases.iter().any(|s| s.shared_ff > 0));
    assert_switch_keeps_logits(
        cases,
        |s| format!("{} k {}", s.name, s.experts_used),
        (67, 71),
        "COMBINE_VEC",
        &[17, 64, 300],
        "moe_combine4 and moe_combine",
    );
}

/// The f64 head sums of squares with every lane squaring (`SQ_LANES`)
/// against lane 0 squaring them all: the same logits bytes on the delta-net
/// shapes (l2norm_qk and gated_norm_q8k in prefill; decode-sized calls take
/// lane 0's squares in both arms).
#[test]
fn lane_squares_equal_lane_zero_squares() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        delta_head_dim_shapes(),
        |s| format!("{} dk {}", s.name, s.delta.unwrap().key_head_dim),
        (31, 37),
        "SQ_LANES",
        &[1, 64, 300],
        "lane squares and lane-0 squares",
    );
}

/// The f64 head sums of squares a lane a head (`HEAD_SUMS`:
/// `gated_norm_q8k_h` and `l2norm_qk_h`, 32 heads a block, the tail block
/// part full where the call's heads are not a multiple of 32) against a
/// warp a head: the same logits bytes on the delta-net shapes, head dims
/// from the tiny shapes' to 256, in chunks of 64 and 300 (wide calls) and
/// replayed (decode-sized calls take lane 0's squares in both arms).
#[test]
fn head_sums_a_lane_a_head_equal_the_warp_sums() {
    if !gpu() {
        return;
    }
    assert_switch_keeps_logits(
        delta_head_dim_shapes(),
        |s| format!("{} dk {}", s.name, s.delta.unwrap().key_head_dim),
        (41, 43),
        "HEAD_SUMS",
        &[1, 64, 300],
        "a lane a head and a warp a head",
    );
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

#[test]
fn batched_forward_equals_replay_on_the_gpu() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 11);
        let cuda = Cuda::new(0, &model, false).unwrap();
        let mut rng = Rng::new(8);
        let toks: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        for chunk in [7, 64, 128] {
            if let Err(dv) = forward_rows_match(&cuda, &model, &toks, chunk) {
                panic!("{shape} chunk {chunk}: {dv:?}");
            }
        }
        eprintln!("{shape}: 300 tokens, chunks 7/64/128 byte-equal to replay");
    }
}

/// Batched prefill two chunks at a time on two lanes (`WAVE`, the second
/// chunk's layer l beside the first chunk's later layers) against the same
/// chunks one after the other on one lane and against replay: every logit
/// and the state byte-equal, on every tiny shape, chunk sizes that pair
/// evenly (64 over 256 tokens), oddly (100 and 7 over 300: a last chunk
/// alone) and with a short second chunk; and lane 1 ran kernels.
#[test]
fn chunk_pairs_on_two_lanes_equal_one_lane_and_replay() {
    if !gpu() {
        return;
    }
    use samesum_engine::forward_chunks;
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 37);
        let (wave, one) = switch_arms(&model, "WAVE");
        assert_eq!(wave.lanes(), 2, "{shape}: WAVE on gives two lanes");
        assert_eq!(one.lanes(), 1, "{shape}: WAVE off gives one lane");
        let mut rng = Rng::new(41);
        let toks: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        let replay = all_logits(&one, &model, &toks, 1);
        for (n, chunk) in [(256usize, 64usize), (300, 100), (300, 7), (130, 128)] {
            let toks = &toks[..n];
            let before = wave.device().lane_launch_count(1);
            let pieces: Vec<&[u32]> = toks.chunks(chunk).collect();
            let mut st = wave.new_state(&model, n, KvType::F32).unwrap();
            let paired = forward_chunks(&model, &wave, &mut st, &pieces, |_| Logits::All).unwrap();
            assert!(
                wave.device().lane_launch_count(1) > before,
                "{shape} chunk {chunk}: nothing ran on lane 1"
            );
            let mut st1 = one.new_state(&model, n, KvType::F32).unwrap();
            let mut serial = Vec::new();
            for c in &pieces {
                serial.extend(forward(&model, &one, &mut st1, c, Logits::All).unwrap());
            }
            assert_eq!(paired.len(), serial.len());
            if let Some(i) = paired
                .iter()
                .zip(&serial)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{shape} chunk {chunk}: two lanes differ from one at position {}",
                    i / model.w.n_vocab
                );
            }
            assert!(
                same_bits(&paired, &replay[..paired.len()]),
                "{shape} chunk {chunk}: two lanes differ from replay"
            );
            let (s2, s1) = (
                wave.download_state(&st).unwrap(),
                one.download_state(&st1).unwrap(),
            );
            assert!(
                s2.len() == s1.len() && same_bits(&s2, &s1),
                "{shape} chunk {chunk}: the state after two lanes differs"
            );
        }
        eprintln!(
            "{shape}: chunk pairs on two lanes == one lane == replay (chunks 64, 100, 7, 128)"
        );
    }
}

#[test]
fn hugging_face_fixtures_on_the_gpu() {
    if !gpu() {
        return;
    }
    let dir = repo().join("tests/conformance/fixtures");
    for name in ["qwen3moe", "qwen3moe-tied", "qwen3next", "qwen35moe"] {
        let model = Model::load(dir.join(format!("{name}.gguf"))).unwrap();
        let ps = samesum_engine::conformance::fixture_prompts(
            &std::fs::read_to_string(dir.join(format!("{name}.json"))).unwrap(),
        );
        let raw = std::fs::read(dir.join(format!("{name}.logits"))).unwrap();
        let reference: Vec<f32> = raw
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let cuda = Cuda::new(0, &model, false).unwrap();
        let v = model.w.n_vocab;
        let (mut off, mut worst) = (0, 0f32);
        for p in &ps {
            let mut st = cuda.new_state(&model, 256, KvType::F32).unwrap();
            let got = forward(&model, &cuda, &mut st, p, Logits::All).unwrap();
            let want = &reference[off..off + p.len() * v];
            off += p.len() * v;
            let max_ref = want.iter().fold(0f32, |m, x| m.max(x.abs()));
            let mut max_diff = 0f32;
            for (a, b) in got.iter().zip(want) {
                assert!(a.is_finite(), "{name}: non-finite logit");
                max_diff = max_diff.max((a - b).abs());
            }
            worst = worst.max(max_diff / max_ref);
        }
        assert_eq!(off, reference.len());
        eprintln!("{name}: max|diff|/max|ref| = {worst:.2e} (bar 1e-4)");
        assert!(worst <= 1e-4, "{name}: {worst:.3e} > 1e-4");
    }
}

/// Every position's logits of `tokens` fed in chunks of `chunk`.
fn all_logits<B: Backend>(b: &B, model: &Model, tokens: &[u32], chunk: usize) -> Vec<f32> {
    all_logits_kv(b, model, tokens, chunk, KvType::F32)
}

/// `all_logits` with a KV cache of `kv`.
fn all_logits_kv<B: Backend>(
    b: &B,
    model: &Model,
    tokens: &[u32],
    chunk: usize,
    kv: KvType,
) -> Vec<f32> {
    let mut st = b.new_state(model, tokens.len(), kv).unwrap();
    let mut out = Vec::new();
    for c in tokens.chunks(chunk) {
        out.extend(forward(model, b, &mut st, c, Logits::All).unwrap());
    }
    out
}

/// Tier mode (routed experts in host memory, a decode cache of two slots
/// more than a token needs, so replay evicts; prefill from staged layers)
/// against resident mode on the same file: the same logits bytes at every
/// position, replayed and batched; and a budget that cannot hold the trunk is
/// refused with the sizes named.
#[test]
fn tier_mode_equals_resident_mode() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 12);
        let sizes = TierSizes::of(&model);
        let per_slot = sizes.expert * sizes.layers as u64;
        let slots = (sizes.used + 2).min(sizes.experts);
        let budget = sizes.trunk + RESERVE + 2 * sizes.layer_experts() + per_slot * slots as u64;
        let opts = CudaOptions {
            vram_budget: Some(budget),
            ..Default::default()
        };
        let tier = Cuda::with_options(0, &model, false, opts).unwrap();
        let (plan, _, _) = tier.tier_stats().unwrap();
        assert_eq!(plan.slots, slots, "{shape}");
        let resident = Cuda::new(0, &model, false).unwrap();
        assert!(resident.tier_stats().is_none());
        let mut rng = Rng::new(21);
        let toks: Vec<u32> = (0..200)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        for chunk in [1, 64] {
            let want = all_logits(&resident, &model, &toks, chunk);
            let got = all_logits(&tier, &model, &toks, chunk);
            assert_eq!(want.len(), got.len());
            if let Some(i) = want
                .iter()
                .zip(&got)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{shape} chunk {chunk}: tier mode differs from resident mode at position {}",
                    i / model.w.n_vocab
                );
            }
        }
        let (_, st, _) = tier.tier_stats().unwrap();
        assert!(st.hits > 0 && st.misses > 0, "{shape}: {st:?}");
        assert!(st.staged_layers > 0, "{shape}: {st:?}");
        if let Err(dv) = forward_rows_match(&tier, &model, &toks, 64) {
            panic!("{shape} tier mode: batched differs from replay: {dv:?}");
        }
        eprintln!(
            "{shape}: tier mode ({slots} slots) == resident, chunks 1 and 64; {} hits, {} misses, {} layers staged",
            st.hits, st.misses, st.staged_layers
        );
        let small = CudaOptions {
            vram_budget: Some(sizes.trunk / 2),
            ..Default::default()
        };
        match Cuda::with_options(0, &model, false, small) {
            Err(e @ CudaError::Budget { .. }) => {
                assert!(e.to_string().contains("trunk needs"), "{e}")
            }
            Err(e) => panic!("{shape}: a tiny budget gave another error: {e}"),
            Ok(_) => panic!("{shape}: a budget of half the trunk was accepted"),
        }
    }
}

/// Decode steps recorded as CUDA graphs and replayed against the same steps
/// launched one by one: the same logits bytes at every position, over more
/// than one attention key tile (the recorded step covers the whole context).
/// Every decode-size fusion (one-row and fused-GLU matmuls, routing with the
/// plan, the conv with its state shift, the quantized gather, programmatic
/// dependent launch) against the separate kernels, through whole forward
/// passes: 200 replayed steps and a prefill in chunks of 7 rows, byte for
/// byte.
/// Prefill with the shared expert on the second stream (beside the routed
/// experts) against the same prefill with it after them on the main stream:
/// every logit byte-equal, on the shapes with a shared expert, chunks that
/// take the overlap (64, 100) and one that does not (7).
#[test]
fn shared_expert_beside_the_routed_experts_equals_serial() {
    if !gpu() {
        return;
    }
    let mut checked = 0;
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 29);
        if model.w.layers.iter().all(|l| l.moe.shared.is_none()) {
            continue;
        }
        let mut side = Cuda::new(0, &model, false).unwrap();
        side.set_overlap(true);
        let mut serial = Cuda::new(0, &model, false).unwrap();
        serial.set_overlap(false);
        let mut rng = Rng::new(31);
        let toks: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        for chunk in [64usize, 100, 7] {
            let (p, q) = (
                all_logits(&side, &model, &toks, chunk),
                all_logits(&serial, &model, &toks, chunk),
            );
            assert_eq!(p.len(), q.len());
            assert!(
                p.iter().all(|v| v.is_finite()),
                "{shape}: non-finite logits"
            );
            if let Some(i) = p
                .iter()
                .zip(&q)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{shape} chunk {chunk}: the overlapped shared expert differs at position {}",
                    i / model.w.n_vocab
                );
            }
            checked += 1;
        }
        eprintln!("{shape}: shared expert on the second stream == serial (chunks 64, 100, 7)");
    }
    assert!(
        checked >= 6,
        "too few shapes with a shared expert: {checked} runs"
    );
}

/// [`switch_arms`] with decode steps recorded as graphs or not.
fn graph_switch_arms(model: &Model, name: &str, graphs: bool) -> (Cuda, Cuda) {
    let (mut on, mut off) = switch_arms(model, name);
    on.set_graphs(graphs);
    off.set_graphs(graphs);
    (on, off)
}

/// Switch `name` on against off: the same logits bytes at every position
/// of the first `n` tokens of `test_tokens(.., salt)` fed in chunks of
/// each of `chunks` (1: replay), graphs on and off, on every tiny shape
/// (weights from `seed`); `check` then asserts more of the two arms.
fn decode_switch_changes_no_byte(
    name: &str,
    (seed, salt, n): (u64, u32, usize),
    chunks: &[usize],
    check: impl Fn(&str, &Cuda, &Cuda),
) {
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, seed);
        let toks: Vec<u32> = test_tokens(&model, salt).into_iter().take(n).collect();
        for graphs in [false, true] {
            let (on, off) = graph_switch_arms(&model, name, graphs);
            assert_same_logits(
                &on,
                &off,
                &model,
                &toks,
                chunks,
                &format!("{shape}: {name} differs (graphs {graphs})"),
            );
            check(shape, &on, &off);
        }
        eprintln!("{shape}: decode with {name} == without (graphs on and off)");
    }
}

/// One-row Q4_K matmuls on 16 rows a block (`LANE16`) against 32 (every
/// tiny shape's matrices are small enough to take it).
#[test]
fn lane_kernel_on_16_rows_a_block_changes_no_byte() {
    if !gpu() {
        return;
    }
    decode_switch_changes_no_byte("LANE16", (47, 11, 60), &[1, 7], |_, _, _| {});
}

/// Decode's router launch with a warp a block (`ROUTER_1W`) against four:
/// the same logits, so the same ids and plan.
#[test]
fn router_launch_a_warp_a_block_changes_no_byte() {
    if !gpu() {
        return;
    }
    decode_switch_changes_no_byte("ROUTER_1W", (47, 13, 60), &[1, 7], |_, _, _| {});
}

/// Decode's delta-net output projection taking the gated norm itself
/// (`GN_FOLD`, `mm_q4_k_lane_gn_1`) against gated_norm_q8k and the lane
/// matmul: the same logits bytes at every replayed position and with
/// chunks of 7 and 64 (whose calls do not take the fold, so the fold's
/// one-row bytes meet the wide path's in one sequence), graphs on and off,
/// on the shapes with delta-net layers (Q4_K and Q8_0: the fold is Q4_K
/// only); and the fold's arm launched fewer kernels, one a delta layer a
/// token.
#[test]
fn gated_norm_in_the_output_projection_changes_no_byte() {
    if !gpu() {
        return;
    }
    let mut folded = 0;
    for shape in SHAPES {
        for quant in [GgmlType::Q4_K, GgmlType::Q8_0] {
            let (_d, model) = synth(shape, quant, 43);
            let delta_layers = model
                .w
                .layers
                .iter()
                .filter(|l| matches!(l.mixer, Mixer::Linear(_)))
                .count();
            if delta_layers == 0 {
                continue;
            }
            let toks: Vec<u32> = test_tokens(&model, 9).into_iter().take(80).collect();
            for graphs in [false, true] {
                let (on, off) = graph_switch_arms(&model, "GN_FOLD", graphs);
                assert_same_logits(
                    &on,
                    &off,
                    &model,
                    &toks,
                    &[1, 7, 64],
                    &format!("{shape} {quant:?}: the folded gated norm differs (graphs {graphs})"),
                );
                if !graphs {
                    let (a, b) = (on.device().launch_count(), off.device().launch_count());
                    if quant == GgmlType::Q4_K {
                        // 80 replayed tokens: one launch fewer a delta layer each.
                        assert_eq!(
                            b - a,
                            (80 * delta_layers) as u64,
                            "{shape}: {a} launches with the fold, {b} without"
                        );
                        folded += 1;
                    } else {
                        assert_eq!(a, b, "{shape} {quant:?}: the fold ran on a Q8_0 projection");
                    }
                }
            }
            eprintln!("{shape} {quant:?}: the folded gated norm == gated_norm_q8k + the matmul");
        }
    }
    assert!(folded >= 2, "the fold ran on {folded} shapes");
}

/// Decode's L2 prefetch (`PREFETCH`: weights pulled into L2 from the
/// second stream ahead of the kernels that read them) against none: the
/// same logits bytes at every replayed position, with the step recorded as
/// a graph (the prefetches fork from and join the recorded stream) and
/// eager, on every tiny shape; and the prefetch arm did launch more kernels.
#[test]
fn decode_prefetch_changes_no_byte() {
    if !gpu() {
        return;
    }
    decode_switch_changes_no_byte("PREFETCH", (37, 5, 40), &[1], |shape, on, off| {
        let (a, b) = (on.device().launch_count(), off.device().launch_count());
        assert!(
            a > b,
            "{shape}: the prefetch arm launched {a} kernels, the other {b}"
        );
    });
}

#[test]
fn decode_fusions_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    for (shape, quant) in SHAPES
        .iter()
        .flat_map(|s| [(*s, GgmlType::Q4_K), (*s, GgmlType::Q8_0)])
    {
        let (_d, model) = synth(shape, quant, 19);
        let mut fused = Cuda::new(0, &model, false).unwrap();
        fused.set_graphs(false);
        fused.set_block_route(true);
        let mut apart = Cuda::new(0, &model, false).unwrap();
        apart.set_graphs(false);
        apart.set_row_kernels(false);
        apart.set_fused_glu(false);
        apart.set_small_plan(false);
        apart.set_quantized_gather(false);
        apart.set_grouped_projections(false);
        apart.set_norm_quant(false);
        apart.set_block_route(false);
        apart.set_overlap(false);
        apart.set_moe_joint(false);
        apart.device().set_pdl(false);
        let mut rng = Rng::new(23);
        let toks: Vec<u32> = (0..200)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        for chunk in [1usize, 7] {
            let (p, q) = (
                all_logits(&fused, &model, &toks, chunk),
                all_logits(&apart, &model, &toks, chunk),
            );
            assert_eq!(p.len(), q.len());
            if let Some(i) = p
                .iter()
                .zip(&q)
                .position(|(a, b)| a.to_bits() != b.to_bits())
            {
                panic!(
                    "{shape} {quant:?} chunk {chunk}: fused kernels differ from separate ones at position {}",
                    i / model.w.n_vocab
                );
            }
        }
        eprintln!("{shape} {quant:?}: decode fusions == separate kernels (replay and chunks of 7)");
    }
}

/// The warp-per-row norm (`rms_norm_small`, rows up to 256 wide: the q and
/// k head norms) against rms_norm's block per row, byte for byte, on random
/// rows of many widths and scales (a wrong tree order shows in some rows'
/// last bits of the mean); then whole forward passes with it on and off.
#[test]
fn small_norms_equal_the_block_norm() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let (small, block) = switch_arms(&model, "SMALL_NORM");
    let mut rng = Rng::new(41);
    let mut differing_rows = 0;
    for width in [1usize, 17, 32, 64, 96, 100, 128, 200, 255, 256] {
        for scale in [1e-3f32, 1.0, 3e4] {
            let rows = 613;
            let x: Vec<f32> = (0..rows * width).map(|_| rng.normal() * scale).collect();
            let w: Vec<f32> = (0..width).map(|_| 1.0 + 0.1 * rng.normal()).collect();
            let a = small.rms_norm_host(&x, &w, 1e-6).unwrap();
            let b = block.rms_norm_host(&x, &w, 1e-6).unwrap();
            assert!(a.iter().all(|v| v.is_finite()), "width {width}: non-finite");
            if let Some(i) = a
                .iter()
                .zip(&b)
                .position(|(p, q)| p.to_bits() != q.to_bits())
            {
                panic!("width {width} scale {scale}: row {} differs", i / width);
            }
            // The norm is not the identity: the rows did change.
            differing_rows += x
                .chunks(width)
                .zip(a.chunks(width))
                .filter(|(p, q)| p != q)
                .count();
        }
    }
    assert!(differing_rows > 0);
    let toks = test_tokens(&model, 3);
    assert_same_logits(
        &small,
        &block,
        &model,
        &toks,
        &[64, 7],
        "forward differs with the small norm",
    );
    eprintln!(
        "rms_norm_small == rms_norm on 10 widths x 3 scales x 613 rows, and in forward passes"
    );
}

/// Prefill GLUs that write their Q8_K blocks (`silu_mul_q8k`) against
/// silu_mul and a quantize launch: the same logits bytes at every position,
/// chunks of 64 and 7, on every tiny shape (routed and shared experts), and
/// batched still equal to replay.
#[test]
fn glu_quantization_in_the_glu_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 29);
        let (fused, apart) = switch_arms(&model, "SILU_Q8K");
        let toks = test_tokens(&model, 9);
        let what = format!("{shape}: silu_mul_q8k != silu_mul + quantize");
        let batched = assert_same_logits(&fused, &apart, &model, &toks, &[64, 7], &what);
        let replay = all_logits(&fused, &model, &toks, 1);
        for (chunk, b) in [64, 7].into_iter().zip(&batched) {
            assert!(
                same_bits(b, &replay),
                "{shape} chunk {chunk}: batched != replay"
            );
        }
        eprintln!("{shape}: silu_mul_q8k == silu_mul + quantize_q8k == replay (chunks 64 and 7)");
    }
}

/// The delta net's gated norm and the gated attention's output gate writing
/// the out projection's Q8_K blocks (`gated_norm_q8k`, `sigmoid_mul_q8k`)
/// against gated_norm or sigmoid_mul and a quantize launch: the same logits
/// bytes at every position, replayed and in chunks of 64 and 7, on the tiny
/// shapes with a delta net (their value heads of 64 and of 128; their
/// attention layers are gated).
#[test]
fn gated_norm_quantization_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    let tiny = shapes::by_name("tiny-qwen35moe").unwrap();
    let wide = shapes::Shape {
        delta: Some(shapes::DeltaNet {
            key_head_dim: 128,
            value_head_dim: 128,
            ..tiny.delta.unwrap()
        }),
        ..tiny.clone()
    };
    for shape in [shapes::by_name("tiny-qwen3next").unwrap(), tiny, wide] {
        let what = format!("{} dv {}", shape.name, shape.delta.unwrap().value_head_dim);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 31);
        // The out projections read Q8_K rows, so the fused path is the one taken.
        let outs: Vec<GgmlType> = model
            .w
            .layers
            .iter()
            .filter_map(|l| match &l.mixer {
                Mixer::Linear(dn) => Some(dn.out.ty),
                _ => None,
            })
            .collect();
        assert!(
            !outs.is_empty()
                && outs
                    .iter()
                    .all(|t| matches!(t, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)),
            "{what}: out projections {outs:?}"
        );
        let mut fused = Cuda::new(0, &model, false).unwrap();
        fused.set_switch("GN_Q8K", true).unwrap();
        let mut apart = Cuda::new(0, &model, false).unwrap();
        apart.set_switch("GN_Q8K", false).unwrap();
        let toks = test_tokens(&model, 17);
        for chunk in [1, 64, 7] {
            let (p, q) = (
                all_logits(&fused, &model, &toks, chunk),
                all_logits(&apart, &model, &toks, chunk),
            );
            assert!(p.iter().all(|v| v.is_finite()), "{what}: non-finite");
            assert!(
                same_bits(&p, &q),
                "{what} chunk {chunk}: gated_norm_q8k != gated_norm + quantize"
            );
        }
        eprintln!("{what}: gated_norm_q8k == gated_norm + quantize_q8k (replay, chunks 64 and 7)");
    }
}

#[test]
fn graph_replayed_steps_equal_eager_steps() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 13);
        let graphs = Cuda::new(0, &model, false).unwrap();
        // The reference launches every kernel alone, in stream order: no
        // graphs and no programmatic dependent launch.
        let mut eager = Cuda::new(0, &model, false).unwrap();
        eager.set_graphs(false);
        eager.device().set_pdl(false);
        let mut rng = Rng::new(22);
        let toks: Vec<u32> = (0..300)
            .map(|_| rng.below(model.w.n_vocab as u64) as u32)
            .collect();
        let run = |b: &Cuda| {
            let mut st = b.new_state(&model, 400, KvType::F32).unwrap();
            let mut out = Vec::new();
            for &t in &toks {
                out.extend(forward(&model, b, &mut st, &[t], Logits::All).unwrap());
            }
            out
        };
        let (g, e) = (run(&graphs), run(&eager));
        assert_eq!(g.len(), e.len());
        if let Some(i) = g
            .iter()
            .zip(&e)
            .position(|(a, b)| a.to_bits() != b.to_bits())
        {
            panic!(
                "{shape}: the graph-replayed step differs from the eager one at position {}",
                i / model.w.n_vocab
            );
        }
        eprintln!("{shape}: 300 graph-replayed steps == eager steps without PDL");
        // Batched prefill (chunks of 64 rows: the wide kernels) with and
        // without programmatic dependent launch (which prefill-sized calls
        // use only when asked).
        graphs.device().set_pdl_prefill(true);
        let batched = |b: &Cuda| {
            let mut st = b.new_state(&model, 400, KvType::F32).unwrap();
            let mut out = Vec::new();
            for c in toks.chunks(64) {
                out.extend(forward(&model, b, &mut st, c, Logits::All).unwrap());
            }
            out
        };
        let (p, q) = (batched(&graphs), batched(&eager));
        assert!(
            same_bits(&p, &q),
            "{shape}: batched prefill with PDL differs from without"
        );
        eprintln!("{shape}: batched prefill with PDL == without");
    }
}

/// Prefill-sized forward calls launch without programmatic dependent launch
/// (it slowed them: docs/gpu-notes.md, session 17), one-row calls with it,
/// and `set_pdl_prefill` keeps it for every call.
#[test]
fn programmatic_dependent_launch_is_for_small_calls() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let cuda = Cuda::new(0, &model, false).unwrap();
    if !cuda.device().pdl_allowed() {
        eprintln!("no programmatic dependent launch on this device: nothing to check");
        return;
    }
    let toks = test_tokens(&model, 3);
    let mut st = cuda.new_state(&model, 400, KvType::F32).unwrap();
    let big = samesum_cuda::PDL_MAX_ROWS + 1;
    forward(&model, &cuda, &mut st, &toks[..big], Logits::Last).unwrap();
    assert!(!cuda.device().uses_pdl(), "a {big}-row call used PDL");
    forward(&model, &cuda, &mut st, &toks[big..big + 1], Logits::Last).unwrap();
    assert!(cuda.device().uses_pdl(), "a one-row call did not use PDL");
    let n = samesum_cuda::PDL_MAX_ROWS;
    forward(
        &model,
        &cuda,
        &mut st,
        &toks[big + 1..big + 1 + n],
        Logits::Last,
    )
    .unwrap();
    assert!(cuda.device().uses_pdl(), "a {n}-row call did not use PDL");
    cuda.device().set_pdl_prefill(true);
    forward(&model, &cuda, &mut st, &toks[..big], Logits::Last).unwrap();
    assert!(cuda.device().uses_pdl(), "set_pdl_prefill did not keep PDL");
}

/// Every kernel switch is settable and readable by name (what `samesum
/// agree --variant NAME=0|1` uses), and an unknown name is an error naming
/// the known ones.
#[test]
fn switches_are_set_and_read_by_name() {
    if !gpu() {
        return;
    }
    let (_d, model) = synth("tiny-qwen3moe", GgmlType::Q4_K, 5);
    let mut cuda = Cuda::new(0, &model, false).unwrap();
    for name in Cuda::switch_names() {
        for on in [false, true] {
            cuda.set_switch(name, on).unwrap();
            assert_eq!(cuda.switch(name).unwrap(), on, "{name} = {on}");
        }
    }
    let e = cuda.set_switch("SIDEWAYS", true).unwrap_err().to_string();
    assert!(e.contains("SIDEWAYS") && e.contains("ATT_Q4"), "{e}");
    assert!(cuda.switch("sideways").is_err());
}

/// Kernels launched by `cuda` (graphs off) for every position's logits of
/// `toks` in chunks of `chunk`.
fn launches_for(cuda: &mut Cuda, model: &Model, toks: &[u32], chunk: usize) -> u64 {
    cuda.set_graphs(false);
    let before = cuda.device().launch_count();
    all_logits(cuda, model, toks, chunk);
    cuda.device().launch_count() - before
}

/// Switch `name` on against off on `model`: the same logits bytes at every
/// position with a KV cache of `kv`, replayed and in chunks of 64 and 7, and
/// batched equal to replay; returns the launches a replay of `toks[..n]`
/// takes on and off (graphs off).
fn fusion_arms(model: &Model, name: &str, salt: u32, kv: KvType, what: &str) -> (u64, u64) {
    fusion_arms_with(model, name, &[], salt, kv, what)
}

/// `fusion_arms` with the switches of `base` set the same way in both arms
/// first (a fusion whose launch another default fusion already removes is
/// counted against the arms without that one).
fn fusion_arms_with(
    model: &Model,
    name: &str,
    base: &[(&str, bool)],
    salt: u32,
    kv: KvType,
    what: &str,
) -> (u64, u64) {
    let (mut on, mut off) = switch_arms(model, name);
    for &(b, v) in base {
        on.set_switch(b, v).unwrap();
        off.set_switch(b, v).unwrap();
    }
    let toks = test_tokens(model, salt);
    let mut first: Option<Vec<f32>> = None;
    for chunk in [1, 64, 7] {
        let p = all_logits_kv(&on, model, &toks, chunk, kv);
        let q = all_logits_kv(&off, model, &toks, chunk, kv);
        assert!(p.iter().all(|v| v.is_finite()), "{what}: non-finite");
        assert!(same_bits(&p, &q), "{what} chunk {chunk}: {name} on != off");
        match &first {
            None => first = Some(p),
            Some(r) => assert!(same_bits(r, &p), "{what} chunk {chunk}: batched != replay"),
        }
    }
    let short = &toks[..8];
    (
        launches_for(&mut on, model, short, 1),
        launches_for(&mut off, model, short, 1),
    )
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

/// A decode MoE layer's router launch routing and planning its own row
/// (`mm_f32_multi_route`) against mm_f32_multi (or the router's matmul)
/// then route_plan_one: the same logits bytes at every position, replayed
/// (graph replays reuse the launch's counter) and in chunks, on every tiny
/// shape (routers with and without a shared expert's gate beside them), and
/// one launch fewer a MoE layer and token.
#[test]
fn routing_in_the_router_launch_equals_route_plan_one() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 41);
        let (on, off) = fusion_arms(&model, "ROUTE_FOLD", 11, KvType::F32, shape);
        assert!(on < off, "{shape}: {on} launches folded, {off} apart");
        eprintln!(
            "{shape}: mm_f32_multi_route == router + route_plan_one; launches {on} against {off}"
        );
    }
}

/// Tiny shape `name` with a real model's router: rows of `hidden`, `experts`
/// experts and 8 a token, two layers (to keep the weights small).
fn router_shape(name: &str, hidden: u32, experts: u32) -> shapes::Shape {
    shapes::Shape {
        hidden,
        layers: 2,
        experts,
        experts_used: 8,
        ..shapes::by_name(name).unwrap()
    }
}

/// The router launch that routes a decode row, on its variants: the row
/// routed in registers (`ROUTE_REGS`: `mm_f32_multi_route_r`), 32 loads a
/// lane a step (`ROUTER_DEEP`: `_d`), and both (`_rd`), against the default
/// (`mm_f32_multi_route`): the same logits bytes at every position,
/// replayed and in chunks of 64 and 7, on the tiny shapes and on wider ones
/// whose rows take every path: hidden 2,304 (a lane's 72 elements in steps
/// of 32, 32 and 8), 256 experts with 8 a token (qwen35moe's router, the
/// registers' largest row) and 128 (qwen3moe's), and 320 (past the
/// registers: route_one_warp's code).
#[test]
fn router_launch_variants_keep_the_logits() {
    if !gpu() {
        return;
    }
    let mut shapes: Vec<shapes::Shape> =
        SHAPES.iter().map(|s| shapes::by_name(s).unwrap()).collect();
    for (name, experts) in [
        ("tiny-qwen35moe", 256),
        ("tiny-qwen3moe", 128),
        ("tiny-qwen3moe", 320),
    ] {
        shapes.push(router_shape(name, 2304, experts));
    }
    let arms = [
        (false, false, "mm_f32_multi_route"),
        (true, false, "mm_f32_multi_route_r"),
        (false, true, "mm_f32_multi_route_d"),
        (true, true, "mm_f32_multi_route_rd"),
    ];
    for shape in shapes {
        let what = format!(
            "{} hidden {} experts {}",
            shape.name, shape.hidden, shape.experts
        );
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 53);
        let toks = test_tokens(&model, 23);
        let mut first: Option<Vec<f32>> = None;
        for (regs, deep, name) in arms {
            let mut cuda = Cuda::new(0, &model, false).unwrap();
            cuda.set_switch("ROUTE_REGS", regs).unwrap();
            cuda.set_switch("ROUTER_DEEP", deep).unwrap();
            assert_eq!(cuda.route_kernels().0, name);
            for chunk in [1, 64, 7] {
                let p = all_logits(&cuda, &model, &toks, chunk);
                assert!(p.iter().all(|v| v.is_finite()), "{what} {name}: non-finite");
                match &first {
                    None => first = Some(p),
                    Some(r) => assert!(
                        same_bits(r, &p),
                        "{what} chunk {chunk}: {name} != the default replayed"
                    ),
                }
            }
        }
        eprintln!("{what}: the four router launches equal, replayed and in chunks");
    }
}

/// The output head of a one-row call on the wide kernel (`HEAD_R4`:
/// `mm_q6_k_r4` / `mm_q8_0_r4`, four weight rows a warp) and on mm_row four
/// rows a warp (`HEAD_X4`: `mm_q6_k_1x4` / `mm_q8_0_1x4`), each against the
/// one-row kernel (`mm_q6_k_1` / `mm_q8_0_1`): the same logits bytes at
/// every position, replayed (the head's one-row calls) and in chunks of 64
/// and 7, on vocabularies past `HEAD_R4_ROWS` (40,000 rows are 2,500 blocks
/// of 16 exactly; with 40,001 the last block has one live row): a Q4_K
/// model's Q6_K head and a Q8_0 model's Q8_0 head, rows of one block and
/// of eight.
#[test]
fn output_head_on_the_wide_kernel_keeps_the_logits() {
    if !gpu() {
        return;
    }
    // Hidden 2,048 as the real models' (eight Q6_K blocks a row: the
    // double-buffered loads run) and 256 (one block).
    for (name, quant, vocab, hidden) in [
        ("tiny-qwen3moe", GgmlType::Q4_K, 40_000u32, 256u32),
        ("tiny-qwen3moe", GgmlType::Q8_0, 40_001, 256),
        ("tiny-qwen35moe", GgmlType::Q4_K, 40_001, 256),
        ("tiny-qwen35moe", GgmlType::Q4_K, 40_001, 2048),
    ] {
        assert!(vocab as usize >= samesum_cuda::backend::HEAD_R4_ROWS);
        let shape = shapes::Shape {
            vocab: Some(vocab),
            hidden,
            ..shapes::by_name(name).unwrap()
        };
        let (_d, model) = synth_shape(shape, quant, 59);
        let toks = test_tokens(&model, 29);
        let what = format!("{name} {quant:?} vocab {vocab} hidden {hidden}");
        for switch in ["HEAD_R4", "HEAD_X4"] {
            let (on, off) = switch_arms(&model, switch);
            let p = assert_same_logits(
                &on,
                &off,
                &model,
                &toks,
                &[1, 64, 7],
                &format!("{what}: {switch} on and off differ"),
            );
            assert!(
                same_bits(&p[0], &p[1]),
                "{what} {switch}: batched != replay"
            );
        }
        eprintln!(
            "{what}: the head on mm_*_r4, on mm_*_1x4 and on mm_*_1 equal, replayed and in chunks"
        );
    }
}

/// One-row Q6_K calls eight lanes a block (`Q6_LANES8`: `mm_q6_k8_1`, both
/// nibbles of a ql byte in one lane, unsigned values and the Q8_K block
/// sums) against sixteen (`mm_q6_k_1`): the same logits bytes at every
/// position, replayed (the one-row calls) and in chunks of 64 and 7, on a
/// Q4_K model's Q6_K head (hidden 256: one block a row, and 2,048: eight,
/// two passes of four blocks) and on a Q6_K model, whose every dense
/// matrix is Q6_K.
#[test]
fn q6_k_rows_eight_lanes_a_block_keep_the_logits() {
    if !gpu() {
        return;
    }
    for (name, quant, hidden) in [
        ("tiny-qwen35moe", GgmlType::Q4_K, 256u32),
        ("tiny-qwen35moe", GgmlType::Q4_K, 2048),
        ("tiny-qwen3moe", GgmlType::Q6_K, 256),
        ("tiny-qwen3next", GgmlType::Q6_K, 256),
    ] {
        let shape = shapes::Shape {
            hidden,
            ..shapes::by_name(name).unwrap()
        };
        let (_d, model) = synth_shape(shape, quant, 67);
        let toks = test_tokens(&model, 71);
        let what = format!("{name} {quant:?} hidden {hidden}");
        let (on, off) = switch_arms(&model, "Q6_LANES8");
        let p = assert_same_logits(
            &on,
            &off,
            &model,
            &toks,
            &[1, 64, 7],
            &format!("{what}: Q6_LANES8 on and off differ"),
        );
        assert!(same_bits(&p[0], &p[1]), "{what}: batched != replay");
        eprintln!(
            "{what}: one-row Q6_K calls on 8 and 16 lanes a block equal, replayed and in chunks"
        );
    }
}

/// The decode MoE's lane GLU writing its outputs' Q8_K rows
/// (`mm_q4_k_lane_moe_glu_q8k_1`: the last block per 256 columns quantizes
/// them) against the GLU and a quantize launch: the same logits bytes at
/// every position, replayed (graph replays reuse the counters) and in
/// chunks, on every tiny shape and on expert widths of 768 (three counters
/// a row, as qwen3moe's), and fewer launches. Against the defaults (where
/// `DOWN_QIN` already quantizes inside the down projection, so neither arm
/// has a quantize launch) only the bytes are compared; the launch count is
/// taken with `DOWN_QIN` off in both arms, against the quantize launch.
#[test]
fn glu_output_quantization_in_the_glu_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    for shape in wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen3next"]) {
        let what = format!("{} expert_ff {}", shape.name, shape.expert_ff);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 43);
        let (on, off) = fusion_arms(&model, "GLU_Q8K", 13, KvType::F32, &what);
        assert!(
            on <= off,
            "{what}: {on} launches fused, {off} with DOWN_QIN"
        );
        let (on, off) = fusion_arms_with(
            &model,
            "GLU_Q8K",
            &[("DOWN_QIN", false)],
            13,
            KvType::F32,
            &format!("{what}, DOWN_QIN off"),
        );
        assert!(
            on < off,
            "{what}, DOWN_QIN off: {on} launches fused, {off} apart"
        );
        eprintln!("{what}: GLU with Q8_K rows == GLU + quantize_q8k; launches {on} against {off}");
    }
}

/// Decode's down projections quantizing the GLU's f32 rows themselves
/// (`DOWN_QIN`: `mm_q4_k_lane_moe_qin_1`, q8k_block into shared memory in
/// each block) against a quantize launch then `mm_q4_k_lane_moe_1`: the
/// same logits bytes at every position, replayed (graph replays too) and
/// in chunks, on every tiny shape (expert width 256: one block a row) and on
/// expert widths of 768 (three blocks a row, three warps quantizing), and
/// fewer launches.
#[test]
fn down_projections_quantizing_their_rows_equal_a_quantize_launch() {
    if !gpu() {
        return;
    }
    for shape in wide_glu_shapes(&["tiny-qwen3moe", "tiny-qwen35moe"]) {
        let what = format!("{} expert_ff {}", shape.name, shape.expert_ff);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 61);
        let (on, off) = fusion_arms(&model, "DOWN_QIN", 31, KvType::F32, &what);
        assert!(
            on < off,
            "{what}: {on} launches with the rows quantized in the down launch, {off} apart"
        );
        eprintln!(
            "{what}: down projections quantizing their rows == quantize_q8k + down; launches {on} against {off}"
        );
    }
}

/// Decode's post-mixer norm inside the MoE's router launch (`NORM_ROUTER`:
/// `mm_f32_multi_route_norm`, every block taking add_rms_norm_q8k's norm of
/// the row, the last storing the residual, the normed row and its Q8_K
/// rows) against add_rms_norm_q8k then the router launch: the same logits
/// bytes at every position, replayed (graph replays too) and in chunks, on
/// every tiny shape (hidden 256: one element of each of norm_row's threads)
/// and on hidden 2,048 as the real models' (eight elements a thread, eight
/// Q8_K blocks) with 256 experts and a shared expert (qwen35moe's router)
/// and 128 without (qwen3moe's), and fewer launches.
#[test]
fn post_mixer_norm_in_the_router_launch_equals_the_norm_launch() {
    if !gpu() {
        return;
    }
    let mut shapes: Vec<shapes::Shape> =
        SHAPES.iter().map(|s| shapes::by_name(s).unwrap()).collect();
    for (name, experts) in [("tiny-qwen35moe", 256), ("tiny-qwen3moe", 128)] {
        shapes.push(router_shape(name, 2048, experts));
    }
    for shape in shapes {
        let what = format!(
            "{} hidden {} experts {}",
            shape.name, shape.hidden, shape.experts
        );
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 67);
        let (on, off) = fusion_arms(&model, "NORM_ROUTER", 37, KvType::F32, &what);
        assert!(
            on < off,
            "{what}: {on} launches with the norm in the router launch, {off} apart"
        );
        eprintln!(
            "{what}: the norm in the router launch == add_rms_norm_q8k + router; launches {on} against {off}"
        );
    }
}

/// One decode row's conv, state shift and q/k head norms in one launch
/// (`conv_l2_one`) against conv_small and l2norm_qk: the same logits bytes
/// at every position, replayed and in chunks, on the delta-net shapes (key
/// and value heads of 64, and of 128 as the real models'), and fewer
/// launches.
#[test]
fn conv_and_head_norms_in_one_launch_equal_the_separate_kernels() {
    if !gpu() {
        return;
    }
    let tiny = shapes::by_name("tiny-qwen35moe").unwrap();
    let wide = shapes::Shape {
        delta: Some(shapes::DeltaNet {
            key_head_dim: 128,
            value_head_dim: 128,
            ..tiny.delta.unwrap()
        }),
        ..tiny.clone()
    };
    for shape in [shapes::by_name("tiny-qwen3next").unwrap(), tiny, wide] {
        let what = format!("{} dk {}", shape.name, shape.delta.unwrap().key_head_dim);
        let (_d, model) = synth_shape(shape, GgmlType::Q4_K, 47);
        let (on, off) = fusion_arms(&model, "CONV_L2", 19, KvType::F32, &what);
        assert!(on < off, "{what}: {on} launches fused, {off} apart");
        eprintln!("{what}: conv_l2_one == conv_small + l2norm_qk; launches {on} against {off}");
    }
}

/// Ungated attention's combine writing the out projection's Q8_K rows
/// (`attention_combine_q8k`) against attention_combine and a quantize
/// launch: the same logits bytes at every position (300 tokens: two key
/// tiles), replayed and in chunks, on tiny-qwen3moe and on Q4_K models of
/// the real models' ungated head shapes, and fewer launches.
#[test]
fn combine_quantization_equals_a_quantize_launch() {
    if !gpu() {
        return;
    }
    let base = shapes::by_name("tiny-qwen3moe").unwrap();
    let mut models = vec![(
        "tiny-qwen3moe".to_string(),
        synth("tiny-qwen3moe", GgmlType::Q4_K, 53),
    )];
    for (heads, kv_heads, head_dim) in [(32u32, 4u32, 128u32), (16, 4, 128)] {
        let shape = shapes::Shape {
            heads,
            kv_heads,
            head_dim,
            layers: 1,
            ..base.clone()
        };
        models.push((
            format!("attention {heads}/{kv_heads} x {head_dim}"),
            synth_shape(shape, GgmlType::Q4_K, 53),
        ));
    }
    for (what, (_d, model)) in &models {
        let (on, off) = fusion_arms(model, "COMBINE_Q8K", 23, KvType::F32, what);
        assert!(on < off, "{what}: {on} launches fused, {off} apart");
        eprintln!(
            "{what}: attention_combine_q8k == combine + quantize_q8k; launches {on} against {off}"
        );
    }
}

/// A decode MoE's combine adding into the residual and running the next
/// layer's input norm (`moe_combine_add_rms_norm_q8k`) against moe_combine
/// and add_rms_norm_q8k: the same logits bytes at every position, replayed
/// and in chunks, on every tiny shape (with and without a shared expert),
/// and fewer launches.
#[test]
fn moe_combine_with_the_next_norm_equals_the_separate_kernels() {
    if !gpu() {
        return;
    }
    for shape in SHAPES {
        let (_d, model) = synth(shape, GgmlType::Q4_K, 59);
        let (on, off) = fusion_arms(&model, "MOE_NORM", 29, KvType::F32, shape);
        assert!(on < off, "{shape}: {on} launches fused, {off} apart");
        eprintln!(
            "{shape}: moe_combine_add_rms_norm_q8k == combine + add_rms_norm_q8k; launches {on} against {off}"
        );
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
